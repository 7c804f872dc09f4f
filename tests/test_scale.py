"""Many ranks: the per-rank results stay small, the report and summary.json stay bounded (distributions over
ranks above 16 ranks), and the synthetic ranks of benchmarks/bench_scale.py are faithful copies."""
from __future__ import annotations

import dataclasses
import gzip
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT, shared_data
from fsdpprof.analyze.load.frames import PackedFrame, packed, unpacked

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
MANY_SECTIONS = ("memory_peaks", "comm_phase", "overlap_per_rank", "traffic", "steps", "stragglers", "temporal",
                 "idle", "top_kernels")


def _renumbered(res, rank: int, keep_detail: bool):
    """A copy of a real RankResult as rank ``rank`` (every per-rank table renumbered)."""
    out = dataclasses.replace(res, rank=rank, label=f"rank-{rank}")
    for f in dataclasses.fields(res):
        v = getattr(res, f.name)
        if isinstance(v, PackedFrame) and "rank" in unpacked(v).columns:
            setattr(out, f.name, packed(unpacked(v).assign(rank=rank)))
        elif isinstance(v, pd.DataFrame) and "rank" in v.columns:
            setattr(out, f.name, v.assign(rank=rank))
    if res.memory is not None:
        out.memory = dataclasses.replace(res.memory, rank=rank, timeline=res.memory.timeline if keep_detail else None)
    if not keep_detail:
        out.lanes, out.top_ops = None, None
    return out


def _replicated(run, results, n: int):
    """The run and its results as n ranks: rank r is a copy of the real rank r % len(results).  The copies'
    collectives in the whole job's group are calls of an n-rank job's group (group_size n): the matching rightly
    refuses an unnamed group of 8 called by 1,024 ranks (its peers are unknown)."""
    rds = [run.ranks[r.rank] for r in results]
    run_n = dataclasses.replace(run, ranks={r: dataclasses.replace(rds[r % len(rds)], rank=r, label=f"rank-{r}")
                                            for r in range(n)}, world_size=n, missing={})
    out = [_renumbered(results[r % len(results)], r, r == 0) for r in range(n)]
    for res in out:
        if res.records is not None and "group_size" in res.records:
            whole = res.records["group_size"] == len(results)
            res.records = res.records.assign(group_size=res.records["group_size"].where(~whole, float(n)))
    return run_n, out


@pytest.mark.slow
@pytest.mark.parametrize("source", ["recorded fsdp2 run", "8-rank GPU traces"])
def test_report_and_summary_bounded_at_1024_ranks(recorded_run, source):
    """Real per-rank results (a recorded CPU run; the DLRM GPU traces) copied to 64 and 1024 ranks."""
    from fsdpprof.analyze.pipeline import map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.report import many_ranks
    from fsdpprof.report.page import Page
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.outputs import json_bytes
    from fsdpprof.report.summary import summary

    gpu = source.startswith("8-rank")
    run = load_run(shared_data(*DLRM) if gpu else recorded_run("fsdp2"), lazy=True)
    base = map_ranks(run, workers=1)
    sizes = {}
    for n in (64, 1024):
        a = reduce_run(*_replicated(run, base, n))
        assert many_ranks.is_many(a)
        s = summary(a)
        assert len(s["overlap_overall"]) == n and len(s["temporal" if gpu else "memory_peaks"]) == n  # rows kept
        html = render_report(a) if n == 1024 else ""
        page = Page()
        page.n_figs = 1                                 # plotly.js is already in the page
        frags = {name: getattr(many_ranks, name)(a, page) for name in MANY_SECTIONS}
        for name in ("overlap_per_rank", "steps", "stragglers", "comm_phase") + (
                ("temporal", "idle", "top_kernels") if gpu else ("memory_peaks", "traffic")):
            assert frags[name], name
        sizes[n] = {"html": len(html), "frags": {k: len(v) for k, v in frags.items()},
                    "dist": len(json.dumps(s["rank_distributions"])), "summary": len(json_bytes(s))}
        for name in ("overlap_worst", "steps_worst", "stragglers_worst") + (
                ("temporal_worst",) if gpu else ("memory_peak_worst",)):
            assert len(s["rank_distributions"][name]) == 10, name
    big, small = sizes[1024], sizes[64]
    print(f"\nsizes at 64 and 1024 ranks: {small} {big}")
    # the page as the lead hooks it in is at most today's page plus the many-ranks fragments
    assert big["html"] + sum(big["frags"].values()) < 10e6
    # the distributions do not grow with the ranks; the page's fragments only by the histograms' raw values
    # (a float32 per rank, binned by plotly in the browser) and the heat map (one row per rank, <= 1024)
    assert big["dist"] <= 1.05 * small["dist"] and big["dist"] < 100_000
    for name, size in big["frags"].items():
        limit = small["frags"][name] * 1.15 + 16 * (1024 - 64) + (40_000 if name == "steps" else 0)
        assert size <= limit, (name, size, small["frags"][name])


