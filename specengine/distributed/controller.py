"""``PoolController``: the hooks a rollout pool calls while a ``generate`` runs.

The pool's dispatch loop reports each event here (requests placed on an actor, a request
finished, an actor died). The base class does nothing. This is where a migration controller
plugs in (issue 17 item 2, RLHFSpec): it would track, from ``on_output``'s ``num_left``, which
actors ran dry while others still hold many sequences, and move sequences between them with the
engines' KV export/import. ``RolloutPool(controller=...)`` takes one; hooks run on the thread
that called ``generate``, between events, so a hook may call the pool's actors (``pool.actors``)
but must not call ``pool.generate``.

What a migration controller will need from the pool (not built yet): ``RolloutPool._run`` keeps,
per actor call, the input indices still unfinished (``calls[cid]``); moving a sequence means
taking its index out of the source call's set (the source actor drops the request, its
``rollout`` stream then never yields it) and launching it on the destination as a call of its own
(with the exported KV and sampling state instead of a fresh prefill), so every index is still
returned exactly once; the actor side needs export/import methods on ``RolloutWorker``.
"""

from __future__ import annotations


class PoolController:
    """No-op hooks of ``RolloutPool.generate`` (subclass and override)."""

    def on_dispatch(self, pool, actor_id: int, indices: list[int]) -> None:
        """Requests ``indices`` (input positions) were sent to actor ``actor_id``."""

    def on_output(self, pool, actor_id: int, index: int, num_left: int) -> None:
        """Request ``index`` finished on ``actor_id``; ``num_left`` of the requests sent with
        it to that actor are unfinished."""

    def on_actor_dead(self, pool, actor_id: int, error: Exception, rerun: list[int]) -> None:
        """Actor ``actor_id`` died (``error``); requests ``rerun`` go to other actors."""
