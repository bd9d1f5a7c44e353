"""``PoolController``: the hooks a rollout pool calls while a ``generate`` runs.

The pool's dispatch loop reports each event here (requests placed on an actor, a request
finished, an actor died), asks it where to place a call's requests (``place``: by default
``balance.assign``, least predicted work first) and, when ``interval`` is set, calls ``on_tick``
every ``interval`` seconds (sooner after a hook set ``due``). The base class does nothing else.
``MigrationController`` (``distributed/migration_controller.py``) is the migration controller
built on these hooks (issue 17 item 2, RLHFSpec). ``RolloutPool(controller=...)`` takes one;
hooks run on the thread that called ``generate``, between events, so a hook may call the pool's
actors (``pool.actors``) but must not call ``pool.generate``.

What a hook sees of a running ``generate`` (``on_tick``'s ``run``, a
``generate_run.GenerateRun``):
``run.loc`` maps each unfinished sample ``(input index, sample index)`` to the actor holding it,
``run.rids`` the actor-side request id of each input index; ``run.moved`` records samples that
changed actor, and ``run.stream(actor)`` starts a rollout stream on an actor that has none, so
samples imported there are returned.
"""

from __future__ import annotations

from specengine.distributed.balance import WorkModel, assign


class PoolController:
    """No-op hooks of ``RolloutPool.generate`` (subclass and override).

    Attributes:
        interval: seconds between ``on_tick`` calls during a ``generate`` (None: never).
        due: set True to have ``on_tick`` run right after the current event.
    """

    interval: float | None = None
    due: bool = False

    def place(self, pool, groups: list, actors: list[int], model: WorkModel) -> dict:
        """Where a ``generate``'s request groups (``balance.group_requests``) go: actor id ->
        requests. Default: ``balance.assign`` (longest predicted first, least loaded actor)."""
        return assign(groups, actors, model)

    def on_dispatch(self, pool, actor_id: int, indices: list[int]) -> None:
        """Requests ``indices`` (input positions) were sent to actor ``actor_id``."""

    def on_output(self, pool, actor_id: int, index: int, num_left: int) -> None:
        """Request ``index`` (all its samples, or the part that finished there) came back from
        ``actor_id``; ``num_left``: requests with samples still unfinished on that actor."""

    def on_actor_dead(self, pool, actor_id: int, error: Exception, rerun: list[int]) -> None:
        """Actor ``actor_id`` died (``error``); requests ``rerun`` go to other actors."""

    def on_tick(self, pool, run) -> None:
        """Called every ``interval`` seconds while ``generate`` runs (``run``: the module
        docstring)."""

    def metrics(self) -> dict:
        """Keys added to ``RolloutPool.get_metrics()`` (none here)."""
        return {}
