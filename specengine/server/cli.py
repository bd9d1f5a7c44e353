"""The ``specengine serve`` subcommand: load a model and serve it over HTTP with uvicorn.

Limits and security flags map one to one onto ``specengine.server.options.ServerOptions`` (their
defaults are its defaults); vLLM's names where vLLM has the flag (``--api-key``,
``--max-logprobs``, ``--trust-request-chat-template``), SGLang's for
``--max-queued-requests``."""

from __future__ import annotations

import argparse
import os
import sys

from specengine.cli_args import speculative_config_arg
from specengine.models.registry import DEFAULT_MODEL

API_KEY_ENV = "SPECENGINE_API_KEY"
MiB, GiB = 1 << 20, 1 << 30


def add_serve_cli(sub) -> None:
    """Add the ``serve`` subparser to ``specengine``'s subcommands (imports nothing heavy)."""
    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI- and TRL-compatible)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Serve a model over HTTP: OpenAI /v1/completions and "
                       "/v1/chat/completions (streaming too), TRL vllm-serve routes, /health, "
                       "/metrics. Concurrent requests are batched together.")
    _add_model_flags(s)
    _add_security_flags(s)
    _add_limit_flags(s)


def _add_model_flags(s) -> None:
    """The model, address and engine flags of ``serve``."""
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help="known alias, Hugging Face directory or .gguf file")
    s.add_argument("--served-model-name", default=None,
                   help="the 'model' name clients send (None: the --model value)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the target's dtype")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (None: the model's)")
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="bytes for the paged KV cache (None: 1 GiB)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    s.add_argument("--seed", type=int, default=0,
                   help="seeds the requests that carry no seed of their own")
    s.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "processed_logprobs"],
                   help="processed_logprobs is what TRL and verl use for importance sampling")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def _add_security_flags(s) -> None:
    """The ``security`` group of ``serve`` (``ServerOptions``' exposure fields)."""
    sec = s.add_argument_group(
        "security", "What the server exposes and to whom (README: Security). By default it "
        "listens on 127.0.0.1 only, answers only Host: localhost/127.0.0.1/[::1], needs no key "
        "and serves no control route.")
    sec.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health "
                     f"(None: ${API_KEY_ENV} when set, else no key)")
    sec.add_argument("--enable-control-routes", action="store_true",
                     help="serve the routes that change the server: sleep/wake_up, weight "
                     "pushes and weights from disk, prefix-cache reset, abort; TRL's "
                     "/update_named_param/, /reset_prefix_cache/, /init_communicator/, "
                     "/close_communicator/ (off: 404 for them). TRL's GRPOTrainer with "
                     "vllm_mode='server' needs this flag (it resets the prefix cache and "
                     "pushes weights through them); so do verl/slime/OpenRLHF weight syncs")
    sec.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                     help="Host header values accepted ('*': any; None: localhost, "
                     "127.0.0.1, [::1] when --host is a loopback address, else any)")
    sec.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a 'chat_template' in requests (off: a 400)")
    sec.add_argument("--chat-template-timeout", type=float, default=10.0, metavar="S",
                     help="seconds a chat template may take to render (then a 400)")
    sec.add_argument("--allowed-weight-dirs", nargs="+", default=[], metavar="DIR",
                     help="directories /update_weights_from_disk may load from ([]: "
                     "every path is refused)")


