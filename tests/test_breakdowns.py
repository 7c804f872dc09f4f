"""Native GPU breakdowns (fsdpprof.analyze.comm.breakdown) against HTA, the oracle, on every real GPU trace,
plus hand-built events and a tiny trace whose breakdowns are known exactly.

HTA (holistictraceanalysis 0.5) and we use the same definitions (see breakdown's module docstring).  On
the kernels HTA keeps (quirk 1) every percentage is within 0.5 points of HTA's, except where a quirk
below moves HTA's figure further; every quirk is reproduced on our events, and with them our figures
equal HTA's to 0.01 points, so they are the whole difference (largest differences, in points, printed by
test_max_points_summary with -s; all under 1):

1. Which kernels.  With two or more ProfilerSteps in the trace, HTA keeps only the kernels whose CPU
   launch (runtime call, same correlation) starts before the end of the last ProfilerStep
   (``include_last_profiler_step=True``) or before the start of the last one (its default); a kernel
   whose launch is not in the trace is dropped (hta-16rank-a100: 872 of 7,747 device events, 4.6
   idle points).  ``hta_selection`` applies that rule to our events: the breakdown functions take the
   events they are given, and the pipeline chooses which.
2. Whole microseconds.  On a trace with ns-resolution (float) times HTA moves every start up and
   every end down to a whole microsecond (trace_parser.round_down_time_stamps): every kernel loses up
   to 2 us (hta-nccl-2rank-a100: 0.5 temporal, 0.7 kernel-type points; tracelens-b200, short kernels:
   0.9 and 1.0).  HTA's own switch HTA_DISABLE_NS_ROUNDING=1 turns it off: we compare with that, and
   show that the rounding moves HTA's figures by as much as they differ from ours.  Its kernel-type
   sweep also cuts every piece to whole us (``astype(int)``), exact only on rounded times: there
   ``hta_rounding`` rounds our events the same way and compares with HTA's default.
3. Idle-time breakdown: (a) HTA looks up a kernel's launch through ``index_correlation``, which is 0
   when the launch is not in the trace, so such a kernel takes the start of the file's first event as
   its launch time (param-dlrm ranks 1 and 3: 64 kernels each, 0.53 points) where we say "unknown, not
   host wait": ``hta_unlinked_launch``.  (b) HTA takes the gap after the previous kernel of the stream,
   we after the latest end before it, and clip at 0: kernels on one stream overlap by up to 2 us in
   ns traces, which HTA counts as negative kernel wait (``hta_negative_gaps``).  (c) HTA rounds the
   ratio to 2 decimals (1 point): its percentages are recomputed from its idle_time column.
4. Kernel-type table: HTA rounds percentages to 0.1: they are recomputed from its ``sum`` column.  Its
   top-kernel table, once a type has more than ``num_kernels`` names, aggregates the per-kernel sums
   again (max/min/mean/std of the sums, not of the kernels): the sums of the kernels it names, and the
   statistics where it has them, are compared.
5. HTA takes every event with a ``stream`` arg for a GPU event: Inductor's ``triton_*`` launcher CPU op
   in tracelens-b200 carries ``stream: 0``, so HTA counts 74 us of CPU time as a computation kernel
   (0.09 points): ``hta_cpu_ops_on_streams``.
6. Which kernels are communication.  HTA's are the kernels named ``^nccl.*Kernel``; ours also every kernel
   launched inside a collective op, whatever it is called (classify: symmetric-memory and custom
   all-reduces).  On tracelens-b200 these are exactly the 73 ``multimem_all_reduce_kernel`` launches under
   ``symm_mem::multimem_all_reduce_`` (``vllm::all_reduce``), which HTA counts as computation (2.5 compute
   points); on the other traces there are none.  ``hta_comm_by_name`` gives those kernels HTA's kind, and the
   test checks that they are all the difference.
"""
from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pandas as pd
import pytest

from conftest import shared_data
from hta_oracle import hta_results
from fsdpprof.analyze import model
from fsdpprof.analyze.comm import breakdown as bd
from fsdpprof.analyze.load.frames import isin
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.trace import decode_trace

SINGLE = ["hta-nccl-2rank-a100/rank-0.json.gz", "hta-16rank-a100/rank-0.json.gz",
          "tracelens-b200-8rank/rank-0.json.gz"]
