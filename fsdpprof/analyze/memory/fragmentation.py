"""Fragmentation of the CUDA caching allocator: its free blocks at the peak, at an OOM and at the end.

At the end (or an OOM the snapshot ends with) the figures are the snapshot's segments and blocks; at the peak (and
an earlier OOM) they come from undoing the trace's alloc / free / segment entries from that end state, with the
allocator's rules (c10/cuda/CUDACachingAllocator.cpp): requests round up to 512 B; up to 1 MiB go to the small
pool (2 MiB segments); a block is cut from the start of a free one, the rest split off when at least 512 B (small
pool, expandable segments) or over 1 MiB (large pool); adjacent free blocks merge.  Bytes throughout; blocks whose
free waits for an event (``active_pending_free``) are in use.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

import numpy as np

from fsdpprof.analyze.memory.snapshot import NEVER, SnapshotData

MIN_BLOCK_BYTES = 512            # kMinBlockSize: the allocator's rounding
SMALL_SIZE_BYTES = 1 << 20       # kSmallSize: requests up to this size go to the small pool
SMALL_BUFFER_BYTES = 2 << 20     # kSmallBuffer: a small pool segment (non-expandable)
LARGE_BUFFER_BYTES = 20 << 20    # kLargeBuffer: the large pool's expandable segments map pages of this size


@dataclass
class FragmentationAt:
    """The allocator's memory of one device at one moment (``at``: peak, oom or end; ``seq``: the trace entry it
    follows, None at the end; ``source``: segments or replay).  Bytes; free = reserved - allocated."""

    at: str
    seq: int | None
    source: str
    reserved_bytes: int                   # in segments (cudaMalloc'd or mapped)
    allocated_bytes: int                  # in blocks in use (active_allocated + active_pending_free)
    free_bytes: int                       # in free (inactive) blocks, cached by the allocator
    largest_free_block_bytes: int         # 0 when none
    free_blocks: int
    free_small_bytes: int                 # free in small pool segments (requests up to 1 MiB)
    free_large_bytes: int
    expandable_segments: bool
    segments: int                         # segments (expandable: runs of contiguous mapped memory)
    pending_free_bytes: int | None        # of allocated, blocks whose free waits for an event; None: replayed
    largest_request_after_bytes: int | None  # largest request that followed (the OOM's at an OOM); None: none
    free_blocks_by_size: list[dict] = field(default_factory=list)  # size_classes of the free blocks

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Fragmentation:
    """:func:`fragmentation`'s answer: ``entries`` in trace order (peak / oom / end), ``notes`` saying what
    is left out and why."""

    device: int
    entries: list[FragmentationAt]
    notes: list[str] = field(default_factory=list)

    def at(self, name: str) -> FragmentationAt | None:
        return next((e for e in self.entries if e.at == name), None)

    def to_list(self) -> list[dict]:
        return [e.to_dict() for e in self.entries]


def round_request(nbytes: int) -> int:
    """The block size the allocator gives a request of ``nbytes`` at the default settings (512 B steps)."""
    return MIN_BLOCK_BYTES * max(1, -(-int(nbytes) // MIN_BLOCK_BYTES))


def size_classes(sizes: np.ndarray) -> list[dict]:
    """Free block sizes -> lo_bytes, hi_bytes, count, bytes: below 1 MiB, then [2^k, 2^k+1) from 1 MiB up."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not len(sizes):
        return []
    k = np.where(sizes < SMALL_SIZE_BYTES, 19, np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64))
    out = []
    for kk in np.unique(k).tolist():
        m = k == kk
        out.append({"lo_bytes": 0 if kk == 19 else 1 << kk, "hi_bytes": 1 << (kk + 1) if kk > 19 else SMALL_SIZE_BYTES,
                    "count": int(m.sum()), "bytes": int(sizes[m].sum())})
    return out


