"""specengine on Ray (``pip install specengine[ray]``): ``RolloutPool`` (engines on Ray actors,
one ``generate``), its actor ``RolloutWorker``, the OpenRLHF-compatible ``OpenRLHFRolloutActor``
and the ``PoolController`` hooks with ``MigrationController`` (samples moved between actors in
the long tail). Modules: ``requests`` (arguments, central seeds), ``balance`` (placement by
predicted work), ``worker``, ``pool``, ``pool_weights`` (all-or-nothing weight updates),
``generate_run`` (one generate's bookkeeping: sample locations, parts, re-runs), ``controller``,
``migration_controller``, ``collective`` (gloo weight group), ``openrlhf``, ``spare_training``
(spare-instance drafter training, ``SpareTraining``)."""

from specengine.distributed.controller import PoolController
from specengine.distributed.migration_controller import MigrationController
from specengine.distributed.openrlhf import OpenRLHFRolloutActor, remote_actor
from specengine.distributed.pool import RolloutPool
from specengine.distributed.spare_training import SpareTraining
from specengine.distributed.worker import RolloutWorker

__all__ = ["MigrationController", "OpenRLHFRolloutActor", "PoolController", "RolloutPool",
           "RolloutWorker", "SpareTraining", "remote_actor"]