DLRM = "param-dlrm-8rank-v100"
POINTS = 0.5         # the goal: every percentage within this many points of HTA
EXACT = 0.011        # with HTA's quirks applied to our events (HTA rounds temporal pct to 0.01)
_RUNTIME_CATS = list(model.RUNTIME_CATS)


# --- helpers: our events with the launch time, and HTA's rules applied to them -----------------------

def launch_ts_us(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(launch_ts_us, ts_us) per row of the events frame of ``path``, computed here from the decoded rows,
    independently of fsdpprof's labels: a device event's CPU launch (the first runtime call with its
    correlation id), NaN when not in the trace; other rows their own start.  The events frame holds the
    decoded rows, in order (classify_arrays)."""
    cols = decode_trace(path).cols
    cats = np.asarray(cols["cat_cats"], dtype=object)
    names = np.asarray(cols["name_cats"], dtype=object)
    # (the decoder puts the runtime calls that launch device work in a table of their own, in file order; the
    # ones that block the host stay among the rows, as CPU ops)
    is_rt = np.isin(cats, _RUNTIME_CATS)[cols["cat"]] & ~np.isin(names, list(model.SYNC_CALLS))[cols["name"]]
    assert not is_rt.any(), "no launching runtime call among the rows"
    launches = cols["launches"]
    lcorr = launches["correlation"]
    first = pd.Series(launches["ts_us"][lcorr >= 0], index=lcorr[lcorr >= 0])
    first = first[~first.index.duplicated()]
    corr = cols["correlation"]
    ts = cols["ts_us"]
    on_gpu = cols["stream"] >= 0
    launch = np.where(on_gpu, pd.Series(corr).map(first).to_numpy(dtype=np.float64), ts)
    return launch, ts


def events_with_launch(path: str) -> tuple[pd.DataFrame, dict]:
    """(all ranks' events of a trace file or folder, rank -> trace file); the frame's launch_ts_us is
    checked against :func:`launch_ts_us`."""
    run = load_run(path, workers=1)
    frames = []
    for r, d in sorted(run.ranks.items()):
        launch, ts = launch_ts_us(d.trace_path)
        assert np.array_equal(ts, d.events["ts_us"].to_numpy()), "events rows = decoded rows minus runtime calls"
        assert np.allclose(launch, d.events["launch_ts_us"].to_numpy(), equal_nan=True)
        frames.append(d.events)
    ev = pd.concat(frames, ignore_index=True)
    for c in ("lane", "kind", "name"):
        ev[c] = ev[c].astype("category")
    return ev, {r: d.trace_path for r, d in run.ranks.items()}


def per_rank(ev: pd.DataFrame, files: dict, rule) -> pd.DataFrame:
    """``rule(events of one rank, its trace file)`` applied rank by rank."""
    return pd.concat([rule(ev[ev["rank"] == r], files[r]) for r in sorted(ev["rank"].unique())], ignore_index=True)


def _on_stream(ev: pd.DataFrame) -> np.ndarray:
    return ev["lane"].astype(str).str.startswith("stream:").to_numpy()


def _steps(ev: pd.DataFrame) -> pd.DataFrame:
    name = ev["name"].astype(str)
    return ev[name.str.startswith("ProfilerStep").to_numpy() & ~_on_stream(ev)]


def hta_selection(ev: pd.DataFrame, include_last: bool) -> pd.DataFrame:
    """Quirk 1: the device events HTA keeps (launch before the end / start of the last ProfilerStep,
    launch in the trace), when the trace holds at least two ProfilerStep names."""
    steps = _steps(ev)
    if steps["name"].astype(str).nunique() < 2:
        return ev
    keep = ~_on_stream(ev)
    launch = ev["launch_ts_us"].to_numpy()
    for r, s in steps.groupby("rank"):
        limit = (s["ts_us"] + s["dur_us"]).max() if include_last else s["ts_us"].max()
        on = ev["rank"].to_numpy() == r
        keep |= on & ((launch <= limit) if include_last else (launch < limit))
    return ev[keep]


# (trace -> kernels that are communication for us but computation for HTA: quirk 6)
NON_NCCL_COMM = {"tracelens-b200-8rank/rank-0.json.gz": 73}


def hta_comm_by_name(ev: pd.DataFrame, rel: str) -> pd.DataFrame:
    """Quirk 6: HTA's communication kernels are those named ``^nccl.*Kernel``; our comm kernels of any other
    name (launched inside a collective op) back to computation, after checking they are exactly the expected
    ones: symmetric-memory all-reduce kernels, typed all_reduce from the op that launched them."""
    names = ev["name"].astype(str)
    other = _on_stream(ev) & (ev["kind"].astype(str) == model.KIND_COMM).to_numpy() & \
        ~names.str.match(r"^nccl.*Kernel").to_numpy()
    assert int(other.sum()) == NON_NCCL_COMM.get(rel, 0), (rel, names[other].unique())
    if other.any():
        assert names[other].str.contains("multimem_all_reduce_kernel").all()
        assert set(ev.loc[other, "collective"].astype(str)) == {model.ALL_REDUCE}
        assert not np.isnan(ev.loc[other, "launch_ts_us"].to_numpy()).any()
    kind = ev["kind"].astype(object).to_numpy().copy()
    kind[other] = model.KIND_COMPUTE
    return ev.assign(kind=pd.Categorical(kind))


def _float_times(path: str) -> bool:
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return any(isinstance(e.get("ts"), float) for e in events if e.get("ph") == "X")


def hta_rounding(ev: pd.DataFrame, path: str) -> pd.DataFrame:
    """Quirk 2: start up, end down to whole microseconds (only traces with float times); launch up."""
    if not _float_times(path):
        return ev
    end = np.floor(ev["ts_us"] + ev["dur_us"])
    out = ev.assign(ts_us=np.ceil(ev["ts_us"]), launch_ts_us=np.ceil(ev["launch_ts_us"]))
    return out.assign(dur_us=end - out["ts_us"])


def hta_unlinked_launch(ev: pd.DataFrame, path: str) -> pd.DataFrame:
    """Quirk 3: a kernel whose launch is not in the trace takes the start of the file's first event (if it is
    a duration event HTA keeps; else none)."""
    with gzip.open(path, "rt") as fh:
        first = json.load(fh)["traceEvents"][0]
    t0 = float(first["ts"]) if first.get("dur") is not None and first.get("cat") not in (None, "Trace") else np.nan
    if isinstance(first.get("ts"), float):
        t0 = math.ceil(t0)
    miss = _on_stream(ev) & np.isnan(ev["launch_ts_us"].to_numpy())
    return ev.assign(launch_ts_us=np.where(miss, t0, ev["launch_ts_us"].to_numpy()))


def hta_cpu_ops_on_streams(ev: pd.DataFrame, path: str) -> pd.DataFrame:
    """Quirk 5: HTA takes every event with a ``stream`` arg for a GPU event: Inductor's ``triton_*`` launcher
    CPU ops carry one (tracelens-b200: ``stream: 0``), so HTA counts that CPU op (74 us) as a computation
    kernel on stream 0 in its temporal and kernel-type breakdowns.  Here: the same rows moved to that lane."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    on_cpu = [(e["name"], float(e["ts"]), int(e["args"]["stream"])) for e in events
              if e.get("ph") == "X" and e.get("cat") == "cpu_op" and isinstance(e.get("args"), dict)
              and isinstance(e["args"].get("stream"), int) and e["args"]["stream"] != -1]
    if not on_cpu:
        return ev
    ev = ev.copy()
    lanes = [f"stream:{s}" for _, _, s in on_cpu]
    ev["lane"] = ev["lane"].cat.add_categories([x for x in dict.fromkeys(lanes) if x not in ev["lane"].cat.categories])
    names, ts = ev["name"].astype(str).to_numpy(), ev["ts_us"].to_numpy()
    for (name, t, _), lane in zip(on_cpu, lanes):      # a handful of rows
        hit = np.flatnonzero((names == name) & (np.abs(ts - t) < 1e-3) & ~_on_stream(ev))
        assert hit.size == 1, (name, t)
        assert not name.startswith(("nccl", "Memcpy", "Memset", "dma")) and "Sync" not in name
        ev.iloc[hit[0], ev.columns.get_loc("lane")] = lane
        ev.iloc[hit[0], ev.columns.get_loc("kind")] = model.KIND_COMPUTE
    return ev


