"""PyTorch's CUDA caching allocator, simulated: the bytes it *reserves* (``torch.cuda.memory_reserved``,
``reserved_bytes.all.peak``, what torchtitan and Megatron log) for a sequence of allocations and
frees, beside the bytes *allocated*.

Rules, read in pytorch/pytorch ``c10/cuda/CUDACachingAllocator.cpp`` (the stored copy at 001074d;
the function names below are unchanged in torch 2.13, whose .cpp this library does not hold) and
the constants and defaults in torch 2.13.0's shipped header ``c10/core/AllocatorConfig.h``
(cf30153; lines 16-25 and 340-353):

- **rounding** (``round_size``): a request is rounded up to a multiple of ``kMinBlockSize`` = 512 B
  (at least 512 B); ``roundup_power2_divisions`` is off by default (``c10/core/AllocatorConfig.cpp``,
  the ``AcceleratorAllocatorConfig`` constructor: ``roundup_power2_divisions_.assign(..., 0)``).
- **pools** (``get_pool``): rounded sizes <= ``kSmallSize`` = 1 MiB go to the small pool, the rest
  to the large pool; each block also belongs to the stream it was allocated on, and a free block
  serves only requests of its own stream (``get_free_block``: ``(*it)->stream != p.stream()``).
- **best fit** (``get_free_block``): the smallest cached free block of the pool and stream that
  holds the request (``std::set`` ordered by stream, size, address: on a tie the lowest address).
  With ``max_split_size`` set (``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb``; unlimited by default,
  AllocatorConfig.h line 342) a request under it takes no block at or over it, and a request at or
  over it takes only a block under ``size + max_non_split_rounding`` (the constructor sets it to
  ``large_segment_size_``, 20 MiB).
- **new segment** (``alloc_block`` with ``get_allocation_size``): when no cached block fits, a
  ``cudaMalloc`` of 2 MiB (``kSmallBuffer``) for a small request, 20 MiB (``kLargeBuffer``,
  ``large_segment_size``) for a large one under 10 MiB (``kMinLargeAlloc``), else the request
  rounded up to 2 MiB (``kRoundLarge``). Reserved bytes grow by the segment.
- **split** (``should_split``, ``alloc_found_block``): the block found or made is split and the
  remainder cached when, in the small pool, at least 512 B remain; in the large pool, more than
  1 MiB remains and the request is under ``max_split_size``.
- **free** (``free_block``, ``try_merge_blocks``): the block returns to its pool and merges with
  its free neighbours of the same segment; the segment stays reserved (cached). Only
  ``release_cached_blocks`` (``torch.cuda.empty_cache``, or ``malloc``'s retry after a failed
  ``cudaMalloc``) returns whole unsplit free segments to the driver (``release_blocks``; of an
  expandable segment it unmaps the whole pages inside free blocks, ``unmap_block``).
- **expandable segments** (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, Note [Expandable
  Segments]; off by default, AllocatorConfig.h line 353): one segment per stream and pool whose
  physical pages (2 MiB small, 20 MiB large) are mapped as it grows (``map_block``): a request no
  cached block holds goes at the segment's end (``find_expandable_block``: the lowest address with
  enough free and unmapped space; the end, as nothing is unmapped here), mapping only the pages it
  needs past the free bytes already there; every split keeps a remainder of >= 512 B
  (``should_split``). In the best fit the free block at the end counts its unmapped space too,
  so it is taken only where no other block holds the request.

Not modelled: device memory is unlimited here (no ``cudaMalloc`` failure, so no release and retry
and no OOM), no ``empty_cache`` within the sequence, no ``garbage_collection_threshold``, no
cross-stream ``record_stream`` events, no CUDA-graph pools. Addresses are virtual: each new
segment starts after the previous one (the ordering the best fit's tie-break sees).

>>> MiB = 2**20
>>> r = simulate([(0, 3 * MiB, 0), (1, 5 * MiB, 0), (0, -1, 0), (2, 4 * MiB, 0)])
>>> r.reserved_peak_bytes // MiB, r.allocated_peak_bytes // MiB, r.segments
(20, 9, 1)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Optional, Sequence

#: c10/core/AllocatorConfig.h (torch 2.13.0) lines 16-25: rounding, pool boundary, segment sizes.
MIN_BLOCK_BYTES = 512
SMALL_SIZE_BYTES = 1 << 20
SMALL_BUFFER_BYTES = 2 << 20
MIN_LARGE_ALLOC_BYTES = 10 << 20
ROUND_LARGE_BYTES = 2 << 20
#: ``large_segment_size_`` (AllocatorConfig.h line 340; ``kLargeBuffer``): large segments under 10 MiB
#: and the page of an expandable large segment.
LARGE_BUFFER_BYTES = 20 << 20
#: ``max_non_split_rounding_size`` default, 20 MiB (AllocatorConfig.h lines 184-186; the constructor in
#: AllocatorConfig.cpp sets it to ``large_segment_size_``).
MAX_NON_SPLIT_ROUNDING_BYTES = 20 << 20


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the simulation reads: ``expandable_segments``
    (default False) and ``max_split_size_bytes`` (``max_split_size_mb`` x 2^20; None: unlimited,
    the default)."""

    expandable_segments: bool = False
    max_split_size_bytes: Optional[int] = None