# --------------------------------------------------------------------------- the answer
def fragmentation(snap: SnapshotData, device: int, peak_seq: int | None = None) -> Fragmentation:
    """Fragmentation of ``device`` of ``snap`` at the peak (after trace entry ``peak_seq``; None: none), at the
    device's first OOM and at the end."""
    blocks = snap.blocks[snap.blocks["device"].to_numpy() == device]
    seg = snap.segments[snap.segments["device"].to_numpy() == device]
    notes: list[str] = []
    allocs = snap.allocations[snap.allocations["device"].to_numpy() == device]
    se = snap.segment_events[snap.segment_events["device"].to_numpy() == device]
    ooms = sorted((o for o in snap.ooms if o["device"] == device), key=lambda o: o["seq"])
    last_seq = _last_seq(allocs, se)
    end = _from_segments(seg, blocks, "end", None)
    moments: list[tuple[str, int]] = []
    oom = ooms[0] if ooms else None
    if oom is not None:
        if last_seq <= oom["seq"]:           # nothing after the OOM: the segments are the state at the OOM
            end.at, end.seq, end.largest_request_after_bytes = "oom", oom["seq"], oom["requested_bytes"]
        else:
            moments.append(("oom", oom["seq"]))
    where = f"cuda:{device}"
    if peak_seq is None or not snap.has_history.get(device, False):
        notes.append(f"{where}: no allocation history (torch.cuda.memory._record_memory_history was off): "
                     f"fragmentation at the end only, none at the peak")
    elif not snap.has_time and not len(se):
        notes.append(f"{where}: legacy snapshot (no time_us) whose trace holds no segment actions (segment_alloc / "
                     f"segment_free / segment_map / segment_unmap): the segments at the peak are unknown, so there "
                     f"is no fragmentation at the peak (only at the end)")
    else:
        moments.append(("peak", int(peak_seq)))
    replayed: list[FragmentationAt] = []
    if moments:
        settings = snap.allocator_settings or {}
        if _custom_rounding(settings):
            notes.append(f"{where}: allocator settings change its rounding or splitting (roundup_power2_divisions / "
                         f"max_split_size): the blocks at the peak are rebuilt with the default rules, approximately")
        events = _events(allocs, se)
        state = _State.from_end(seg, blocks)
        # pass 1: the block sizes of the allocations freed after the first moment, found at their allocs
        a_seq, f_seq = allocs["alloc_seq"].to_numpy(), allocs["free_seq"].to_numpy()
        freed = (f_seq > min(s for _, s in moments)) & (f_seq != NEVER) & (a_seq >= 0)
        sizes, _, _ = _replay(state.copy(), events, [], {}, int(a_seq[freed].min()) if freed.any() else NEVER)
        _, got, mismatched = _replay(state, events, sorted(moments, key=lambda m: -m[1]), sizes)
        requests = _requests(allocs, ooms)
        if mismatched:
            notes.append(f"{where}: {mismatched:,} trace entries after the peak do not match the segments (an address "
                         f"outside them, a block where another is, a segment action not recorded): no fragmentation "
                         f"at the {' or '.join(sorted({m for m, _ in moments}))} from the trace")
        else:
            for name, s in moments:
                e = got[name]
                e.largest_request_after_bytes = oom["requested_bytes"] if name == "oom" else requests(s)
                replayed.append(e)
            if not len(se) and any(m == "peak" for m, _ in moments):
                notes.append(f"{where}: the trace records no segment actions: the segments at the peak are taken to be "
                             f"the end's (every block of the trace lies inside them)")
    entries = sorted(replayed + [end], key=lambda e: NEVER if e.seq is None else e.seq)
    return Fragmentation(device=device, entries=entries, notes=notes)


def _last_seq(allocs, se) -> int:
    a = allocs["alloc_seq"].to_numpy()
    f = allocs["free_seq"].to_numpy()
    f = f[f != NEVER]
    s = se["seq"].to_numpy()
    return int(max([-1] + [x.max() for x in (a, f, s) if len(x)]))


def _requests(allocs, ooms):
    """seq -> the largest request (alloc entry or OOM) after entry ``seq`` (None when none)."""
    seq = np.concatenate([allocs["alloc_seq"].to_numpy(), np.array([o["seq"] for o in ooms], dtype=np.int64)])
    size = np.concatenate([allocs["bytes"].to_numpy(), np.array([o["requested_bytes"] for o in ooms], dtype=np.int64)])
    m = seq >= 0
    seq, size = seq[m], size[m]
    o = np.argsort(seq, kind="stable")
    seq, size = seq[o], size[o]
    suffix_max = np.maximum.accumulate(size[::-1])[::-1] if len(size) else size

    def after(s: int) -> int | None:
        i = int(np.searchsorted(seq, s, side="right"))
        return int(suffix_max[i]) if i < len(seq) else None
    return after