# --- HTA itself: tests/hta_oracle.py ----------------------------------------------------------------


_EV_CACHE: dict = {}


def ours(target: str) -> tuple[pd.DataFrame, dict]:
    if target not in _EV_CACHE:
        _EV_CACHE[target] = events_with_launch(target)
    return _EV_CACHE[target]


def _path(rel: str) -> str:
    return str(shared_data("gpu-traces", rel))


# --- comparisons: every percentage, ours and HTA's, side by side -------------------------------------

def temporal_pcts(ev: pd.DataFrame, hta: pd.DataFrame) -> pd.DataFrame:
    """ours, hta: the three temporal percentages per rank."""
    t = bd.temporal_breakdown(ev).set_index("rank")
    h = hta.set_index("rank")
    assert sorted(t.index) == sorted(h.index)
    rows = [(r, c, t.loc[r, f"{c}_pct"], h.loc[r, f"{c}_pctg"]) for r in t.index
            for c in ("idle_time", "compute_time", "non_compute_time")]
    return pd.DataFrame(rows, columns=["rank", "what", "ours", "hta"]).set_index(["rank", "what"])


def kernel_type_pcts(ev: pd.DataFrame, hta: pd.DataFrame) -> pd.DataFrame:
    """ours, hta: the kernel-type percentages (HTA's recomputed from its sums: it rounds them to 0.1)."""
    ours_t, _ = bd.kernel_type_breakdown(ev)
    o = ours_t.set_index("kernel_type")["pct"]
    h = hta.set_index("kernel_type")["sum"]
    h = 100.0 * h / h.sum()
    names = sorted(set(o.index) | set(h.index))
    return pd.DataFrame({"ours": [o.get(n, 0.0) for n in names], "hta": [h.get(n, 0.0) for n in names]},
                        index=pd.Index(names, name="what"))


