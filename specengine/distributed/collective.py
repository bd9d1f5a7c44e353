"""A process group for weight broadcasts that leaves torch's default group alone.

A trainer (rank 0) and rollout engines (ranks ``rank_offset ...``) meet at a ``TCPStore`` hosted by
rank 0 and build a gloo group of their own (OpenRLHF builds the same kind of standalone group for
its vLLM engines, ``init_process_group`` in ``openrlhf/utils/distributed_util.py``), so neither
side's ``torch.distributed`` default group is touched.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class WeightGroup:
    """One member of a standalone broadcast group.

    Args:
        master_address, master_port: rank 0's TCP store (rank 0 hosts it; its constructor waits
            until all ``world_size`` members have connected).
        rank: this member's rank in ``[0, world_size)``.
        world_size: members, trainer included.
        group_name: prefix of the group's keys in the store.
        backend: ``"gloo"`` (CPU tensors).
        timeout_s: seconds to wait for the others.

    Raises:
        ValueError: a backend other than gloo, a rank outside ``[0, world_size)``.
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weights", backend: str = "gloo", timeout_s: float = 300):
        if backend != "gloo":
            raise ValueError(f"backend={backend!r}: only 'gloo' is supported (CPU tensors)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(master_address, int(master_port), world_size,
                                   is_master=rank == 0, timeout=timeout)
        self.rank, self.world_size = rank, world_size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, self.store), rank,
                                        world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` (CPU, contiguous) from rank ``src`` into every member's
        ``tensor`` in place; returns it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
        return tensor