def _trace_folder_of(run_dir: Path, n: int, out: Path) -> Path:
    """n rank traces from a recorded run's two: rank i is rank i % 2's trace with distributedInfo rank i of n."""
    out.mkdir()
    docs = [json.loads(gzip.decompress((run_dir / f"rank-{r}" / "trace.json.gz").read_bytes())) for r in (0, 1)]
    for i in range(n):
        doc = docs[i % 2]
        doc["distributedInfo"] = dict(doc.get("distributedInfo") or {}, rank=i, world_size=n)
        (out / f"rank-{i}.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode(), 1))
    return out


@pytest.mark.slow
def test_above_16_ranks_one_rank_keeps_its_detail(recorded_run, tmp_path):
    """The parent holds small results: the memory timeline and the lanes of one rank only above 16 ranks;
    the report's distributions name the worst ranks."""
    from fsdpprof.analyze.pipeline import DETAIL_RANKS_MAX, map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.report import many_ranks
    from fsdpprof.report.page import Page

    n = DETAIL_RANKS_MAX + 2
    run = load_run(_trace_folder_of(recorded_run("fsdp2"), n, tmp_path / "traces"), lazy=True)
    res = map_ranks(run, workers=2)
    assert [r.rank for r in res] == list(range(n)) and not any(r.error for r in res)
    assert res[0].memory.timeline is not None and res[0].lanes is not None
    assert all(r.memory is not None and r.memory.timeline is None and r.lanes is None for r in res[1:])
    one = len(pickle.dumps(res[0]))
    rest = max(len(pickle.dumps(r)) for r in res[1:])
    print(f"\nresult of rank 0 (detail): {one} bytes; largest other: {rest} bytes")
    assert rest < 64_000 and rest < one / 2
    a = reduce_run(run, res)
    assert many_ranks.is_many(a)
    html = many_ranks.memory_peaks(a, Page()) + many_ranks.steps(a, Page())
    assert "distribution over 18 ranks" in html and "The 10 ranks with the highest peak" in html
    assert "Exposed communication per rank and step (18 ranks)" in html


def test_distributions_known_answers():
    from fsdpprof.analyze.summary import distributions as d

    per_rank = pd.DataFrame({"rank": np.arange(100), "step_us": np.arange(100) * 2.0})
    st = d.statistics(per_rank, ["step_us"]).set_index("statistic")
    assert st.loc["p50", "step_us"] == 99.0 and st.loc["p90", "step_us"] == pytest.approx(178.2)
    assert st.loc["max", "step_us"] == 198.0 and st.loc["mean", "step_us"] == 99.0 and (st["ranks"] == 100).all()
    w = d.worst(per_rank, "step_us")
    assert list(w["rank"]) == list(range(99, 89, -1))
    ties = pd.DataFrame({"rank": [5, 3, 4], "x_us": [1.0, 1.0, 0.5]})
    assert list(d.worst(ties, "x_us")["rank"]) == [3, 5, 4]
    rows = pd.DataFrame({"rank": [0, 0, 1, 2], "collective": ["ag", "ag", "ag", "rs"],
                         "exposed_comm_us": [1.0, 2.0, 5.0, 7.0], "count": [1, 1, 1, 1]})
    g = d.grouped(rows, ["collective"], "exposed_comm_us", ["count", "exposed_comm_us"]).set_index("collective")
    assert g.loc["ag", "ranks"] == 2 and g.loc["ag", "count"] == 3 and g.loc["ag", "exposed_comm_us"] == 8.0
    assert g.loc["ag", "max_exposed_comm_us"] == 5.0 and g.loc["ag", "worst_rank"] == 1     # rank 0: 1 + 2 = 3
    assert g.loc["ag", "p50_exposed_comm_us"] == 4.0 and g.loc["rs", "worst_rank"] == 2
    steps = pd.DataFrame({"rank": np.repeat(np.arange(10), 2), "step": np.tile([1.0, 2.0], 10),
                          "exposed_comm_us": np.arange(20, dtype=float)})
    z, labels, cols = d.exposed_heatmap(steps)
    assert z.shape == (10, 2) and z[3, 1] == 7.0 and labels[0] == "rank 0" and cols == [1.0, 2.0]
    z, labels, _ = d.exposed_heatmap(steps, max_rows=4)                  # bins of 3 ranks, max per bin
    assert labels == ["ranks 0-2", "ranks 3-5", "ranks 6-8", "ranks 9-9"]
    assert z[:, 0].tolist() == [4.0, 10.0, 16.0, 18.0] and z[:, 1].tolist() == [5.0, 11.0, 17.0, 19.0]


def _grouped_by_pandas(df, keys, value, sums=()):
    """distributions.grouped as pandas' groupby says it (what it was before numpy): the reference."""
    d = df[keys + ["rank", value] + [c for c in sums if c in df.columns and c != value]].copy()
    for k in keys:
        d[k] = d[k].astype(object)
    per = d.groupby(keys + ["rank"], sort=False, dropna=False)[value].sum(min_count=1).reset_index()
    g = per.groupby(keys, sort=False, dropna=False)
    out = g["rank"].nunique().rename("ranks").reset_index()
    for c in [c for c in sums if c in d.columns]:
        out[c] = d.groupby(keys, sort=False, dropna=False)[c].sum(min_count=1).to_numpy()
    out[f"p50_{value}"] = g[value].quantile(0.5).to_numpy()
    out[f"p90_{value}"] = g[value].quantile(0.9).to_numpy()
    out[f"max_{value}"] = g[value].max().to_numpy()
    top = per.sort_values([value, "rank"], ascending=[False, True], kind="mergesort").drop_duplicates(keys)
    return out.merge(top[keys + ["rank"]].rename(columns={"rank": "worst_rank"}), on=keys, how="left")


def test_grouped_is_pandas_groupby():
    """grouped() (one factorisation, bincount) gives the frame pandas' groupby gives, dtypes included: groups
    in order of first appearance, None and NaN keys one group of their own, keys of only missing values,
    values missing in a whole group or for a rank, ties (the lowest rank), integer values, category keys (126 frames)."""
    from fsdpprof.analyze.summary import distributions as d

    rng = np.random.default_rng(11)
    checked = 0
    for trial in range(42):            # (every combination of the three cycles below: 7, 2 and 3 trials)
        m = int(rng.integers(1, 40))
        k1 = [None, np.nan] if trial % 7 == 0 else ["ag", "rs", None, np.nan]
        df = pd.DataFrame({
            "k1": rng.choice(np.array(k1, dtype=object), m),
            "k2": pd.Categorical(rng.choice(["fwd", "bwd", "opt"], m)) if trial % 2 else rng.choice([1.0, 2.0, np.nan], m),
            "rank": rng.integers(0, 6, m),
            "v": (rng.integers(0, 4, m) if trial % 3 == 0 else
                  np.where(rng.random(m) < 0.3, np.nan, rng.integers(0, 4, m) * 1.5)),
            "s": rng.random(m),
        })
        for keys, sums in ((["k1", "k2"], ["s", "v"]), (["k1"], []), (["k2"], ["s"])):
            got, want = d.grouped(df, keys, "v", sums), _grouped_by_pandas(df, keys, "v", sums)
            pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-12, atol=0)
            checked += len(want)
    assert checked > 200