def hta_negative_gaps(ev: pd.DataFrame) -> pd.Series:
    """Quirk 3b: per (rank, stream, idle category), the negative gaps HTA adds in: it takes the gap after the
    previous kernel of the stream (not the latest end), and kernels on one stream overlap by a few ns to
    2 us in ns-resolution traces (tracelens-b200: 74 of 929 on stream 7, -1.9 us each on average), so HTA
    adds negative idle time, which its rules class as kernel wait (host wait when launched after)."""
    on = _on_stream(ev) & np.isin(ev["kind"].astype(str), ["compute", "comm", "memcpy", "memset"])
    k = ev[on].assign(stream=lambda d: d["lane"].astype(str).str.split(":").str[1].astype(int))
    k = k.sort_values(["rank", "stream", "ts_us"], kind="mergesort")
    prev_end = (k["ts_us"] + k["dur_us"]).groupby([k["rank"], k["stream"]]).shift(1)
    gap = k["ts_us"] - prev_end
    neg = gap < 0
    cat = np.where(k["launch_ts_us"] > prev_end, bd.HOST_WAIT,
                   np.where(gap < bd.KERNEL_WAIT_THRESHOLD_US, bd.KERNEL_WAIT, bd.OTHER_WAIT))
    return gap[neg].groupby([k["rank"][neg], k["stream"][neg], cat[neg.to_numpy()]]).sum()


def idle_pcts(ev: pd.DataFrame, hta: pd.DataFrame, negative_gaps: bool = False) -> pd.DataFrame:
    """ours, hta: the idle-category shares per rank and stream (HTA's from its idle_time: it rounds the
    ratio to 0.01); ``negative_gaps``: with quirk 3b applied to ours."""
    o = bd.idle_time_breakdown(ev).set_index(["rank", "stream", "idle_category"])["idle_time_us"]
    if negative_gaps:
        neg = hta_negative_gaps(ev)
        o = o.add(neg.reindex(o.index).fillna(0.0))
    o = 100.0 * o / o.groupby(level=[0, 1]).transform("sum")
    h = hta.assign(total=hta.groupby(["rank", "stream"])["idle_time"].transform("sum"))
    h = (100.0 * h["idle_time"] / h["total"]).set_axis(pd.MultiIndex.from_frame(h[["rank", "stream", "idle_category"]]))
    assert set(h.index.droplevel(2)) == set(o.index.droplevel(2)), "the same streams"
    keys = sorted(set(o.index) | set(h.index))
    return pd.DataFrame({"ours": [o.get(k, 0.0) for k in keys], "hta": [h.get(k, 0.0) for k in keys]},
                        index=pd.MultiIndex.from_tuples(keys))


COMPARE = {"temporal": temporal_pcts, "kernel_type": kernel_type_pcts, "idle": idle_pcts}