@dataclass(frozen=True)
class AllocatorStats:
    """What one simulated sequence reserved and allocated, bytes. ``reserved_peak_bytes``: the
    largest reserved total (cudaMalloc'd segments, or mapped pages of expandable segments);
    ``allocated_peak_bytes``: the largest total of live blocks (rounded sizes: what
    ``allocated_bytes.all.peak`` counts); ``requested_peak_bytes``: the same of the sizes asked;
    ``reserved_at_allocated_peak_bytes``; ``reserved_peak_op``: the index of the op that set the
    reserved peak; ``segments``: cudaMalloc calls (expandable: mappings); ``reserved_by_pool``:
    reserved bytes at the end per (stream, pool) with pool ``"small"`` or ``"large"``."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    requested_peak_bytes: int
    reserved_at_allocated_peak_bytes: int
    reserved_peak_op: int
    segments: int
    reserved_by_pool: dict

    @property
    def cached_at_peak_bytes(self) -> int:
        """Reserved but not allocated when reserved peaked (the allocator's cache and
        fragmentation): ``reserved_peak - allocated_peak``, a lower bound of it at that op."""
        return self.reserved_peak_bytes - self.allocated_peak_bytes


def round_size(n: int) -> int:
    """``round_size``: ``n`` bytes rounded up to 512 B (at least 512).

    >>> round_size(1), round_size(512), round_size(513), round_size(3 * 2**20)
    (512, 512, 1024, 3145728)
    """
    return MIN_BLOCK_BYTES * max(1, -(-n // MIN_BLOCK_BYTES))


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a rounded ``size`` no cached block holds.

    >>> [allocation_size(s) // 2**20 for s in (4096, 3 * 2**20, 10 * 2**20, 11 * 2**20 + 1)]
    [2, 20, 10, 12]
    """
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * -(-size // ROUND_LARGE_BYTES)


def simulate(ops: Sequence[tuple[int, int, int]], config: AllocatorConfig = AllocatorConfig()) -> AllocatorStats:
    """Run ``ops`` through the allocator: ``(tensor id, bytes, stream)`` allocates ``bytes`` for
    a new id on stream ``stream`` (an int), ``(tensor id, -1, _)`` frees it. Ids are any ints,
    each allocated once before its free. See the module docstring for the rules."""
    sim = _Sim(config)
    for i, (tid, n, stream) in enumerate(ops):
        if n < 0:
            sim.free(tid)
        else:
            sim.malloc(tid, n, stream, i)
    return sim.stats()


class _Sim:
    """The allocator's state: blocks by address ``[size, free, prev, next, pool key, tail]``,
    the free blocks of each (stream, small) pool sorted by (size, address), expandable segments'
    mapped ends."""

    def __init__(self, config: AllocatorConfig):
        self.cfg = config
        self.blocks: dict[int, list] = {}  # addr -> [size, free, prev addr, next addr, pool key]
        self.free_lists: dict[tuple, list] = {}
        self.live: dict[int, tuple[int, int]] = {}  # tensor id -> (addr, requested bytes)
        self.expandable: dict[tuple, list] = {}  # pool key -> [mapped end, tail free addr or None, last block addr]
        self.top = 0  # next virtual address of a new segment
        self.reserved = self.allocated = self.requested = 0
        self.peaks = [0, 0, 0, 0, 0]  # reserved, allocated, requested, reserved at allocated peak, op of reserved peak
        self.segments = 0
        self.by_pool: dict[tuple, int] = {}

    # malloc ---------------------------------------------------------------------------
    def malloc(self, tid: int, n: int, stream: int, op: int) -> None:
        size = round_size(n)
        key = (stream, size <= SMALL_SIZE_BYTES)
        addr = self._best_fit(key, size)
        if addr is None:
            addr = self._expand(key, size) if self.cfg.expandable_segments else self._segment(key, size)
        self._take(addr, size, key)
        self.live[tid] = (addr, n)
        self.allocated += self.blocks[addr][0]  # the block, with a remainder too small to split
        self.requested += n
        p = self.peaks
        if self.allocated > p[1]:
            p[1], p[3] = self.allocated, self.reserved
        p[2] = max(p[2], self.requested)
        if self.reserved > p[0]:
            p[0], p[4] = self.reserved, op

    def _best_fit(self, key: tuple, size: int) -> Optional[int]:
        """``get_free_block``: the smallest free block of the pool holding ``size`` (the
        ``max_split_size`` limits applied), taken out of the free list; None if there is none."""
        fl = self.free_lists.get(key)
        if not fl:
            return None
        i = bisect_left(fl, (size, -1))
        if i == len(fl):
            return None
        bsize, addr = fl[i]
        cap = self.cfg.max_split_size_bytes
        if cap is not None and ((size < cap <= bsize) or (size >= cap and bsize >= size + MAX_NON_SPLIT_ROUNDING_BYTES)):
            return None
        del fl[i]
        return addr

    def _segment(self, key: tuple, size: int) -> int:
        """``alloc_block``: a new cudaMalloc'd segment of ``allocation_size(size)``."""
        seg = allocation_size(size)
        addr, self.top = self.top, self.top + seg
        self.blocks[addr] = [seg, True, None, None, key]
        self._reserve(key, seg)
        return addr

    def _expand(self, key: tuple, size: int) -> int:
        """``try_allocate_expandable_block``: the free bytes at the end of the pool's expandable
        segment (created on first use) and as many new pages as the request needs past them."""
        page = SMALL_BUFFER_BYTES if key[1] else LARGE_BUFFER_BYTES
        es = self.expandable.get(key)
        if es is None:
            es = self.expandable[key] = [self.top, None, None]
            self.top += 1 << 50  # address space of its own (the real one reserves 1 1/8 of the HBM)
        end, tail, last = es
        start = end if tail is None else tail
        grow = -(-max(0, start + size - end) // page) * page
        if tail is None:
            self.blocks[start] = [0, True, last, None, key]
            if last is not None:
                self.blocks[last][3] = start
            es[2] = start
        self.blocks[start][0] += grow
        es[0], es[1] = end + grow, None
        self._reserve(key, grow)
        return start

    def _reserve(self, key: tuple, n: int) -> None:
        if n:
            self.reserved += n
            self.segments += 1
            self.by_pool[key] = self.by_pool.get(key, 0) + n

    def _take(self, addr: int, size: int, key: tuple) -> None:
        """``alloc_found_block``: mark the block allocated, splitting off the rest when
        ``should_split``."""
        b = self.blocks[addr]
        rest = b[0] - size
        small = key[1]
        cap = self.cfg.max_split_size_bytes
        split = (rest >= MIN_BLOCK_BYTES if small or self.cfg.expandable_segments
                 else rest > SMALL_SIZE_BYTES and (cap is None or size < cap))
        if split:
            r = addr + size
            self.blocks[r] = [rest, True, addr, b[3], key]
            if b[3] is not None:
                self.blocks[b[3]][2] = r
            b[0], b[3] = size, r
            self._last_is(r)
            self._cache(r)
        b[1] = False

    # free -----------------------------------------------------------------------------
    def free(self, tid: int) -> None:
        """``free_block``: the block returns to its pool, merged with its free neighbours."""
        addr, n = self.live.pop(tid)
        b = self.blocks[addr]
        self.allocated -= b[0]
        self.requested -= n
        b[1] = True
        nxt = b[3]
        if nxt is not None and self.blocks[nxt][1]:
            self._uncache(nxt)
            nb = self.blocks.pop(nxt)
            b[0] += nb[0]
            b[3] = nb[3]
            if nb[3] is not None:
                self.blocks[nb[3]][2] = addr
        prv = b[2]
        if prv is not None and self.blocks[prv][1]:
            self._uncache(prv)
            pb = self.blocks[prv]
            pb[0] += b[0]
            pb[3] = b[3]
            if b[3] is not None:
                self.blocks[b[3]][2] = prv
            del self.blocks[addr]
            addr = prv
        self._last_is(addr)
        self._cache(addr)

    def _last_is(self, addr: int) -> None:
        """Record ``addr`` as the last block of its expandable segment when nothing follows it."""
        b = self.blocks[addr]
        es = self.expandable.get(b[4])
        if es is not None and b[3] is None:
            es[2] = addr

    def _is_tail(self, addr: int) -> bool:
        """The free block at the mapped end of an expandable segment (it extends into unmapped space)."""
        b = self.blocks[addr]
        es = self.expandable.get(b[4])
        return es is not None and b[3] is None and addr + b[0] == es[0]

    def _cache(self, addr: int) -> None:
        b = self.blocks[addr]
        if self.cfg.expandable_segments and self._is_tail(addr):
            self.expandable[b[4]][1] = addr
            return
        insort(self.free_lists.setdefault(b[4], []), (b[0], addr))

    def _uncache(self, addr: int) -> None:
        b = self.blocks[addr]
        es = self.expandable.get(b[4])
        if es is not None and es[1] == addr:
            es[1] = None
            return
        fl = self.free_lists[b[4]]
        del fl[bisect_left(fl, (b[0], addr))]

    def stats(self) -> AllocatorStats:
        p = self.peaks
        pools = {(s, "small" if small else "large"): n for (s, small), n in sorted(self.by_pool.items())}
        return AllocatorStats(reserved_peak_bytes=p[0], allocated_peak_bytes=p[1], requested_peak_bytes=p[2],
                              reserved_at_allocated_peak_bytes=p[3], reserved_peak_op=p[4], segments=self.segments,
                              reserved_by_pool=pools)
