"""``mt.replicator``: TF-Replicator's API for plain ``torch.nn`` code.

Example:
    >>> import meshtorch as mt
    >>> mt.replicator.launch_replicas(lambda: mt.Replicator(device="cpu").num_replicas, num_replicas=2)
    [2, 2]
"""

from meshtorch.replicator.batchnorm import SyncBatchNorm, convert_sync_batchnorm
from meshtorch.replicator.data import ReplicaLoader
from meshtorch.replicator.launching import launch, launch_replicas
from meshtorch.replicator.optimizer import GradientSync
from meshtorch.replicator.replicator import ReplicaContext, Replicator

__all__ = ["Replicator", "ReplicaContext", "SyncBatchNorm", "convert_sync_batchnorm", "ReplicaLoader",
           "GradientSync", "launch_replicas"]