def _custom_rounding(settings: dict) -> bool:
    div = settings.get("roundup_power2_divisions")
    mss = settings.get("max_split_size")
    return (isinstance(div, dict) and any(v not in (0, 1, None) for v in div.values())) \
        or (isinstance(div, int) and div > 1) or (isinstance(mss, int) and mss > 0)


def _pool_of_size(size: int, expandable: bool) -> str:
    if expandable:
        return "large" if size % LARGE_BUFFER_BYTES == 0 else "small"
    return "small" if size == SMALL_BUFFER_BYTES else "large"


def _pools(seg, blocks) -> dict:
    """Segment address -> pool ("small" / "large"): as its blocks say, else by its size."""
    typ = dict(zip(blocks["segment_address"].tolist(), blocks["segment_type"].tolist()))
    return {a: typ.get(a) or _pool_of_size(t, bool(x))
            for a, t, x in zip(seg["address"].tolist(), seg["total_bytes"].tolist(), seg["is_expandable"].tolist())}


def _figures(at: str, seq: int | None, source: str, reserved: int, free_sizes, free_small, expandable: bool,
             segments: int, pending: int | None) -> FragmentationAt:
    sizes, small = np.asarray(free_sizes, dtype=np.int64), np.asarray(free_small, dtype=bool)
    free = int(sizes.sum())
    return FragmentationAt(
        at=at, seq=seq, source=source, reserved_bytes=reserved, allocated_bytes=reserved - free, free_bytes=free,
        largest_free_block_bytes=int(sizes.max()) if len(sizes) else 0, free_blocks=len(sizes),
        free_small_bytes=int(sizes[small].sum()), free_large_bytes=int(sizes[~small].sum()),
        expandable_segments=expandable, segments=segments, pending_free_bytes=pending,
        largest_request_after_bytes=None, free_blocks_by_size=size_classes(sizes))


def _from_segments(seg, blocks, at: str, seq: int | None) -> FragmentationAt:
    """The figures of the snapshot's own segments and blocks."""
    state = blocks["state"].to_numpy()
    size = blocks["size"].to_numpy().astype(np.int64)
    free = state == "inactive"
    pools = _pools(seg, blocks)
    small = np.array([pools.get(a) == "small" for a in blocks["segment_address"].tolist()], dtype=bool)
    return _figures(at, seq, "segments", int(seg["total_bytes"].to_numpy().astype(np.int64).sum()), size[free],
                    small[free], bool(seg["is_expandable"].to_numpy().astype(bool).any()), len(seg),
                    int(size[state == "active_pending_free"].sum()))


# --------------------------------------------------------------------------- the replay
# event kinds, in the order they are undone at one seq (the reverse of their order forwards: a free inferred
# from a second alloc at the address comes before that alloc)
_ALLOC, _FREE, _SEG_ADD, _SEG_REMOVE = 0, 1, 2, 3


def _events(allocs, se) -> list[tuple]:
    """(seq, kind, address, size, key) of the device's trace, last first; ``key`` names an allocation (its alloc
    seq, or -1 - free seq for one made before the trace)."""
    a_seq, f_seq = allocs["alloc_seq"].to_numpy(), allocs["free_seq"].to_numpy()
    addr, size = allocs["addr"].to_numpy(), allocs["bytes"].to_numpy()
    ev = []
    for s, f, ad, b in zip(a_seq.tolist(), f_seq.tolist(), addr.tolist(), size.tolist()):
        key = s if s >= 0 else -1 - f
        if s >= 0:
            ev.append((s, _ALLOC, ad, b, key))
        if f != NEVER:
            ev.append((f, _FREE, ad, b, key))
    for s, d, ad, act in zip(se["seq"].tolist(), se["delta_bytes"].tolist(), se["address"].tolist(),
                             se["action"].tolist()):
        ev.append((s, _SEG_ADD if d > 0 else _SEG_REMOVE, ad, abs(d), act in ("segment_map", "segment_unmap")))
    ev.sort(key=lambda e: (-e[0], e[1]))
    return ev