def worst(table: pd.DataFrame) -> float:
    return float((table["ours"] - table["hta"]).abs().max())


def check_top_kernels(ev: pd.DataFrame, hta: pd.DataFrame) -> None:
    """Every kernel HTA names (exact times) is in our top 10 of its type with the same total time; where HTA's
    row holds real statistics (few kernels of the type), max/min/mean/std agree too."""
    top = bd.top_kernels(ev, top_n=10).set_index(["rank", "kernel_type", "name"])
    hta = hta[hta["name"] != "others"]
    assert len(hta) > 0
    real_stats = hta.groupby(["rank", "kernel_type"])["name"].transform("size") < 10
    for (_, row), real in zip(hta.iterrows(), real_stats):
        key = (int(row["rank"]), row["kernel_type"], row["name"])
        assert key in top.index, f"HTA's top kernel {key} is in our top 10"
        mine = top.loc[key]
        assert mine["sum_us"] == pytest.approx(row["sum (us)"], rel=1e-9, abs=1e-6), key
        if real:
            for a, b in (("max_us", "max (us)"), ("min_us", "min (us)"), ("mean_us", "mean (us)"), ("std_us", "stddev")):
                assert mine[a] == pytest.approx(row[b], rel=1e-6, abs=1e-6), (key, a)


# (trace, breakdown) where HTA's default figures are more than 0.5 points from ours, and the quirk (see the
# module docstring) that the test reproduces exactly to show it is the whole difference
EXPLAINED = {
    ("hta-nccl-2rank-a100/rank-0.json.gz", "temporal"): "whole microseconds",
    ("hta-nccl-2rank-a100/rank-0.json.gz", "kernel_type"): "whole microseconds",
    ("tracelens-b200-8rank/rank-0.json.gz", "temporal"): "whole microseconds",
    ("tracelens-b200-8rank/rank-0.json.gz", "kernel_type"): "whole microseconds",
    (DLRM, "idle"): "launch of unlinked kernels",
}
FLOAT_TIMES = {"hta-nccl-2rank-a100/rank-0.json.gz", "tracelens-b200-8rank/rank-0.json.gz"}
TARGETS = SINGLE + [DLRM]
MAX_POINTS: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("include_last", [True, False], ids=["all-steps", "hta-default"])
@pytest.mark.parametrize("rel", TARGETS)
def test_breakdowns_match_hta(rel, include_last):
    path = _path(rel)
    ev_all, files = ours(path)
    assert isin(ev_all["kind"], [model.KIND_COMM]).any(), "every anchor trace has NCCL kernels"
    assert (rel in FLOAT_TIMES) == _float_times(files[min(files)])
    hta = hta_results(path, include_last)
    hta_exact = hta_results(path, include_last, rounding=False) if rel in FLOAT_TIMES else hta

    ev = hta_selection(ev_all, include_last)           # quirk 1: the kernels HTA keeps
    ours_kinds = ev
    ev = hta_comm_by_name(ev, rel)                     # quirk 6: HTA's communication kernels
    if rel in NON_NCCL_COMM:                           # ... our own kinds do differ from HTA's there
        assert worst(temporal_pcts(ours_kinds, hta_exact["temporal"])) > 1.0
    quirky = {"temporal": per_rank(ev, files, hta_cpu_ops_on_streams),              # quirk 5
              "idle": per_rank(ev, files, hta_unlinked_launch)}                     # quirk 3
    # quirk 2 as HTA does it (its kernel-type sweep also cuts each piece to whole us: on rounded times only
    # that is exact)
    quirky["kernel_type"] = per_rank(quirky["temporal"], files, hta_rounding)
    report = {}
    for what, fn in COMPARE.items():
        # our events with HTA's quirks and HTA on exact times (its own switch; rounded for kernel types):
        # the same to 0.01 points
        exact = (idle_pcts(quirky[what], hta_exact[what], negative_gaps=True) if what == "idle" else
                 fn(quirky[what], (hta if what == "kernel_type" else hta_exact)[what]))
        assert worst(exact) <= EXACT, (what, exact[(exact["ours"] - exact["hta"]).abs() > EXACT])
        # HTA's default figures: within 0.5 points, or the difference is the quirk named in EXPLAINED
        default = fn(ev, hta[what])
        report[what] = worst(default)
        if (rel, what) in EXPLAINED:
            assert POINTS < report[what] <= 1.0, (what, report[what], "no longer needs the EXPLAINED entry")
            # (kernel types: the exact check above already compared our rounded events with HTA's default)
            if EXPLAINED[(rel, what)] == "whole microseconds" and what != "kernel_type":
                # HTA's own rounding moves HTA's figures by as much as they differ from ours
                moved = (fn(ev, hta_exact[what])["hta"] - default["hta"]).abs()
                assert ((default["ours"] - default["hta"]).abs() <= moved + EXACT).all()
            elif what == "idle":
                assert worst(fn(quirky["idle"], hta[what])) <= EXACT
        else:
            assert report[what] <= POINTS, (what, default)
    MAX_POINTS[(rel, include_last)] = report
    print(f"{rel} include_last={include_last}: max |ours - HTA| points {report}")
    check_top_kernels(ev, hta_exact["kernels"])


