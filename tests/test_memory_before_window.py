"""Memory allocated before the profiling window (CPU runs): the collector's memory-only record
(fsdpprof.collect.before_window) and how the analysis counts it (cpu_events), on hand-built inputs."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from fsdpprof import runfmt
from fsdpprof.analyze.memory import attribution
from fsdpprof.analyze.memory.cpu_events import cpu_allocations, freed_unseen
from fsdpprof.analyze.memory.snapshot import NEVER
from fsdpprof.collect.before_window import BeforeWindowMemory

DEVICE_CPU = 0


def _events(rows):
    """[memory] events: (ts_us, addr, bytes) rows, on the CPU."""
    ts, addr, b = zip(*rows)
    return pd.DataFrame({"rank": 0, "ts_us": np.array(ts, float), "addr": np.array(addr, np.int64),
                         "bytes": np.array(b, np.int64), "total_allocated_bytes": 0, "total_reserved_bytes": 0,
                         "device_type": DEVICE_CPU, "device_id": 0})


def _inventory(allocations, every=None, error=None):
    return {"schema": runfmt.INVENTORY_SCHEMA, "rank": 0, "world_size": 1, "tensors": [],
            runfmt.INVENTORY_BEFORE_WINDOW: {"allocations": allocations, "alive_bytes_every_thread": every,
                                             "error": error}}


def _alive_at_start(allocs) -> int:
    return int(allocs.loc[allocs["before_trace"], "bytes"].sum())


# window: 0x10 (100 B, made before) freed at t=2; 0x20 allocated at t=1 and freed at t=3; 0x30 allocated at t=4
WINDOW = [(1.0, 0x20, 50), (2.0, 0x10, -100), (3.0, 0x20, -50), (4.0, 0x30, 70)]


def test_alive_all_through_the_window_is_counted_once():
    """0x40 (a DDP bucket: 4000 B, never touched in the window) is counted from the start to the end; 0x10, freed
    in the window, is its orphan free once, not twice; 0x20 allocated again first was freed unseen: left out."""
    allocs, _, warns = cpu_allocations(_events(WINDOW), None,
                                       _inventory([[0x10, 100, 0], [0x20, 64, 1], [0x40, 4000, 1]]), "t")
    assert _alive_at_start(allocs) == 100 + 4000
    bucket = allocs[allocs["addr"] == 0x40]
    assert len(bucket) == 1 and np.isnan(bucket["free_us"].iat[0]) and bucket["before_trace"].iat[0]
    assert (allocs["addr"] == 0x10).sum() == 1
    assert any("allocated again in the window" in w for w in warns)


def test_without_the_record_only_what_the_window_frees():
    allocs, _, _ = cpu_allocations(_events(WINDOW), None, None, "t")
    assert _alive_at_start(allocs) == 100


def test_freed_on_another_thread_by_the_allocators_count():
    """The allocator's every-thread count holds 3000 B less than the record: the one 3000 B allocation the window
    never touches was freed on a thread no profiler records (a gloo buffer) and is left out."""
    pre = [[0x10, 100, 0], [0x40, 4000, 1], [0x50, 3000, 0], [0x60, 1000, 0]]
    allocs, _, warns = cpu_allocations(_events(WINDOW), None, _inventory(pre, every=100 + 4000 + 1000), "t")
    assert _alive_at_start(allocs) == 100 + 4000 + 1000
    assert 0x50 not in set(allocs["addr"])
    assert any("freed on a thread the profiler does not record" in w for w in warns)
    # no set of the record's allocations makes the difference: all kept, and said
    allocs, _, warns = cpu_allocations(_events(WINDOW), None, _inventory(pre, every=100 + 4000 + 1000 + 3000 - 7),
                                       "t")
    assert _alive_at_start(allocs) == 100 + 4000 + 3000 + 1000
    assert any("may be overstated" in w for w in warns)


def test_a_record_that_stopped_early_is_not_used():
    allocs, _, warns = cpu_allocations(_events(WINDOW), None, _inventory([], error="forked process"), "t")
    assert _alive_at_start(allocs) == 100
    assert any("stopped early (forked process)" in w for w in warns)


def test_freed_unseen_picks_the_fewest_that_sum_exactly():
    sizes = np.array([5, 7, 11, 13])
    assert sorted(sizes[freed_unseen(sizes, 11)]) == [11]
    assert sorted(sizes[freed_unseen(sizes, 18)]) in ([5, 13], [7, 11])
    assert sorted(sizes[freed_unseen(sizes, 29)]) == [5, 11, 13]
    assert len(freed_unseen(sizes, 4)) == 0 and len(freed_unseen(sizes, 0)) == 0
    four = np.array([5, 11, 13, 17, 40])         # 46 only as 5 + 11 + 13 + 17 (FSDP2 rank 1: four gloo buffers)
    assert sorted(four[freed_unseen(four, 46)]) == [5, 11, 13, 17]
    assert len(freed_unseen(four, 46, max_set=3)) == 0


def test_the_record_keeps_what_is_alive_and_when_it_was_made():
    """In this process: tensors made before and between two optimizer steps, some freed: the record lists those
    alive at the end with their step, the allocator's every-thread count agrees, and the flag is put back."""
    rec = BeforeWindowMemory()
    assert rec.start("test")
    try:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        rec.stepped()
        c = torch.empty(5000, dtype=torch.uint8)
        del b
        doc = rec.finish()
    finally:
        rec.drop("test over")
    assert doc["error"] is None and doc["steps"] == 1
    live = {addr: (size, step) for addr, size, step in doc["allocations"]}
    assert live[a.untyped_storage().data_ptr()] == (1000, 0)
    assert live[c.untyped_storage().data_ptr()] == (5000, 1)
    assert doc["alive_bytes"] == sum(s for s, _ in live.values())
    assert doc["alive_bytes_every_thread"] == doc["alive_bytes"]
    assert rec.flag_ok and bool(rec.flag.value) == rec.flag_was
    assert not torch.autograd.profiler._is_profiler_enabled and not torch._C._autograd._profiler_enabled()


