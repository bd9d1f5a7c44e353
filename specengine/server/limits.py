"""The server's per-request limits on sampling parameters (``check_sampling_limits``) and on
the host memory a request's outputs may take (``request_memory_bytes``, ``memory_error``);
``ServerState`` applies them with its options and its model's sizes."""

from __future__ import annotations

import dataclasses

from specengine.sampling.params import SamplingParams
from specengine.server.options import MiB, ServerOptions
from specengine.server.protocol import APIError

# Host memory one request's outputs take, per token (measured with tracemalloc on CPython
# 3.11): a token id in a list ~40 bytes; with logprobs a {token: Logprob} dict per token,
# ~400 bytes for the sampled token alone and ~185 bytes per further top entry.
TOKEN_BYTES = 40
LOGPROB_DICT_BYTES = 400
LOGPROB_ENTRY_BYTES = 185


def check_sampling_limits(p: SamplingParams, options: ServerOptions, max_n: int,
                          max_logprobs: int, vocab_size: int,
                          names: dict[str, str] | None = None) -> None:
    """Everything in ``p`` beyond ``SamplingParams``' own range checks that the server
    limits, as a 400 naming the request's field (``names`` maps a ``SamplingParams``
    field to it, e.g. ``logprobs`` -> ``top_logprobs``):

    - ``n`` <= ``max_n`` (``options.max_n`` and the engine's ``max_num_seqs``);
    - ``logprobs`` / ``prompt_logprobs`` <= ``max_logprobs`` (the LLM's, vLLM's flag);
    - at most ``max_stop_strings`` stop strings of at most ``max_stop_string_len``
      characters; at most ``max_stop_token_ids`` stop token ids, each an integer in
      ``[0, vocab_size)``;
    - ``seed`` a 64-bit integer; boolean fields booleans; no ``return_hidden_states``
      (hidden states are not sent over HTTP).

    Raises:
        APIError: 400 for the first limit passed.
    """
    names = names or {}

    def fail(f: str, msg: str):
        raise APIError(msg, param=names.get(f, f))

    if p.n > max_n:
        why = "--max-n" if max_n == options.max_n else \
            "the engine's max_num_seqs: a prompt's samples are admitted together"
        fail("n", f"n={p.n} is more than this server allows per prompt: at most "
                  f"{max_n} ({why})")
    for f in ("logprobs", "prompt_logprobs"):
        k = getattr(p, f)
        if k is not None and k > max_logprobs:
            fail(f, f"{names.get(f, f)}={k} is above max_logprobs={max_logprobs} "
                    "(the server's --max-logprobs)")
    _check_stops(p, options, vocab_size, fail)
    if p.seed is not None and not -(1 << 63) <= p.seed < (1 << 64):
        fail("seed", f"seed={p.seed} must be a 64-bit integer")
    for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
              "return_hidden_states"):
        if not isinstance(getattr(p, f), bool):
            fail(f, f"{names.get(f, f)} must be true or false")
    if p.return_hidden_states:
        fail("return_hidden_states", "return_hidden_states is not available over HTTP")


def _check_stops(p: SamplingParams, options: ServerOptions, vocab_size: int, fail) -> None:
    """The stop strings' and stop token ids' limits of ``check_sampling_limits``."""
    stops = p.stop_strings
    if len(stops) > options.max_stop_strings:
        fail("stop", f"{len(stops)} stop strings; at most "
                     f"{options.max_stop_strings} (--max-stop-strings)")
    longest = max((len(s) for s in stops), default=0)
    if longest > options.max_stop_string_len:
        fail("stop", f"a stop string of {longest} characters; at most "
                     f"{options.max_stop_string_len} (--max-stop-string-len)")
    ids = p.stop_token_ids
    if len(ids) > options.max_stop_token_ids:
        fail("stop_token_ids", f"{len(ids)} stop token ids; at most "
                               f"{options.max_stop_token_ids}")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
           or not 0 <= t < vocab_size]
    if bad:
        fail("stop_token_ids", f"stop_token_ids {bad[:5]!r} are not token ids of the "
                               f"vocabulary [0, {vocab_size})")


def request_memory_bytes(prompts: list, params: list[SamplingParams]) -> int:
    """Host memory the outputs of one request take at their longest, bytes: per sample
    its token ids (prompt + ``max_tokens``, ``TOKEN_BYTES`` each) and, with ``logprobs``
    = k, a dict of k + 1 entries per output token; with ``prompt_logprobs`` the same per
    prompt token (once per prompt). ``prompts``: ``state.Prompt``s (their ``token_ids``)."""
    total = 0
    for pr, sp in zip(prompts, params):
        n_prompt = len(pr.token_ids)
        per_sample = (n_prompt + sp.max_tokens) * TOKEN_BYTES
        if sp.logprobs is not None:
            per_sample += sp.max_tokens * (LOGPROB_DICT_BYTES
                                           + sp.logprobs * LOGPROB_ENTRY_BYTES)
        total += sp.n * per_sample
        if sp.prompt_logprobs is not None:
            total += n_prompt * (LOGPROB_DICT_BYTES + sp.prompt_logprobs
                                 * LOGPROB_ENTRY_BYTES)
    return total


def memory_error(prompts: list, params: list[SamplingParams], cap: int,
                 names: dict[str, str] | None = None) -> APIError | None:
    """The 400 for a request whose ``request_memory_bytes`` is above ``cap`` (bytes): naming
    ``logprobs`` when the request would fit without them, else ``n``; None when it fits."""
    need = request_memory_bytes(prompts, params)
    if need <= cap:
        return None
    names = names or {}
    plain = [dataclasses.replace(sp, logprobs=None, prompt_logprobs=None) for sp in params]
    param = "logprobs" if request_memory_bytes(prompts, plain) <= cap else "n"
    return APIError(f"this request's outputs could take {need / MiB:.0f} MiB of host memory "
                    f"at their longest (prompts x n x max_tokens, with logprobs); at most "
                    f"{cap / MiB:.0f} MiB (--max-request-memory-bytes): ask for fewer "
                    "samples, tokens or logprobs", param=names.get(param, param))