def _add_limit_flags(s) -> None:
    """The ``limits`` group of ``serve`` (``ServerOptions``' per-request and server-wide
    limits)."""
    lim = s.add_argument_group("limits", "Per-request and server-wide limits (requests over "
                               "them get 4xx answers; nothing else is affected).")
    lim.add_argument("--max-request-body-bytes", type=int, default=16 * MiB, metavar="B",
                     help="largest request body in bytes (413)")
    lim.add_argument("--max-weight-body-bytes", type=int, default=4 * GiB, metavar="B",
                     help="largest weight-push body (/update_named_param/, /update_weights)")
    lim.add_argument("--max-queued-requests", type=int, default=4096, metavar="N",
                     help="most engine requests (one per prompt) in flight, running or "
                     "waiting; more: 429 with Retry-After")
    lim.add_argument("--max-n", type=int, default=256, metavar="N",
                     help="most samples per prompt (also capped by the engine's max_num_seqs)")
    lim.add_argument("--max-prompts-per-request", type=int, default=1024, metavar="N",
                     help="most prompts in one request (batch completions, TRL /generate/)")
    lim.add_argument("--max-stop-strings", type=int, default=16, metavar="N",
                     help="most stop strings per request")
    lim.add_argument("--max-stop-string-len", type=int, default=512, metavar="CHARS",
                     help="longest stop string, in characters")
    lim.add_argument("--max-logprobs", type=int, default=20, metavar="K",
                     help="most logprobs / top_logprobs / prompt_logprobs per token (vLLM's "
                     "flag; -1: the vocabulary size)")
    lim.add_argument("--request-timeout", type=float, default=1800.0, metavar="S",
                     help="seconds a request may take from admission; then it is aborted "
                     "and answered 504 (0: no limit)")
    lim.add_argument("--max-request-memory-bytes", type=int, default=1 * GiB, metavar="B",
                     help="most host memory one request's outputs may take at their longest "
                     "(prompts x n x max_tokens, logprobs included); more: 400")


def server_options(args: argparse.Namespace):
    """``ServerOptions`` from the parsed ``serve`` arguments (the API key from
    ``SPECENGINE_API_KEY`` when ``--api-key`` is not given).

    Raises:
        ValueError: an option out of range (the message names it).
    """
    from specengine.server.options import ServerOptions

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return ServerOptions(
        api_key=key, enable_control_routes=args.enable_control_routes, host=args.host,
        allowed_hosts=args.allowed_hosts,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout=args.chat_template_timeout,
        allowed_weight_dirs=list(args.allowed_weight_dirs),
        max_request_body_bytes=args.max_request_body_bytes,
        max_weight_body_bytes=args.max_weight_body_bytes,
        max_queued_requests=args.max_queued_requests, max_n=args.max_n,
        max_prompts_per_request=args.max_prompts_per_request,
        max_stop_strings=args.max_stop_strings, max_stop_string_len=args.max_stop_string_len,
        request_timeout=args.request_timeout or None,
        max_request_memory_bytes=args.max_request_memory_bytes)


def exposure_warnings(options) -> list[str]:
    """Warnings for a server others can reach without a key."""
    from specengine.server.options import is_loopback

    if options.api_key or is_loopback(options.host):
        return []
    out = [f"warning: listening on {options.host} without an API key: anyone who can reach "
           f"this address can generate (set --api-key or ${API_KEY_ENV})"]
    if options.enable_control_routes:
        out.append("warning: --enable-control-routes without an API key on a non-loopback "
                   "address: anyone who can reach it can put the engine to sleep or replace "
                   "its weights")
    return out


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 2 for bad arguments or a missing ``serve`` extra."""
    try:
        import uvicorn

        from specengine.server.app import build_app
    except ImportError as e:
        print(f"error: specengine serve needs FastAPI and uvicorn "
              f"(pip install 'specengine[serve]'): {e}", file=sys.stderr)
        return 2
    from specengine.api import LLM

    if not 0 <= args.port <= 65535:
        print(f"error: --port {args.port} must be in [0, 65535]", file=sys.stderr)
        return 2
    try:
        spec = speculative_config_arg(args.speculative_config)
        options = server_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in exposure_warnings(options):
        print(line, file=sys.stderr)
    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed,
                  speculative_config=spec, logprobs_mode=args.logprobs_mode,
                  max_logprobs=args.max_logprobs)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = build_app(llm, args.served_model_name or args.model, options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
