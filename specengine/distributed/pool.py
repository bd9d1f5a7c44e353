"""``RolloutPool``: N engine instances as Ray actors behind one ``LLM``-like ``generate``.

Each actor (``RolloutWorker``) holds its own ``LLM`` with its own speculative config. A
``generate`` call seeds every unseeded request centrally (``requests.SeedSource``: the seeds one
``LLM`` with the same ``seed`` would draw), groups identical prompts, places the groups by
predicted work (``balance.assign``), streams each actor's finished requests back and returns
them in input order. With the same seeds, a pool samples what one engine samples (every request
carries its seed; sampling noise is keyed by (seed, sample, position), see ``sampling.py``).

What is guaranteed: ``RolloutPool(seed=s)`` fed a sequence of ``generate`` calls returns the
samples (token ids, logprobs, finish reasons) and request ids that one ``LLM(seed=s)`` returns for
the same calls, with any number of actors, any placement, any speculative configs, and after an
actor death; as for one engine, this holds while the target's logits come out bit for bit the same
(a preempted sequence recomputed by a prefill, or a bfloat16 tie, can part a sample, see the
README). A call refused with ValueError draws no seeds, as with one ``LLM``. Timing metrics and
``generate_time`` differ.

Faults: when an actor dies mid-rollout (``ray.exceptions.RayActorError``), the requests it had not
returned are placed again on the actors left (same params, so the same seeds and samples); what
it returned is kept, so nothing is lost or returned twice. A dead actor is not replaced. With no
actor left the call raises RuntimeError.

Migration: with ``controller=MigrationController()`` (``distributed/migration.py``) samples move
from a busy actor to an idle one during the rollout (two-stage K/V transfer or re-prefill);
actors are threaded (``max_concurrency`` 8) and step their engine one step per lock hold, so the
controller's status, export and import calls run between steps. A request split that way comes
back in parts; the pool joins them (``rollout.Rollout``), so ``generate`` still returns one output
per request, in input order, with the samples one engine would give.

Weights: ``update_weights`` / ``load_weights`` put the tensors into Ray's object store once
(``ray.put``) and send every actor the same reference.

Runs on whatever Ray the process is connected to: ``ray.init(num_cpus=2)`` on one machine, or
``ray.init(address="auto")`` / ``ray.init(address="ray://head:10001")`` on a cluster, unchanged
(specengine must be installed on every node; a checkpoint path given to ``load_weights`` is read
on each actor's node).

Spare-instance drafter training (TLT, ``distributed.training``): with ``harvest=True`` every
actor with an EAGLE drafter records its finished sequences' target features; the pool collects
them into a bounded store of object-store references. With ``spare_training=SpareTraining(...)``
an actor whose share of a ``generate`` is done while others still decode trains the EAGLE drafter
on them within a time budget (stopping when new work reaches it) and the pool publishes each
round's weights as the next drafter version to every actor (one stored object). Outputs do not
change (verification is lossless).
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterable, Mapping

import ray
import torch
from ray.exceptions import RayActorError

from specengine.distributed.balance import WorkModel, group_requests
from specengine.distributed.controller import PoolController
from specengine.distributed.requests import PoolRequest, SeedSource, prepare
from specengine.distributed.rollout import Rollout
from specengine.distributed.training import SpareScheduler, SpareTraining, merge_tau
from specengine.distributed.worker import RolloutWorker
from specengine.outputs import RequestOutput
from specengine.speculative.config import SpeculativeConfig


class RolloutPool:
    """A pool of ``LLM`` engines on Ray actors.

    Args:
        model: as ``LLM(model=...)``.
        num_actors: engine instances (>= 1).
        speculative_config: one dict (or None) for every actor, or a list with one per actor.
        seed: the pool's seed: unseeded requests get the seeds ``LLM(seed=seed)`` would draw.
        num_cpus_per_actor: Ray CPUs per actor; also its torch thread count.
        num_gpus_per_actor: Ray GPUs per actor (0 on CPU).
        controller: a ``PoolController`` (default: the no-op one); see ``controller.py``.
        actor_options: extra ``.options(...)`` for the actors (e.g. ``scheduling_strategy``,
            ``runtime_env``).
        harvest: actors with an EAGLE drafter record finished sequences' target features; the
            pool collects them (``harvested``) after each ``generate`` and before each training
            round.
        spare_training: a ``SpareTraining`` config: train the EAGLE drafter on spare actors
            (implies ``harvest``). Actors are always threaded (``max_concurrency`` 8 unless
            ``actor_options`` says otherwise).
        **llm_kwargs: the other ``LLM`` arguments (dtype, max_model_len, vLLM engine args ...),
            the same on every actor.

    Raises:
        ValueError: ``num_actors`` < 1, a speculative config list of the wrong length,
            ``spare_training`` not a ``SpareTraining`` or without any EAGLE actor;
            an actor's ``LLM`` construction error (re-raised from Ray).
    """

    def __init__(self, model: str, num_actors: int = 2, *,
                 speculative_config: dict | list[dict | None] | None = None, seed: int = 0,
                 num_cpus_per_actor: float = 1, num_gpus_per_actor: float = 0,
                 controller: PoolController | None = None, actor_options: dict | None = None,
                 harvest: bool = False, spare_training: SpareTraining | None = None,
                 **llm_kwargs):
        if not isinstance(num_actors, int) or num_actors < 1:
            raise ValueError(f"num_actors={num_actors!r}: must be an int >= 1")
        specs = speculative_config if isinstance(speculative_config, list) \
            else [speculative_config] * num_actors
        if len(specs) != num_actors:
            raise ValueError(f"speculative_config: {len(specs)} configs for {num_actors} actors")
        for i, spec in enumerate(specs):  # fail here, not after the actors started
            try:
                SpeculativeConfig.from_dict(spec)
            except ValueError as e:
                raise ValueError(f"actor {i}: {e}") from None
        if spare_training is not None and not isinstance(spare_training, SpareTraining):
            raise ValueError(f"spare_training is a {type(spare_training).__name__}; expected "
                             "a SpareTraining or None")
        self.seeds = SeedSource(seed)
        self.work = WorkModel()
        self.controller = controller or PoolController()
        # threaded: migration calls, spare-training rounds and their stops run between steps
        options = {"max_concurrency": 8, **(actor_options or {})}
        cls = ray.remote(RolloutWorker).options(
            num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_actor, **options)
        threads = max(1, int(num_cpus_per_actor))
        self.actors = {i: cls.remote(dict(llm_kwargs, model=model, seed=seed,
                                          speculative_config=spec), threads)
                       for i, spec in enumerate(specs)}
        self.alive = list(self.actors)
        ray.get([a.info.remote() for a in self.actors.values()])  # raise construction errors
        self.spare: SpareScheduler | None = None  # harvest store and spare-instance training
        if harvest or spare_training is not None:
            cfg = spare_training or SpareTraining()
            eagle = ray.get([a.enable_harvest.remote(cfg.max_rollouts, cfg.max_bytes)
                             for a in self.actors.values()])
            if spare_training is not None and not any(eagle):
                for a in self.actors.values():
                    ray.kill(a)
                raise ValueError("spare_training: no actor has an EAGLE drafter to train "
                                 "(speculative_config method 'eagle')")
            self.spare = SpareScheduler(self, spare_training, cfg.max_rollouts, cfg.max_bytes,
                                        {a for a, ok in zip(self.actors, eagle) if ok})
        self.num_objects_put = 0  # ray.put calls (one per weight update / chunk)
        self.num_requests_rerun = 0  # requests re-run after their actor died
        self.dead: dict[int, str] = {}  # actor id -> why
        self._next_id = 0
        self._runs = itertools.count()  # generate calls (actor-side request ids "<run>.<index>")

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """``LLM.generate`` over the pool: same arguments, outputs in input order,
        ``request_id`` numbered as one ``LLM`` numbers them (0, 1, ... across calls).

        Raises:
            ValueError: a bad prompt or params (nothing is generated, no seed is drawn).
            RuntimeError: every actor has died.
        """
        del use_tqdm  # accepted for LLM compatibility; the pool shows no progress bar
        state = self.seeds.state()
        try:
            reqs = prepare(prompts, sampling_params, self.seeds)
        except ValueError:
            self.seeds.restore(state)
            raise
        results: list[RequestOutput | None] = [None] * len(reqs)
        try:
            self._run(reqs, results)
        except ValueError:
            self.seeds.restore(state)
            raise
        for i, out in enumerate(results):
            out.request_id = str(self._next_id + i)
        self._next_id += len(results)
        return results

    def _run(self, reqs: list[PoolRequest], results: list) -> None:
        """Dispatch ``reqs`` and collect their outputs into ``results`` (by index): parts of
        requests split by migration are joined, the unfinished requests of actors that die are
        placed again; the controller's ``on_tick`` runs every ``controller.interval`` seconds;
        with spare training, actors whose calls ended train between (``SpareScheduler``)."""
        run = Rollout(self, reqs, results, next(self._runs))
        ctl, spare = self.controller, self.spare
        self._require_alive()
        try:
            run.launch(ctl.place(self, group_requests(reqs), list(self.alive), self.work))
            if spare is not None:
                spare.begin(run.events, run.busy())
            last = time.perf_counter()
            while not run.complete():
                if not run.calls:
                    raise RuntimeError(f"RolloutPool: every actor call ended with requests "
                                       f"{run.missing()} unfinished")
                wait = None if ctl.interval is None else max(
                    0.0, ctl.interval - (time.perf_counter() - last))
                try:
                    kind, cid, payload = run.events.get(timeout=wait)
                except queue.Empty:
                    kind = None
                if kind == "trained":  # a spare-instance training round ended (payload: its id)
                    spare.on_trained(payload, run.busy(), run.events)
                elif kind is not None:
                    actor_id = run.handle(kind, cid, payload)
                    if kind == "done" and spare is not None and actor_id in self.alive:
                        spare.on_idle(actor_id, run.busy(), run.events)
                if ctl.interval is not None and (ctl.due or time.perf_counter() - last
                                                 >= ctl.interval) and not run.complete():
                    ctl.due = False
                    ctl.on_tick(self, run)
                    last = time.perf_counter()
        finally:
            try:  # after an error, or samples still running twice after a re-run
                if not run.complete() or run.reran:
                    run.abort()
            finally:
                if spare is not None:
                    spare.finish()

    def _consume(self, cid: int, actor_id: int, items: list, events: queue.Queue) -> None:
        """Thread body: stream one actor call's outputs into ``events``."""
        try:
            stream = self.actors[actor_id].rollout.options(num_returns="streaming").remote(items)
            for ref in stream:
                events.put(("out", cid, ray.get(ref)))
            events.put(("done", cid, None))
        except RayActorError as e:
            events.put(("dead", cid, e))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            events.put(("error", cid, e))

    def _mark_dead(self, actor_id: int, error: Exception) -> None:
        if actor_id in self.alive:
            self.alive.remove(actor_id)
            self.dead[actor_id] = f"{type(error).__name__}: {str(error).splitlines()[0]}"

    def _require_alive(self, unfinished: int = 0) -> None:
        if not self.alive:
            raise RuntimeError(f"RolloutPool: no actor is left ({len(self.dead)} died: "
                               f"{self.dead}); {unfinished} requests unfinished")

    # ---- broadcast calls --------------------------------------------------------------------
    def _broadcast(self, method: str, *args) -> list:
        """Call ``method`` on every live actor; results in actor order. An actor found dead is
        dropped (RuntimeError if none is left)."""
        return list(self._broadcast_by_actor(method, *args).values())

    def _broadcast_by_actor(self, method: str, *args) -> dict:
        self._require_alive()
        refs = [(a, getattr(self.actors[a], method).remote(*args)) for a in list(self.alive)]
        out = {}
        for a, ref in refs:
            try:
                out[a] = ray.get(ref)
            except RayActorError as e:
                self._mark_dead(a, e)
        self._require_alive()
        return out

    def _put(self, obj) -> list:
        """``obj`` into the object store once; returns ``[ref]`` (a list, so each actor receives
        the reference itself and fetches the one stored copy)."""
        self.num_objects_put += 1
        return [ray.put(obj)]

    @staticmethod
    def _payload(weights: Mapping | Iterable) -> list:
        """``(name, tensor)`` pairs, tensors detached (an ``nn.Parameter`` pickles with its
        autograd flag; the engine needs the values only). No copy is made here."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        return [(name, t.detach() if isinstance(t, torch.Tensor) else t) for name, t in pairs]

    def update_weights(self, weights: Mapping | Iterable) -> list[str]:
        """``LLM.update_weights`` on every actor; the tensors are put in the object store once.
        Returns the names applied (by the first actor; all apply the same).

        Raises:
            ValueError / TypeError / RuntimeError: as ``LLM.update_weights`` (from the actors).
        """
        return self._broadcast("update_weights", self._put(self._payload(weights)))[0]

    def begin_weight_update(self) -> None:
        """``LLM.begin_weight_update`` on every actor."""
        self._broadcast("begin_weight_update")

    def load_weights(self, weights) -> list[str]:
        """``LLM.load_weights`` on every actor: a chunk (put in the object store once) or a
        checkpoint path (read by each actor on its own node). Returns the names staged."""
        if isinstance(weights, str):
            return self._broadcast("load_weights", weights)[0]
        if isinstance(weights, tuple) and len(weights) == 2 and isinstance(weights[0], str):
            weights = [weights]
        return self._broadcast("load_weights", self._put(self._payload(weights)))[0]

    def finish_weight_update(self, weight_version: int | None = None) -> list[str]:
        """``LLM.finish_weight_update`` on every actor."""
        return self._broadcast("finish_weight_update", weight_version)[0]

    def abort_weight_update(self) -> bool:
        """``LLM.abort_weight_update`` on every actor; True if any had a session open."""
        return any(self._broadcast("abort_weight_update"))

    def sleep(self, level: int = 1) -> list[dict[str, int]]:
        """``LLM.sleep`` on every actor; the bytes each released."""
        return self._broadcast("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLM.wake_up`` on every actor."""
        self._broadcast("wake_up", tags)

    def reset_prefix_cache(self) -> bool:
        """``LLM.reset_prefix_cache`` on every actor; True if all reset."""
        return all(self._broadcast("reset_prefix_cache"))

    def get_metrics(self) -> dict:
        """``actors``: actor id -> its ``LLM.get_metrics()`` (live actors); ``num_actors``,
        ``num_actors_dead``, ``num_requests_rerun``, ``num_objects_put``; the controller's
        ``metrics()`` (a ``MigrationController``'s ``migration_*`` keys). With ``harvest`` /
        ``spare_training``: ``spare_training`` (``SpareScheduler.stats``: train seconds, steps,
        rounds, versions published, newest drafter version, harvested rollouts),
        ``drafter_versions`` (actor id -> drafter version in use; EAGLE actors) and
        ``tau_per_drafter_version`` (drafter version -> tokens committed per verify step, over
        the pool)."""
        d = {"actors": self._broadcast_by_actor("get_metrics"),
             "num_actors": len(self.alive), "num_actors_dead": len(self.dead),
             "num_requests_rerun": self.num_requests_rerun,
             "num_objects_put": self.num_objects_put, **self.controller.metrics()}
        if self.spare is not None:
            d["spare_training"] = self.spare.stats()
            d["drafter_versions"] = {a: m["drafter_version"] for a, m in d["actors"].items()
                                     if "drafter_version" in m}
            counts = [c for c in self._broadcast("drafter_counts") if c is not None]
            d["tau_per_drafter_version"] = merge_tau(counts)
        return d

    def harvested(self) -> list:
        """ObjectRefs of the harvested rollout chunks the pool holds (``list[Rollout]`` each,
        oldest first; ``harvest=True``), e.g. for training elsewhere. Empty without harvest."""
        return self.spare.store.refs() if self.spare is not None else []

    def shutdown(self) -> None:
        """Kill every actor (the pool is unusable afterwards)."""
        for a in self.actors.values():
            ray.kill(a)
        self.dead.update({a: "shut down" for a in self.alive})
        self.alive = []