def test_max_points_summary():
    """Runs last in this file: the table of the largest differences from HTA (printed with -s)."""
    for (rel, last), rep in sorted(MAX_POINTS.items()):
        print(f"  {rel:42s} {'all steps' if last else 'HTA default':11s} " +
              " ".join(f"{k} {v:.3f}" for k, v in rep.items()))
    assert all(v <= 1.0 for rep in MAX_POINTS.values() for v in rep.values())


# --- hand-built events with breakdowns known exactly ----------------------------------------------

def _frame(rows: list[tuple]) -> pd.DataFrame:
    """Events from (rank, lane, kind, name, ts_us, dur_us, launch_ts_us) rows."""
    df = pd.DataFrame(rows, columns=["rank", "lane", "kind", "name", "ts_us", "dur_us", "launch_ts_us"])
    for c in model.EVENT_COLUMNS:
        if c not in df.columns:
            df[c] = np.nan
    df["rank"] = df["rank"].astype(np.int32)
    for c in ("lane", "kind", "name"):
        df[c] = df[c].astype("category")
    return df


NAN = float("nan")
# rank 0: stream 7 runs gemm [0,10), a copy [25,30) and gemm [40,50); stream 20 an all-reduce [5,20);
# a CPU op and a CPU-side comm call do not count
HAND = _frame([
    (0, "stream:7", "compute", "gemm", 0.0, 10.0, -5.0),
    (0, "stream:20", "comm", "ncclKernel_AllReduce", 5.0, 15.0, 1.0),
    (0, "stream:7", "memcpy", "Memcpy HtoD", 25.0, 5.0, 12.0),     # launched after gemm ended: host wait 15
    (0, "stream:7", "compute", "gemm", 40.0, 10.0, 20.0),          # launched before: gap 10 < 30, kernel wait
    (0, "thread:1", "cpu_op", "aten::mm", -100.0, 500.0, NAN),
    (0, "thread:1", "comm", "gloo:all_reduce", -50.0, 400.0, NAN),
    # rank 1: gap of 40 us with the kernel launched in time: other; a kernel whose launch is unknown after
    # 10 us: kernel wait; a sync event counts as busy, non-compute
    (1, "stream:7", "compute", "relu", 0.0, 10.0, 0.0),
    (1, "stream:7", "compute", "relu", 50.0, 10.0, 5.0),
    (1, "stream:7", "compute", "relu", 70.0, 10.0, NAN),
    (1, "stream:7", "sync", "Stream Sync", 80.0, 20.0, NAN),
])


def test_temporal_hand_built():
    t = bd.temporal_breakdown(HAND).set_index("rank")
    # rank 0: span [0,50); busy [0,20) [25,30) [40,50) = 35 -> idle 15; compute [0,10) [40,50) = 20
    assert t.loc[0, ["span_us", "idle_time_us", "compute_time_us", "non_compute_time_us"]].tolist() == [50, 15, 20, 15]
    assert t.loc[0, ["idle_time_pct", "compute_time_pct", "non_compute_time_pct"]].tolist() == [30, 40, 30]
    # rank 1: span [0,100); busy 10 + 10 + 10 + 20 = 50; compute 30; sync 20 is non-compute
    assert t.loc[1, ["span_us", "idle_time_us", "compute_time_us", "non_compute_time_us"]].tolist() == [100, 50, 30, 20]
    assert (t[["idle_time_pct", "compute_time_pct", "non_compute_time_pct"]].sum(axis=1) == 100).all()