def test_the_record_never_raises(monkeypatch):
    """A profiler call that fails stops the record with its reason; the job's code goes on."""
    rec = BeforeWindowMemory()

    def boom(self):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(BeforeWindowMemory, "_enable", boom)
    assert rec.start("test") is False
    rec.stepped()
    doc = rec.finish()
    assert "no profiler here" in doc["error"] and doc["allocations"] == []


def test_ddp_buckets_named_by_their_sizes():
    """inventory.json's ddp_bucket_bytes names, per bucket, one allocation of its size alive all through the
    window (the latest made first): gradients waiting for their all-reduce."""
    from fsdpprof.analyze.memory.categorize import categorize

    inv = _inventory([[0x10, 100, 0], [0x40, 4000, 0], [0x41, 4000, 1], [0x42, 900, 1]])
    inv["ddp_bucket_bytes"] = [900, 4000]
    allocs, inv_t, _ = cpu_allocations(_events(WINDOW), None, inv, "t")
    cat = categorize(allocs, inv_tensors=inv_t).set_index("addr")["category"]
    assert cat[0x41] == cat[0x42] == "unsharded_grad"
    assert cat[0x40] == "before_recording"


def _levels(allocs, n: int) -> np.ndarray:
    """Bytes the allocations hold after each of the window's ``n`` events (alloc_seq <= k < free_seq)."""
    level = np.zeros(n + 1, dtype=np.int64)
    np.add.at(level, np.clip(allocs["alloc_seq"].to_numpy() + 1, 0, n), allocs["bytes"].to_numpy())
    freed = allocs["free_seq"].to_numpy() < n
    np.add.at(level, allocs["free_seq"].to_numpy()[freed] + 1, -allocs["bytes"].to_numpy()[freed])
    return np.cumsum(level)


def _counted(events, totals, counted_from, at_start):
    ev = _events(events)
    ev["total_allocated_bytes"] = np.array(totals, np.int64)
    inv = _inventory([[0x10, 100, 0], [0x40, 4000, 1]], every=4100)
    inv[runfmt.INVENTORY_BEFORE_WINDOW].update({
        runfmt.WINDOW_COUNTS_EVERY_THREAD: True, "every_thread_counted_from": counted_from,
        "every_thread_bytes_at_start": at_start, "frees_unseen_bytes": 0})
    return ev, inv


