"""How a GPU's memory holds a planned step: torch's CUDA caching allocator, modelled.

The tracer follows storages by their bytes (:mod:`meshtorch.plan.tracing`). On a GPU each
storage is a *block* of the caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), and
``torch.cuda.max_memory_allocated`` counts blocks, not requested bytes:

- a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; 0 bytes take none);
- a request of 10 MiB or more (``kMinLargeAlloc``) gets a segment of its size rounded up to
  2 MiB (``kRoundLarge``), and the block is split off it only when more than 1 MiB
  (``kSmallSize``) is left: otherwise the block is the whole segment (smaller requests are cut
  from 2 MiB and 20 MiB segments, where the rest is always split off).

A trace for a GPU (``trace(device="cuda")``) follows each meta storage as its block
(:func:`block_bytes`), so its peak is the peak ``max_memory_allocated`` reports. What the GPU must
have free is more: the allocator's cached segments are fragmented (blocks freed between live ones
are not reused for a larger request), and the process's CUDA context (its kernels, cuBLAS's
handles) lives outside the allocator. :func:`reserved_bytes` adds both, from the device spec's
``memory_margin`` (a fraction of the allocated peak) and ``context_bytes``.

Example:
    >>> from meshtorch.plan.allocator import block_bytes
    >>> block_bytes(1), block_bytes(512), block_bytes(513), block_bytes(0)
    (512, 512, 1024, 0)
    >>> MiB = 2 ** 20
    >>> block_bytes(11 * MiB) / MiB, block_bytes(21 * MiB // 2) / MiB   # the whole segment; split
    (12.0, 10.5)
"""

from __future__ import annotations

MIN_BLOCK = 512                 # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 2 ** 20            # kSmallSize: a large segment's rest is split off only above it
MIN_LARGE_ALLOC = 10 * 2 ** 20  # kMinLargeAlloc: from here a request gets a segment of its own size
ROUND_LARGE = 2 * 2 ** 20       # kRoundLarge: such a segment is a multiple of 2 MiB

# The defaults a GPU spec states (plan/devices.py): assumptions, not measurements of our steps.
# A CUDA 12 context with lazy module loading and cuBLAS's handles takes about 0.5 GiB of an H100
# outside the allocator; 10% of the allocated peak covers the caching allocator's fragmentation
# in a training step (its segments hold freed blocks between live ones).
CUDA_CONTEXT_BYTES = 2 ** 29
FRAGMENTATION = 0.10


def block_bytes(nbytes: int) -> int:
    """The bytes of the caching allocator's block for a request of ``nbytes`` on a fresh segment
    (what ``torch.cuda.memory_allocated`` counts for it)."""
    if nbytes <= 0:
        return 0
    size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
    if size < MIN_LARGE_ALLOC:
        return size
    segment = -(-size // ROUND_LARGE) * ROUND_LARGE
    return size if segment - size > SMALL_SIZE else segment


def reserved_bytes(allocated: int, margin: float = FRAGMENTATION, context: int = CUDA_CONTEXT_BYTES) -> int:
    """GPU memory a process whose allocator peaks at ``allocated`` bytes takes: the peak, the
    allocator's fragmentation ``margin`` of it, and the CUDA ``context``.

    Example:
        >>> from meshtorch.plan.allocator import reserved_bytes
        >>> reserved_bytes(10 * 2 ** 30, 0.1, 2 ** 29) / 2 ** 30
        11.5
    """
    return int(allocated * (1 + margin)) + context


def usable_bytes(capacity: int, margin: float = FRAGMENTATION, context: int = CUDA_CONTEXT_BYTES) -> int:
    """The most a step's allocated peak may be on a GPU of ``capacity`` bytes: the inverse of
    :func:`reserved_bytes` (``reserved_bytes(usable_bytes(c)) <= c``).

    Example:
        >>> from meshtorch.plan.allocator import reserved_bytes, usable_bytes
        >>> c = 80 * 10 ** 9
        >>> reserved_bytes(usable_bytes(c)) <= c < reserved_bytes(usable_bytes(c) + 2)
        True
    """
    return max(0, int((capacity - context) / (1 + margin)))


__all__ = ["CUDA_CONTEXT_BYTES", "FRAGMENTATION", "block_bytes", "reserved_bytes", "usable_bytes"]
