"""Paged KV memory: block pool, block tables, prefix cache, capacity planning."""

from kvmesh.memory.block_manager import ADMISSION_POLICIES, AllocResult, BlockManager
from kvmesh.memory.block_pool import BlockPool
from kvmesh.memory.errors import CapacityError, SequenceExistsError, UnknownSequenceError
from kvmesh.memory.hashing import BlockHasher
from kvmesh.memory.metrics import MemoryMetrics

__all__ = [
    "ADMISSION_POLICIES",
    "AllocResult",
    "BlockHasher",
    "BlockManager",
    "BlockPool",
    "CapacityError",
    "MemoryMetrics",
    "SequenceExistsError",
    "UnknownSequenceError",
]
