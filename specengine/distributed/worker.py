"""``RolloutWorker``: the body of one pool actor, an ``LLM`` behind Ray.

``RolloutPool`` runs it as ``ray.remote(RolloutWorker)``; ``OpenRLHFRolloutActor`` extends it.
It holds one ``LLM`` (own speculative config, own KV cache) and exposes its calls; weights arrive
as a Ray ``ObjectRef`` inside a list (so Ray hands the actor the reference, not a copy made per
call) and are fetched from the object store here. Every call holds ``self.lock``: a threaded
actor (``max_concurrency > 1``) never runs two engine calls at once.

Spare-instance drafter training: the methods of ``training.SpareTrainingActor`` (harvest,
train a round, publish); ``rollout`` announces itself there (``rollout_begins`` / ``_ends``).
"""

from __future__ import annotations

import os
import threading

import ray
import torch

from specengine.api import LLM
from specengine.distributed.training import SpareTrainingActor
from specengine.sampling import SamplingParams


class RolloutWorker(SpareTrainingActor):
    """One engine of a rollout pool.

    Args:
        llm_kwargs: keyword arguments of ``LLM`` (model, dtype, speculative_config, seed, vLLM
            engine arguments ...).
        num_threads: torch threads (the CPUs Ray gave the actor); None leaves torch's default.

    Raises:
        ValueError: from ``LLM`` (bad arguments).
    """

    def __init__(self, llm_kwargs: dict, num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(max(1, int(num_threads)))
        self.lock = threading.RLock()
        self.llm = LLM(**llm_kwargs)
        self.objects_received: list[str] = []  # hex ids of the ObjectRefs fetched here
        self.init_spare_training()

    def info(self) -> dict:
        """Where the actor runs: ``pid``, ``node_id`` (Ray node), ``num_threads`` (torch)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "num_threads": torch.get_num_threads()}

    def rollout(self, items: list[tuple[int, object, SamplingParams]]):
        """Generate ``items`` (``(index, prompt, params)``) in one batch; yields
        ``(index, RequestOutput)`` as each request finishes (a Ray streaming generator, so the
        pool keeps what finished if this actor dies later).

        Raises:
            ValueError: a bad prompt or params (from ``LLM.generate_iter``); nothing runs then.
        """
        self.rollout_begins()  # a spare-instance training round here stops first
        try:
            with self.lock:
                index = [i for i, _, _ in items]
                it = self.llm.generate_iter([p for _, p, _ in items], [s for _, _, s in items],
                                            use_tqdm=False)
                for k, out in it:
                    yield index[k], out
        finally:
            self.rollout_ends()

    def _fetch(self, refs: list):
        self.objects_received.append(refs[0].hex())
        return ray.get(refs[0])

    def update_weights(self, refs: list) -> list[str]:
        """``LLM.update_weights`` with the weights at ``refs[0]`` (an ObjectRef)."""
        weights = self._fetch(refs)
        with self.lock:
            return self.llm.update_weights(weights)

    def begin_weight_update(self) -> None:
        """``LLM.begin_weight_update``."""
        with self.lock:
            self.llm.begin_weight_update()

    def load_weights(self, source) -> list[str]:
        """``LLM.load_weights`` with a chunk at ``source[0]`` (a list holding an ObjectRef), or
        a checkpoint path (str, read on this actor's node)."""
        chunk = source if isinstance(source, str) else self._fetch(source)
        with self.lock:
            return self.llm.load_weights(chunk)

    def finish_weight_update(self, weight_version: int | None = None) -> list[str]:
        """``LLM.finish_weight_update``."""
        with self.lock:
            return self.llm.finish_weight_update(weight_version)

    def abort_weight_update(self) -> bool:
        """``LLM.abort_weight_update``."""
        with self.lock:
            return self.llm.abort_weight_update()

    def sleep(self, level: int = 1) -> dict[str, int]:
        """``LLM.sleep``: bytes released."""
        with self.lock:
            return self.llm.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLM.wake_up``."""
        with self.lock:
            self.llm.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """``LLM.reset_prefix_cache``."""
        with self.lock:
            return self.llm.reset_prefix_cache()

    def get_metrics(self) -> dict:
        """``LLM.get_metrics``."""
        with self.lock:
            return self.llm.get_metrics()

    def received_objects(self) -> list[str]:
        """Hex ids of the object-store references this actor fetched, oldest first."""
        return list(self.objects_received)

    def weight_version(self) -> int:
        """``LLM.weight_version``."""
        return self.llm.weight_version