class _State:
    """Mapped memory (sorted ranges: start, end, pool, expandable) and the blocks in use (sorted starts,
    start -> [size, key]) of one device."""

    def __init__(self):
        self.r_start: list[int] = []
        self.ranges: dict[int, list] = {}      # start -> [end, pool, expandable]
        self.b_start: list[int] = []
        self.blocks: dict[int, list] = {}      # start -> [size, key]
        self.pools: dict[int, str] = {}        # segment start -> pool, as the snapshot said

    @classmethod
    def from_end(cls, seg, blocks) -> "_State":
        st = cls()
        st.pools = _pools(seg, blocks)
        for a, t, x in zip(seg["address"].tolist(), seg["total_bytes"].tolist(), seg["is_expandable"].tolist()):
            st._add_range(a, a + t, st.pools[a], bool(x))
        used = blocks[blocks["state"].to_numpy() != "inactive"]
        for a, s in zip(used["address"].tolist(), used["size"].tolist()):
            st.blocks[a] = [s, None]
        st.b_start = sorted(st.blocks)
        return st

    def copy(self) -> "_State":
        st = _State()
        st.r_start, st.b_start = list(self.r_start), list(self.b_start)
        st.ranges = {k: list(v) for k, v in self.ranges.items()}
        st.blocks = {k: list(v) for k, v in self.blocks.items()}
        st.pools = dict(self.pools)
        return st

    # ranges
    def range_at(self, addr: int):
        i = bisect.bisect_right(self.r_start, addr) - 1
        if i >= 0:
            s = self.r_start[i]
            if addr < self.ranges[s][0]:
                return s
        return None

    def _add_range(self, a: int, b: int, pool: str, exp: bool) -> None:
        if exp:     # contiguous mapped memory of one expandable segment is one segment
            i = bisect.bisect_left(self.r_start, a)
            if i > 0:
                p = self.r_start[i - 1]
                if self.ranges[p][0] == a and self.ranges[p][2]:
                    a = p
                    del self.ranges[p]
                    self.r_start.pop(i - 1)
            if b in self.ranges and self.ranges[b][2]:
                b2 = self.ranges.pop(b)[0]
                self.r_start.remove(b)
                b = b2
        bisect.insort(self.r_start, a)
        self.ranges[a] = [b, pool, exp]

    def add_range(self, a: int, size: int, exp: bool) -> bool:
        if self.range_at(a) is not None or self.range_at(a + size - 1) is not None or \
                bisect.bisect_left(self.r_start, a) != bisect.bisect_left(self.r_start, a + size):
            return False
        pool = self.pools.get(a) or (self._near_pool(a) if exp else None) or _pool_of_size(size, exp)
        self._add_range(a, a + size, pool, exp)
        return True

    def _near_pool(self, a: int) -> str | None:
        """The pool of the expandable range nearest ``a`` (one expandable segment per pool reserves its own
        address range)."""
        i = bisect.bisect_left(self.r_start, a)
        cand = [self.r_start[j] for j in (i - 1, i) if 0 <= j < len(self.r_start) and self.ranges[self.r_start[j]][2]]
        if not cand:
            return None
        return self.ranges[min(cand, key=lambda s: min(abs(s - a), abs(self.ranges[s][0] - a)))][1]

    def remove_range(self, a: int, size: int) -> bool:
        """Unmap / cudaFree [a, a + size): it must be mapped and hold no block in use."""
        s = self.range_at(a)
        if s is None or self.ranges[s][0] < a + size:
            return False
        i = bisect.bisect_left(self.b_start, a)
        if i < len(self.b_start) and self.b_start[i] < a + size:
            return False
        if i > 0 and self.b_start[i - 1] + self.blocks[self.b_start[i - 1]][0] > a:
            return False
        end, pool, exp = self.ranges[s]
        if not exp and (s != a or end != a + size):
            return False
        del self.ranges[s]
        self.r_start.remove(s)
        if s < a:
            bisect.insort(self.r_start, s)
            self.ranges[s] = [a, pool, exp]
        if a + size < end:
            bisect.insort(self.r_start, a + size)
            self.ranges[a + size] = [end, pool, exp]
        return True

    # blocks
    def gap_end(self, addr: int, r: int) -> int:
        """End of the free memory from ``addr`` in range ``r``: the next block's start or the range's end."""
        i = bisect.bisect_right(self.b_start, addr)
        nxt = self.b_start[i] if i < len(self.b_start) else NEVER
        return min(nxt, self.ranges[r][0])

    def is_free(self, addr: int) -> bool:
        i = bisect.bisect_right(self.b_start, addr) - 1
        return i < 0 or self.b_start[i] + self.blocks[self.b_start[i]][0] <= addr

    def stats(self, at: str, seq: int) -> FragmentationAt:
        free_sizes, free_small, reserved, exp_any = [], [], 0, False
        bi = 0
        for s in self.r_start:
            end, pool, exp = self.ranges[s]
            reserved += end - s
            exp_any |= exp
            bi = bisect.bisect_left(self.b_start, s, lo=0)
            pos = s
            while bi < len(self.b_start) and self.b_start[bi] < end:
                b = self.b_start[bi]
                if b > pos:
                    free_sizes.append(b - pos)
                    free_small.append(pool == "small")
                pos = max(pos, b + self.blocks[b][0])
                bi += 1
            if pos < end:
                free_sizes.append(end - pos)
                free_small.append(pool == "small")
        return _figures(at, seq, "replay", reserved, free_sizes, free_small, exp_any, len(self.r_start), None)


