"""Running a batch of prepared prompts to the end (``LLM.generate`` / ``generate_iter``):
``run_requests`` adds them to the engine and steps it, yielding each request as it finishes."""

from __future__ import annotations

from tqdm.auto import tqdm

from specengine.engine.sequence import PartialSample
from specengine.sampling.params import SamplingParams


def run_requests(engine, tokenized: list[tuple[str | None, list[int]]],
                 params: list[SamplingParams], use_tqdm: bool,
                 partials: list[PartialSample | None] | None = None):
    """Add one request per prompt (``tokenized``: ``(text or None, token ids)``, already
    checked; ``partials``: the sample each continues, or None) and step ``engine`` until
    none is unfinished, yielding ``(prompt_index, RequestOutput)`` as each finishes. Every
    unfinished request of the engine is aborted at the end (a no-op after a normal finish;
    frees the KV after an error or when the caller stops early)."""
    index = {}
    partials = partials or [None] * len(tokenized)
    try:
        for i, ((text, tok), p, part) in enumerate(zip(tokenized, params, partials)):
            index[engine.add_request(tok, p, prompt=text, partial=part)] = i
        with tqdm(total=len(index), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while engine.has_unfinished():
                for out in engine.step():
                    bar.update(1)
                    yield index[out.request_id], out
    finally:
        engine.abort_all()