def test_kernel_types_hand_built():
    per_rank = bd.kernel_type_time(HAND).set_index(["rank", "kernel_type"])["time_us"]
    # rank 0: compute alone [0,5) [40,50) = 15, with comm [5,10) = 5, comm alone [10,20) = 10, memory 5
    assert per_rank.loc[0].to_dict() == {"COMPUTATION": 15, "COMMUNICATION": 10,
                                         "COMPUTATION overlapping COMMUNICATION": 5, "MEMORY": 5}
    assert per_rank.loc[1].to_dict() == {"COMPUTATION": 30}        # sync is OTHER: not in the table
    types, top = bd.kernel_type_breakdown(HAND)
    assert types["kernel_type"].tolist()[0] == "COMPUTATION"
    assert types.set_index("kernel_type")["time_us"].to_dict() == {
        "COMPUTATION": 45, "COMMUNICATION": 10, "COMPUTATION overlapping COMMUNICATION": 5, "MEMORY": 5}
    assert types["pct"].sum() == pytest.approx(100.0)
    assert types.set_index("kernel_type").loc["COMPUTATION", "pct"] == pytest.approx(100 * 45 / 65)
    gemm = top.set_index(["rank", "kernel_type", "name"]).loc[(0, "COMPUTATION", "gemm")]
    assert (gemm["count"], gemm["sum_us"], gemm["mean_us"], gemm["std_us"], gemm["type_pct"]) == (2, 20, 10, 0, 100)


def test_top_kernels_hand_built():
    rows = [(0, "stream:7", "compute", n, float(i * 100), d, NAN) for i, (n, d) in enumerate(
        [("a", 50.0), ("b", 10.0), ("b", 30.0), ("c", 8.0), ("d", 1.0), ("d", 3.0), ("e", 2.0)])]
    top = bd.top_kernels(_frame(rows), top_n=2)
    assert top["name"].tolist() == ["a", "b", "others"]
    a, b, others = (top.iloc[i] for i in range(3))
    assert (a["count"], a["sum_us"], a["min_us"], a["max_us"], a["std_us"]) == (1, 50, 50, 50, 0)
    assert (b["count"], b["sum_us"], b["mean_us"], b["min_us"], b["max_us"]) == (2, 40, 20, 10, 30)
    assert b["std_us"] == pytest.approx(np.std([10, 30], ddof=1))
    # others: c, d, d, e (the kernels, not per-name sums)
    assert (others["count"], others["sum_us"], others["min_us"], others["max_us"]) == (4, 14, 1, 8)
    assert others["mean_us"] == pytest.approx(3.5)
    assert others["std_us"] == pytest.approx(np.std([8, 1, 3, 2], ddof=1))
    assert top["type_pct"].sum() == pytest.approx(100.0)
    assert others["type_pct"] == pytest.approx(100 * 14 / 104)


def test_idle_hand_built():
    idle = bd.idle_time_breakdown(HAND).set_index(["rank", "stream", "idle_category"]).sort_index()
    us, pct = idle["idle_time_us"], idle["idle_time_pct"]
    assert us.loc[(0, 7)].to_dict() == {"host_wait": 15, "kernel_wait": 10, "other": 0}
    assert pct.loc[(0, 7)].to_dict() == {"host_wait": 60, "kernel_wait": 40, "other": 0}
    assert us.loc[(0, 20)].sum() == 0 and pct.loc[(0, 20)].isna().all()      # one kernel: no idle
    # rank 1: 40 us gap, kernel launched 45 us before it could run: other; unknown launch: not host wait;
    # the sync event is not a kernel here (as HTA)
    assert us.loc[(1, 7)].to_dict() == {"host_wait": 0, "kernel_wait": 10, "other": 40}
    # the threshold is HTA's consecutive_kernel_delay
    assert bd.idle_time_breakdown(HAND, kernel_wait_threshold_us=5).set_index(
        ["rank", "stream", "idle_category"]).sort_index()["idle_time_us"].loc[(0, 7)].to_dict() == \
        {"host_wait": 15, "kernel_wait": 0, "other": 10}
    with pytest.raises(ValueError, match="launch_ts_us"):
        bd.idle_time_breakdown(HAND.drop(columns="launch_ts_us"))


