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
actor left the call raises RuntimeError. A request is re-placed at most ``max_request_retries``
times (default 1): one that is on an actor when it dies after that many re-placements (a poison
request: its prompt or params crash the engine process) fails alone: ``generate`` returns or
raises everything else (``RequestFailedError`` names the request and the actors it was on;
the other requests' outputs ride on it). So the blame is exact, a re-placed request runs on an
actor that holds no other re-placed request (``generate_run.RetryingRun``): when such an actor
dies, its re-placed request is the one that was on two dying actors, and its first-run requests are
re-placed as the dead actor's victims, not failed. Re-placed requests beyond one per live actor
wait for a free actor (after a death with many requests in flight, their re-runs go one per
actor at a time, beside the actors' own work). A poison request so costs two actors, never the
pool. Two independent faults can still blame a re-placed request wrongly (a fresh poison
request killing the actor it shares), and samples moved by migration may share an actor with
another re-placed request.

Migration: with ``controller=MigrationController()`` (``distributed/migration_controller.py``)
samples move from a busy actor to an idle one during the rollout (two-stage K/V transfer or
re-prefill); actors are threaded (``max_concurrency`` 8) and step their engine one step per lock
hold, so the controller's status, export and import calls run between steps. A request split
that way comes back in parts; the pool joins them (``generate_run.GenerateRun``), so
``generate`` still returns one output per request, in input order, with the samples one engine
would give.

Weights: ``update_weights`` / ``load_weights`` put the tensors into Ray's object store once
(``ray.put``) and send every actor the same reference. Updates are all-or-nothing across the
actors, in two phases: every actor first stages the update (``RolloutWorker.stage_weight_update``:
checked and copied, the old weights still serving); only when every actor staged it does any
actor apply it (``finish_weight_update``, all with the same ``weight_version``). If staging fails
on one actor (a refused tensor, a missing file, requests in flight, an actor that dies), the
session is aborted on every actor and the error (of the actor's exception type: ValueError,
TypeError, FileNotFoundError, else RuntimeError) names the actor and says that nothing was
applied: every actor keeps the old weights and the same ``weight_version``. If applying then
fails on some actors but not all (it should not: every check ran in phase one), those actors are
retired (killed, listed in ``dead``, with a warning) so that every actor left serves the new
weights; if it fails on all, the sessions are aborted and the error says so.

Runs on whatever Ray the process is connected to: ``ray.init(num_cpus=2)`` on one machine, or
``ray.init(address="auto")`` / ``ray.init(address="ray://head:10001")`` on a cluster, unchanged
(specengine must be installed on every node; a checkpoint path given to ``load_weights`` is read
on each actor's node).

Spare-instance drafter training (TLT, ``distributed.spare_training``): with ``harvest=True`` every
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

import ray
from ray.exceptions import RayActorError

from specengine.distributed.balance import WorkModel, group_requests
from specengine.distributed.controller import PoolController
from specengine.distributed.generate_run import RetryingRun
from specengine.distributed.pool_weights import PoolWeightUpdates
from specengine.distributed.requests import PoolRequest, SeedSource, prepare
from specengine.distributed.spare_training import SpareScheduler, SpareTraining, merge_tau
from specengine.distributed.worker import RolloutWorker
from specengine.engine.outputs import RequestOutput
from specengine.speculative.config import SpeculativeConfig


class RequestFailedError(RuntimeError):
    """Requests of one ``RolloutPool.generate`` call failed alone: each was on an actor that
    died, was re-placed ``max_request_retries`` times, and was on an actor that died again.

    Attributes:
        failures: input index -> why (its request id, the actors that died holding it and
            their errors).
        outputs: the call's outputs in input order (request ids as ``generate`` gives them),
            None at the failed indices: every other request finished normally.
    """

    def __init__(self, failures: dict[int, str], outputs: list):
        self.failures, self.outputs = failures, outputs
        n, done = len(failures), sum(o is not None for o in outputs)
        super().__init__(f"{n} request{'s' if n > 1 else ''} failed ({done} of the call's "
                         f"{len(outputs)} finished; their outputs are in "
                         f"RequestFailedError.outputs): " + "; ".join(failures.values()))


class RolloutPool(PoolWeightUpdates):
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
        max_request_retries: times a request is re-placed after an actor holding it died
            (default 1); on the next death holding it, it fails alone (``RequestFailedError``).
        **llm_kwargs: the other ``LLM`` arguments (dtype, max_model_len, vLLM engine args ...),
            the same on every actor.

    Raises:
        ValueError: ``num_actors`` < 1, a speculative config list of the wrong length,
            ``spare_training`` not a ``SpareTraining`` or without any EAGLE actor,
            ``max_request_retries`` not an int >= 0; an actor's ``LLM`` construction error
            (re-raised from Ray).
    """

    def __init__(self, model: str, num_actors: int = 2, *,
                 speculative_config: dict | list[dict | None] | None = None, seed: int = 0,
                 num_cpus_per_actor: float = 1, num_gpus_per_actor: float = 0,
                 controller: PoolController | None = None, actor_options: dict | None = None,
                 harvest: bool = False, spare_training: SpareTraining | None = None,
                 max_request_retries: int = 1, **llm_kwargs):
        if not isinstance(num_actors, int) or num_actors < 1:
            raise ValueError(f"num_actors={num_actors!r}: must be an int >= 1")
        if not isinstance(max_request_retries, int) or isinstance(max_request_retries, bool) \
                or max_request_retries < 0:
            raise ValueError(f"max_request_retries={max_request_retries!r}: must be an int "
                             ">= 0")
        self.max_request_retries = max_request_retries
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
        self.num_requests_failed = 0  # requests failed alone (on too many dying actors)
        self._session = False  # a streamed weight update is open on every actor
        self.dead: dict[int, str] = {}  # actor id -> why
        self._next_id = 0
        self._runs = itertools.count()  # generate calls (actor-side request ids "<run>.<index>")
        self._current = None  # the RetryingRun of the generate call running (abort_all)

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False,
                 return_exceptions: bool = False) -> list[RequestOutput]:
        """``LLM.generate`` over the pool: same arguments, outputs in input order,
        ``request_id`` numbered as one ``LLM`` numbers them (0, 1, ... across calls). A request
        re-placed after an actor death has ``metrics["pool_retries"]`` (how many times).

        Args:
            return_exceptions: a request that failed alone (the module docstring, Faults)
                is returned in its place as a ``RequestFailedError`` (naming it) instead of
                being raised.

        Raises:
            ValueError: a bad prompt or params (nothing is generated, no seed is drawn).
            RuntimeError: every actor has died.
            RequestFailedError: requests failed alone (each was on ``max_request_retries`` + 1
                actors that died); the message names each one (request id, input index,
                actors), and ``.outputs`` holds every other request's output.
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
            failed, retries = self._run(reqs, results)
        except ValueError:
            self.seeds.restore(state)
            raise
        for i, out in enumerate(results):
            if out is not None:
                out.request_id = str(self._next_id + i)
                if retries[i]:
                    out.metrics["pool_retries"] = retries[i]
        failures = {i: f"request {self._next_id + i} ({why})" for i, why in failed.items()}
        self._next_id += len(results)
        if failures:
            if return_exceptions:
                return [RequestFailedError({i: failures[i]}, results) if i in failures else out
                        for i, out in enumerate(results)]
            raise RequestFailedError(failures, results)
        return results

    def _run(self, reqs: list[PoolRequest], results: list
             ) -> tuple[dict[int, str], dict[int, int]]:
        """Dispatch ``reqs`` and collect their outputs into ``results`` (by index): parts of
        requests split by migration are joined, the unfinished requests of actors that die are
        placed again (at most ``max_request_retries`` times each); the controller's ``on_tick``
        runs every ``controller.interval`` seconds; with spare training, actors whose calls
        ended train between (``SpareScheduler``). Returns the requests that failed alone
        (input index -> why; their ``results`` stay None) and each request's re-placements
        (input index -> count)."""
        run = self._current = RetryingRun(self, reqs, results, next(self._runs))
        ctl, spare = self.controller, self.spare
        self.require_alive()
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
            self._current = None
            try:  # after an error, or samples still running twice after a re-run
                if not run.complete() or run.reran:
                    run.abort()
            finally:
                if spare is not None:
                    spare.finish()
        return dict(sorted(run.failed.items())), run.retries

    def abort_all(self) -> int:
        """From another thread while ``generate`` runs: stop every request of it still
        generating; each comes back from ``generate`` with what it made so far
        (``finish_reason="abort"`` on the samples cut short: tokens, logprobs and weight
        versions, as ``LLM.abort_request``). Returns how many requests were stopped (0 when
        no ``generate`` runs)."""
        run = self._current
        if run is None:
            return 0
        rids = list(run.index_of)
        refs = [self.actors[a].abort_requests.remote(rids, True) for a in list(self.alive)]
        stopped = 0
        for ref in refs:
            try:
                stopped += ray.get(ref)
            except RayActorError:  # it died meanwhile: its requests are re-placed as usual
                pass
        return stopped

    def mark_dead(self, actor_id: int, error: Exception) -> None:
        """Drop ``actor_id`` from ``alive``; ``dead[actor_id]`` says why (``error``'s type and
        first line). No-op for an actor already dead."""
        if actor_id in self.alive:
            self.alive.remove(actor_id)
            self.dead[actor_id] = f"{type(error).__name__}: {str(error).splitlines()[0]}"

    def require_alive(self, unfinished: int = 0) -> None:
        """Raises RuntimeError when no actor is left (``unfinished``: requests left undone,
        for the message)."""
        if not self.alive:
            raise RuntimeError(f"RolloutPool: no actor is left ({len(self.dead)} died: "
                               f"{self.dead}); {unfinished} requests unfinished")

    # ---- broadcast calls --------------------------------------------------------------------
    def broadcast(self, method: str, *args) -> list:
        """Call ``method`` on every live actor; results in actor order. An actor found dead is
        dropped (RuntimeError if none is left)."""
        return list(self.broadcast_by_actor(method, *args).values())

    def broadcast_by_actor(self, method: str, *args) -> dict:
        """``broadcast`` keyed by actor id (live actors only)."""
        self.require_alive()
        refs = [(a, getattr(self.actors[a], method).remote(*args)) for a in list(self.alive)]
        out = {}
        for a, ref in refs:
            try:
                out[a] = ray.get(ref)
            except RayActorError as e:
                self.mark_dead(a, e)
        self.require_alive()
        return out

    def sleep(self, level: int = 1) -> list[dict[str, int]]:
        """``LLM.sleep`` on every actor; the bytes each released."""
        return self.broadcast("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLM.wake_up`` on every actor."""
        self.broadcast("wake_up", tags)

    def reset_prefix_cache(self) -> bool:
        """``LLM.reset_prefix_cache`` on every actor; True if all reset."""
        return all(self.broadcast("reset_prefix_cache"))

    def get_metrics(self) -> dict:
        """``actors``: actor id -> its ``LLM.get_metrics()`` (live actors); ``num_actors``,
        ``num_actors_dead``, ``num_requests_rerun``, ``num_requests_failed`` (failed alone:
        ``RequestFailedError``), ``num_objects_put``; the controller's
        ``metrics()`` (a ``MigrationController``'s ``migration_*`` keys). With ``harvest`` /
        ``spare_training``: ``spare_training`` (``SpareScheduler.stats``: train seconds, steps,
        rounds, versions published, newest drafter version, harvested rollouts),
        ``drafter_versions`` (actor id -> drafter version in use; EAGLE actors) and
        ``tau_per_drafter_version`` (drafter version -> tokens committed per verify step, over
        the pool)."""
        d = {"actors": self.broadcast_by_actor("get_metrics"),
             "num_actors": len(self.alive), "num_actors_dead": len(self.dead),
             "num_requests_rerun": self.num_requests_rerun,
             "num_requests_failed": self.num_requests_failed,
             "num_objects_put": self.num_objects_put, **self.controller.metrics()}
        if self.spare is not None:
            d["spare_training"] = self.spare.stats()
            d["drafter_versions"] = {a: m["drafter_version"] for a, m in d["actors"].items()
                                     if "drafter_version" in m}
            counts = [c for c in self.broadcast("drafter_counts") if c is not None]
            d["tau_per_drafter_version"] = merge_tau(counts)
        return d

    def harvested(self) -> list:
        """ObjectRefs of the harvested rollout chunks the pool holds
        (``list[harvest.SequenceFeatures]`` each, oldest first; ``harvest=True``), e.g. for
        training elsewhere. Empty without harvest."""
        return self.spare.store.refs() if self.spare is not None else []

    def shutdown(self) -> None:
        """Kill every actor (the pool is unusable afterwards)."""
        for a in self.actors.values():
            ray.kill(a)
        self.dead.update({a: "shut down" for a in self.alive})
        self.alive = []