def test_distribution_statistics_are_pandas_quantiles():
    """statistics() (numpy, one pass per column) gives what pandas' Series.quantile / mean give: missing values
    and text left out, a column without a value NaN, nullable integers read as numbers."""
    from fsdpprof.analyze.summary import distributions as d

    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 33):
        df = pd.DataFrame({"rank": range(n), "a": rng.normal(size=n), "b": rng.integers(0, 10**12, size=n),
                           "c": np.where(rng.random(n) < 0.4, np.nan, rng.random(n)), "e": [np.nan] * n,
                           "t": ["x"] * n, "f": pd.array(rng.integers(0, 5, size=n), dtype="Int64")})
        df.loc[n // 2, "f"] = pd.NA
        cols = ["a", "b", "c", "e", "t", "f"]
        got = d.statistics(df, cols + ["not a column"])
        v = df[cols].apply(pd.to_numeric, errors="coerce").astype(float)
        want = pd.DataFrame([{"statistic": name, **{c: v[c].quantile(q) for c in cols}} for name, q in d.STATISTICS]
                            + [{"statistic": "mean", **{c: v[c].mean() for c in cols}}])
        want.insert(1, "ranks", int(v.notna().any(axis=1).sum()))
        pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-12)


def test_bench_scale_synthetic_rank_is_a_faithful_copy(tmp_path):
    """Rank 11 of 64 built from DLRM rank 3 with 3 copies: 3 steps, 3x the collectives and kernels, every
    kernel still finds its launch (shifted correlation ids), the same per-copy timings."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_scale

    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.load.run import load_run

    src = shared_data(*DLRM) / "rank-3.json.gz"
    one = bench_scale._source(3)[3]            # JSON bytes of its events, as written (no white space)
    path = tmp_path / "rank-11.json.gz"
    written = bench_scale.write_rank(11, 64, 3 * one, str(path))
    assert abs(written - 3 * one) < 0.1 * one and bench_scale.plain_bytes(str(path)) == written
    orig = analyze_run(load_run(src, lazy=True))
    syn = analyze_run(load_run(path, lazy=True))
    assert syn.overview["world_size"] == 64 and syn.overview["ranks_present"] == [11]
    assert syn.overview["steps_analysed"] == 3 * orig.overview["steps_analysed"]
    assert syn.overview["device_kernels"] == 3 * orig.overview["device_kernels"]
    assert syn.overview["unknown_launch_kernels"] == 3 * orig.overview["unknown_launch_kernels"]
    assert syn.volume["count"].sum() == 3 * orig.volume["count"].sum()
    assert syn.steps["step_us"].tolist() == pytest.approx(orig.steps["step_us"].tolist() * 3)
    assert syn.steps["exposed_comm_us"].tolist() == pytest.approx(orig.steps["exposed_comm_us"].tolist() * 3)


@pytest.mark.slow
def test_what_if_replays_of_many_ranks_in_a_pool_are_the_replays_in_the_parent(recorded_run, monkeypatch):
    """From predict.REPLAY_POOL_MIN_RANKS ranks on, the what-if reduce replays the ranks in a local pool: the
    predictions are those of the replays in the parent, and a chunk whose worker fails is replayed in the
    parent."""
    from fsdpprof.analyze.load import engines
    from fsdpprof.analyze.pipeline import map_ranks
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.analyze.whatif import predict as wp

    run = load_run(recorded_run("fsdp2"), lazy=True)
    n = wp.REPLAY_POOL_MIN_RANKS
    whatifs = [r.whatif for r in _replicated(run, map_ranks(run, workers=1), n)[1]]
    assert all(w and w["timing"] is not None for w in whatifs)
    calls = []
    real_map = engines.map_unordered

    def spy(fn, jobs, **kw):
        calls.append(len(jobs))
        for k, ok, value in real_map(fn, jobs, **kw):
            yield (k, False, "worker failed (test)") if k == 0 else (k, ok, value)

    monkeypatch.setattr(engines, "map_unordered", spy)
    pooled = wp.report_reduce(whatifs)
    assert calls and calls[0] > 1                           # the pool ran, in chunks
    monkeypatch.setattr(wp, "REPLAY_POOL_MIN_RANKS", n + 1)
    calls.clear()
    here = wp.report_reduce(whatifs)
    assert calls == []                                      # one rank fewer than the threshold: no pool
    assert json.dumps(pooled, sort_keys=True, default=str) == json.dumps(here, sort_keys=True, default=str)
    assert set(pooled["fits"]) == {str(w["rank"]) for w in whatifs} and all(pooled["fits"].values())
    assert all(p["step_us"] and p["step_us"] > 0 for p in pooled["predictions"])


def test_packed_frame_is_lossless_and_smaller():
    """A per-rank table held packed comes back exactly (float64 times to the last bit, categoricals, strings,
    ints) and is smaller than its pickle."""
    rng = np.random.default_rng(0)
    n = 3000
    start = 5.749e12 + np.cumsum(rng.exponential(40.0, n))
    df = pd.DataFrame({"rank": np.full(n, 3, dtype=np.int32), "step": np.repeat([2.0, 3.0, np.nan], n // 3),
                       "start_us": start, "dur_us": rng.exponential(40.0, n),
                       "what": pd.Categorical(rng.choice(["aten::mm", "nccl:all_gather", None], n)),
                       "name": rng.choice(["a", "b"], n).astype(object), "call": np.arange(n, dtype=np.int32)})
    p = packed(df)
    back = unpacked(p)
    pd.testing.assert_frame_equal(back, df, check_exact=True)
    assert (back["start_us"].to_numpy().view(np.int64) == start.view(np.int64)).all()
    assert len(p) == n and len(pickle.dumps(p)) < len(pickle.dumps(df))
    assert unpacked(df) is df and packed(None) is None and unpacked(None) is None
