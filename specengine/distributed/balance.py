"""Spreading a rollout's requests over the pool's actors by predicted work.

Requests with identical prompts form one group and go to one actor (the prompt's KV blocks are
computed once and shared through the prefix cache, and rollout-memory / n-gram drafters see the
group's earlier samples); a request's ``n`` samples are one request, so they stay together too.
Groups are placed longest first on the actor with the least predicted work (LPT, Graham 1969),
which is within 4/3 of the best makespan.

Predicted work of a group, in tokens: its prompt once (``prompt_len``) plus, per sample, the
expected output length ``min(max_tokens, mean_len)``, where ``mean_len`` is the mean output length
of the samples finished so far (``WorkModel.observe``; before any finish, ``max_tokens``).
"""

from __future__ import annotations

from collections import OrderedDict

from specengine.distributed.requests import PoolRequest


class WorkModel:
    """Predicted work of requests, from the output lengths seen so far.

    Attributes:
        num_samples: samples observed.
        num_tokens: their generated tokens.
    """

    def __init__(self):
        self.num_samples = 0
        self.num_tokens = 0

    def observe(self, output) -> None:
        """Count a finished ``RequestOutput``'s samples and their generated tokens."""
        for c in output.outputs:
            self.num_samples += 1
            self.num_tokens += len(c.token_ids)

    def expected_output_len(self, max_tokens: int) -> float:
        """Expected generated tokens of one sample with this ``max_tokens``."""
        if self.num_samples == 0:
            return float(max_tokens)
        return min(float(max_tokens), self.num_tokens / self.num_samples)

    def work(self, group: list[PoolRequest]) -> float:
        """Predicted tokens of a group of identical prompts: the prompt once, plus each
        sample's expected output length."""
        return group[0].prompt_len + sum(
            r.params.n * self.expected_output_len(r.params.max_tokens) for r in group)


def group_requests(requests: list[PoolRequest]) -> list[list[PoolRequest]]:
    """Requests grouped by identical prompt (``PoolRequest.key``), groups in order of first
    appearance, requests in input order within a group."""
    groups: OrderedDict[tuple, list[PoolRequest]] = OrderedDict()
    for r in requests:
        groups.setdefault(r.key, []).append(r)
    return list(groups.values())


def assign(groups: list[list[PoolRequest]], actors: list[int], model: WorkModel,
           load: dict[int, float] | None = None) -> dict[int, list[PoolRequest]]:
    """Place groups on actors, longest predicted first, each on the least loaded actor (ties:
    the lower actor id). Deterministic for the same inputs.

    Args:
        groups: from ``group_requests``.
        actors: ids of the actors that may take work (non-empty).
        model: predicts each group's work.
        load: predicted work each actor holds already (default 0).

    Returns:
        actor id -> its requests, in input order (actors given nothing are left out).

    Raises:
        ValueError: ``actors`` is empty.
    """
    if not actors:
        raise ValueError("assign: no actors to place requests on")
    load = {a: (load or {}).get(a, 0.0) for a in actors}
    sized = sorted(((model.work(g), g[0].index, g) for g in groups), key=lambda t: (-t[0], t[1]))
    plan: dict[int, list[PoolRequest]] = {}
    for work, _, g in sized:
        a = min(actors, key=lambda x: (load[x], x))
        load[a] += work
        plan.setdefault(a, []).extend(g)
    return {a: sorted(rs, key=lambda r: r.index) for a, rs in plan.items()}