def test_overlapping_kernels_on_one_stream():
    """A kernel that starts before the previous one on its stream ended (ns jitter): no negative idle time;
    the gap is measured from the latest end before it."""
    ev = _frame([(0, "stream:7", "compute", "k", 0.0, 100.0, 0.0), (0, "stream:7", "compute", "k", 99.0, 2.0, 0.0),
                 (0, "stream:7", "compute", "k", 50.0, 10.0, 0.0), (0, "stream:7", "compute", "k", 120.0, 10.0, 0.0)])
    idle = bd.idle_time_breakdown(ev).set_index("idle_category")["idle_time_us"]
    assert idle.to_dict() == {"host_wait": 0, "kernel_wait": 19, "other": 0}
    t = bd.temporal_breakdown(ev).iloc[0]
    assert (t["span_us"], t["idle_time_us"], t["compute_time_us"]) == (130, 19, 111)


def test_no_device_events():
    """A CPU (gloo) trace has no stream: every breakdown is an empty frame with its columns."""
    cpu = HAND[HAND["lane"].astype(str).str.startswith("thread:")]
    assert bd.temporal_breakdown(cpu).columns.tolist() == bd.TEMPORAL_COLUMNS and bd.temporal_breakdown(cpu).empty
    types, top = bd.kernel_type_breakdown(cpu)
    assert types.empty and top.empty and list(top.columns) == bd.TOP_KERNEL_COLUMNS
    assert bd.idle_time_breakdown(cpu).empty


def _tiny_trace(path) -> None:
    """Two ProfilerSteps; kernels launched by cudaLaunchKernel (correlation); integer times."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1,
           "ts": 900 + 100 * i, "dur": 100, "args": {}} for i in (1, 2)]       # [1000,1100) [1100,1200)
    kernels = [  # name, stream, ts, dur, launch ts
        ("gemm", 7, 1010, 20, 1005), ("ncclKernel_AllGather_RING_LL", 20, 1020, 30, 1008),
        ("Memcpy DtoD", 7, 1060, 5, 1055),      # launched after gemm ended: host wait 30
        ("gemm", 7, 1070, 10, 1040),            # launched before: 5 us, kernel wait
        ("gemm", 7, 1120, 10, 1050),            # launched before: 40 us, other
        ("gemm", 7, 1150, 20, 1135),            # in step 2, launched after: host wait 20
    ]
    for i, (name, stream, ts, dur, launch) in enumerate(kernels):
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": launch,
                   "dur": 2, "args": {"correlation": 100 + i, "External id": i}})
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                   "args": {"stream": stream, "correlation": 100 + i, "External id": i, "device": 0}})
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ev}
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)


@pytest.mark.slow
def test_tiny_trace_against_hand_and_hta(tmp_path):
    path = tmp_path / "rank-0.json.gz"
    _tiny_trace(path)
    ev, _ = events_with_launch(str(path))
    t = bd.temporal_breakdown(ev).iloc[0]
    # span [1010,1170) = 160; busy [1010,1050) [1060,1065) [1070,1080) [1120,1130) [1150,1170) = 85;
    # compute 20 + 10 + 10 + 20 = 60; comm alone 20 + memcpy 5
    assert (t["span_us"], t["idle_time_us"], t["compute_time_us"], t["non_compute_time_us"]) == (160, 75, 60, 25)
    idle = bd.idle_time_breakdown(ev).set_index(["stream", "idle_category"])["idle_time_us"]
    assert idle.loc[7].to_dict() == {"host_wait": 50, "kernel_wait": 5, "other": 40}
    types = bd.kernel_type_breakdown(ev)[0].set_index("kernel_type")["time_us"].to_dict()
    assert types == {"COMPUTATION": 50, "COMMUNICATION": 20, "COMPUTATION overlapping COMMUNICATION": 10, "MEMORY": 5}
    h = hta_results(str(path), include_last=True)
    assert worst(temporal_pcts(ev, h["temporal"])) <= 0.01
    assert worst(kernel_type_pcts(ev, h["kernel_type"])) <= 1e-9
    assert worst(idle_pcts(ev, h["idle"])) <= 1e-9
    # HTA's default drops the kernels launched in the last step: so do we, given those events
    h = hta_results(str(path), include_last=False)
    sub = hta_selection(ev, include_last=False)
    assert len(sub) == len(ev) - 1
    assert worst(temporal_pcts(sub, h["temporal"])) <= 0.01
    assert worst(idle_pcts(sub, h["idle"])) <= 1e-9
