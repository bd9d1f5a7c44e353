"""Online training of the EAGLE drafter while the engine serves: ``DrafterTrainer`` fits a
float32 copy of an ``EagleDrafter``'s weights on rollouts a ``Harvester`` collects from the same
engine, and publishes new versions that the drafter swaps in between engine steps (hot swap).
"""

from __future__ import annotations

import random
import threading
import time

from specengine.speculative.drafters.eagle import EagleDrafter
from specengine.speculative.training.fit import Fitter, TrainConfig, trainable_copy
from specengine.speculative.training.harvest import HiddenBuffer, SequenceFeatures


class DrafterTrainer:
    """Trains an ``EagleDrafter``'s weights in a background thread on harvested rollouts and
    publishes new versions; the drafter swaps them in between engine steps (outputs never
    change: verification is lossless whatever the drafter).

    Args:
        drafter: the engine's ``EagleDrafter``.
        buffer: filled by a ``Harvester`` on the same engine (``harvest(llm, buffer)``).
        cfg: training hyper-parameters (``cfg.steps`` is the schedule length).
        publish_every: optimizer steps between published versions.
        min_rollouts: wait for this many rollouts before training.

    Use ``start(max_steps=None, max_seconds=None)``, ``stop()``, or ``train_now(steps)`` to run
    synchronously. ``versions`` lists ``(version, step, seconds)``.
    """

    def __init__(self, drafter: EagleDrafter, buffer: HiddenBuffer, cfg: TrainConfig | None = None,
                 publish_every: int = 20, min_rollouts: int = 4):
        self.drafter, self.buffer = drafter, buffer
        self.cfg = cfg or TrainConfig(steps=200, warmup=10, lr=5e-4)
        self.model = trainable_copy(drafter.model)
        self.fitter = Fitter(self.model, self.cfg)
        self.publish_every, self.min_rollouts = publish_every, min_rollouts
        self.version = drafter.version
        self.versions: list[tuple[int, int, float]] = []
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(self.cfg.seed)

    def _batch(self) -> list[SequenceFeatures] | None:
        data = self.buffer.snapshot()
        if len(data) < self.min_rollouts:
            return None
        self._rng.shuffle(data)
        batch, used = [], 0
        for r in data:
            n = min(len(r.token_ids), self.cfg.max_len)
            if batch and (len(batch) + 1) * max(used, n) > self.cfg.batch_tokens:
                break
            batch.append(r)
            used = max(used, n)
        return batch

    def publish(self) -> int:
        """Hand the current weights to the drafter as a new version; returns it."""
        self.version += 1
        dtype = self.drafter.model.fc.dtype
        sd = {k: v.detach().to(dtype).clone() for k, v in self.model.state_dict().items()}
        self.drafter.publish(sd, self.version)
        self.versions.append((self.version, self.fitter.step_no, time.perf_counter()))
        return self.version

    def train_now(self, steps: int) -> int:
        """Run ``steps`` updates in this thread (fewer if the buffer is too small), publish;
        returns the steps run."""
        done = 0
        for _ in range(steps):
            batch = self._batch()
            if batch is None:
                break
            self.last = self.fitter.step(batch)
            done += 1
        if done:
            self.publish()
        return done

    def start(self, max_steps: int | None = None, max_seconds: float | None = None) -> None:
        """Train in a background thread until ``stop``, ``max_steps`` or ``max_seconds``."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("DrafterTrainer is already running")
        self._stop.clear()

        def loop():
            t0, n = time.perf_counter(), 0
            while not self._stop.is_set():
                if max_steps is not None and n >= max_steps:
                    break
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    break
                batch = self._batch()
                if batch is None:
                    self._stop.wait(0.05)
                    continue
                self.last = self.fitter.step(batch)
                n += 1
                if n % self.publish_every == 0:
                    self.publish()
            if n % self.publish_every:
                self.publish()

        self._thread = threading.Thread(target=loop, name="drafter-trainer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to finish (it publishes what it has) and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