def _replay(st: _State, events: list[tuple], moments: list[tuple[str, int]], sizes: dict, down_to: int = -1):
    """Undo ``events`` (last first, down to ``down_to``) on ``st``: (block sizes found at the allocs, the figures at
    each of ``moments`` (name, seq; latest first), entries that did not match); ``sizes``: from a first pass."""
    found: dict = {}
    got: dict = {}
    bad = 0
    mi = 0
    for seq, kind, addr, size, key in events:
        while mi < len(moments) and seq <= moments[mi][1]:
            got[moments[mi][0]] = st.stats(*moments[mi])
            mi += 1
        if (mi == len(moments) and moments) or seq < down_to:
            break
        if kind == _ALLOC:          # before the alloc, its block was free (and merges with the free around it)
            blk = st.blocks.pop(addr, None)
            if blk is None:
                bad += 1
                continue
            st.b_start.pop(bisect.bisect_left(st.b_start, addr))
            r = st.range_at(addr)
            if r is not None:
                end, pool, exp = st.ranges[r]
                want = round_request(size)
                g1 = st.gap_end(addr, r)
                # the allocator took the block from a free one starting at addr and split the rest off if it could
                found[key] = want if (pool == "small" or exp or g1 - addr - want > SMALL_SIZE_BYTES) else g1 - addr
        elif kind == _FREE:         # before the free, its block was in use
            r = st.range_at(addr)
            if r is None or addr in st.blocks or not st.is_free(addr):
                bad += 1
                continue
            end, pool, exp = st.ranges[r]
            g1 = st.gap_end(addr, r)
            b = sizes.get(key)
            if b is None:
                b = round_request(size)
                if pool == "large" and not exp and 0 < g1 - addr - b <= SMALL_SIZE_BYTES:
                    b = g1 - addr   # no free block of 1 MiB or less in a large segment: the rest was not split off
            if addr + b > g1:
                bad += 1
                continue
            st.blocks[addr] = [b, key]
            bisect.insort(st.b_start, addr)
        elif kind == _SEG_ADD:      # before cudaMalloc / map, the memory was not there
            if not st.remove_range(addr, size):
                bad += 1
        else:                       # before cudaFree / unmap, it was there, free
            if not st.add_range(addr, size, bool(key)):
                bad += 1
    while mi < len(moments):
        got[moments[mi][0]] = st.stats(*moments[mi])
        mi += 1
    return found, got, bad