def test_other_threads_bytes_from_the_allocators_count_through_the_window():
    """c10 counted every thread from torch's import: 5000 B alive as the window began, the record holds 4100 B
    of it (900 B were made before the record: named by nothing, before_recording); a gloo thread holds 500 B from
    between the first two events to between the last two (seen only in Total Allocated).  After every event the
    allocations hold exactly the count, the gloo bytes as other_threads rows where the count shows them."""
    ev, inv = _counted(WINDOW, [5050, 5450, 5400, 4970], runfmt.COUNT_FROM_IMPORT, 900)
    allocs, _, _ = cpu_allocations(ev, None, inv, "t")
    assert np.array_equal(_levels(allocs, 4), [5000, 5050, 5450, 5400, 4970])
    other = allocs[allocs["other_threads_row"]]
    assert other[["alloc_seq", "bytes"]].values.tolist() == [[1, 500], [3, -500]]
    start = allocs[(allocs["addr"] == -1) & ~allocs["other_threads_row"]]
    assert start[["alloc_seq", "bytes"]].values.tolist() == [[-1, 900]] and start["before_trace"].all()


def test_other_threads_counted_from_the_records_start():
    """fsdpprof.record() in code: the count began with the record (4100 B, what it holds), so the bytes alive are
    the record's plus the count's change; the same 500 B of a gloo thread show as other threads."""
    ev, inv = _counted(WINDOW, [4150, 4550, 4500, 4070], "record start", 0)
    allocs, _, _ = cpu_allocations(ev, None, inv, "t")
    assert np.array_equal(_levels(allocs, 4), [4100, 4150, 4550, 4500, 4070])
    assert allocs.loc[allocs["other_threads_row"], ["alloc_seq", "bytes"]].values.tolist() == [[1, 500], [3, -500]]


def test_without_the_count_through_the_window_no_other_threads_rows():
    """A run whose count stopped at the window's start: Total Allocated is the recorded thread's, no rows added."""
    ev, inv = _counted(WINDOW, [5050, 4950, 4900, 4970], runfmt.COUNT_FROM_IMPORT, 900)
    inv[runfmt.INVENTORY_BEFORE_WINDOW][runfmt.WINDOW_COUNTS_EVERY_THREAD] = False
    allocs, _, _ = cpu_allocations(ev, None, inv, "t")
    assert "other_threads_row" not in allocs or not allocs["other_threads_row"].any()


def test_timeline_never_shows_more_than_the_count_at_an_event():
    """At one event the main thread allocates 3000 B that a gloo thread's buffer, counted until then as other
    threads' bytes, now is (the other-threads row of -3000 B at the same event): the timeline's stacked total after
    the event is the count, and no point between shows both (the recorded FSDP2 run's timeline read 3,159,040 B
    above its peak, a gloo buffer twice)."""
    cats = pd.CategoricalDtype(attribution.CATEGORIES)
    df = pd.DataFrame({
        "category": pd.Categorical(["sharded_param", "other_threads", "temporary", "other_threads"], dtype=cats),
        "bytes": np.array([1000, 3000, 3000, -3000], np.int64),
        "alloc_seq": np.array([-1, 0, 1, 1], np.int64), "free_seq": np.full(4, NEVER, np.int64),
        "alloc_us": [0.0, 10.0, 20.0, 20.0], "free_us": np.nan})
    tl = attribution._timeline(df, points=2000)
    total = tl.drop(columns="ts_us").sum(axis=1)
    assert int(total.max()) == 4000 and int(total.iloc[-1]) == 4000
    assert int(tl["temporary"].iloc[-1]) == 3000 and int(tl["other_threads"].iloc[-1]) == 0


def test_other_threads_freeing_what_was_alive_unnamed_at_the_start():
    """900 B were alive unnamed as the window began (before_recording); at the third event the count is 300 B
    below what the record holds: a thread the profiler does not record freed 300 B it had made before the window.
    Those come out of the start's row (freed there), not as a negative other-threads row."""
    ev, inv = _counted(WINDOW, [5050, 4950, 4600, 4670], runfmt.COUNT_FROM_IMPORT, 900)
    allocs, _, _ = cpu_allocations(ev, None, inv, "t")
    assert np.array_equal(_levels(allocs, 4), [5000, 5050, 4950, 4600, 4670])
    assert not allocs["other_threads_row"].any()
    start = allocs[(allocs["addr"] == -1) & ~allocs["other_threads_row"]]
    assert sorted(start[["bytes", "free_seq"]].values.tolist()) == [[300, 2], [600, NEVER]]
    assert start["before_trace"].all() and (start["alloc_seq"] == -1).all()
