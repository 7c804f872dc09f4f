"""`fsdpprof compare`: runs side by side, a verdict computed from the numbers, bad input; memory by role, one
statistic per number on the page, spread and noise."""
from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from conftest import run_fsdpprof
from fsdpprof.analyze import model
from fsdpprof.analyze.compare import runs as cmp
from fsdpprof.analyze.compare.noise import NoiseTest, median_difference
from fsdpprof.analyze.compare.runs import compare_analyses
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.pipeline import analyze_run
from fsdpprof.analyze.whatif.contention import host_load
from fsdpprof.report.compare_page import render_compare
from fsdpprof.report.diff import diff_text


@pytest.mark.slow
def test_compare_fsdp2_vs_ddp(recorded_run, tmp_path):
    a, b = recorded_run("fsdp2"), recorded_run("ddp")
    out = tmp_path / "compare.html"
    # (the suite's one `compare` end to end in a process of its own; the others run in the test's process)
    p = run_fsdpprof("compare", str(a), str(b), "-o", str(out), timeout=300, fresh_process=True)
    assert p.returncode == 0, p.stderr[-3000:]
    c = json.loads((tmp_path / "compare.json").read_text())
    assert c["comparable"] and len(c["labels"]) == 2
    table = {r["metric"]: r for r in c["table"]}
    la, lb = c["labels"]
    assert table["strategy"][la] == "FULL_SHARD" and table["strategy"][lb] == "DDP"
    for metric in ("peak_allocated_bytes", "model_states_measured_bytes", "model_states_theory_bytes",
                   "traffic_theory_bytes", "exposed_comm_us", "step_us", "peak_optimizer_state_bytes"):
        assert metric in table
    # FULL_SHARD halves model states on 2 ranks (theory), and the measurement agrees
    assert table["model_states_theory_bytes"][la] * 2 == table["model_states_theory_bytes"][lb]
    assert abs(table["model_states_measured_bytes"][la] * 2 - table["model_states_measured_bytes"][lb]) < \
        0.01 * table["model_states_measured_bytes"][lb]
    # the verdict line is made of the table's numbers
    lo, hi = sorted((la, lb), key=lambda k: table["peak_allocated_bytes"][k])
    saved = table["peak_allocated_bytes"][hi] - table["peak_allocated_bytes"][lo]
    m = re.search(r"^(\S+) on \d+ ranks? saves (.+?) per rank", c["verdict"])
    assert m and m.group(1) == table["strategy"][lo], c["verdict"]
    assert m.group(2) == model.fmt_bytes(saved)
    # a time difference is stated only when the noise test passes (the recorded runs' exposed communication can go
    # either way under a loaded host): the verdict and the noise note say what the bootstrap interval of the
    # difference of medians, recomputed here from the runs' steps, says, and never disagree with each other
    test = NoiseTest.of_steps({lab: analyze_run(load_run(str(run))).steps for lab, run in zip((la, lb), (a, b))},
                              ("exposed_comm_us",))
    d = test.test(hi, lo, "exposed_comm_us")
    assert d is not None
    said = [n for n in c["noise"] if "difference in exposed communication" in n or "and in exposed communication" in n]
    de = table["exposed_comm_us"][lo] - table["exposed_comm_us"][hi]
    if d.measured:
        words = "more exposed communication" if de >= 0 else f"exposes {model.fmt_ms(-de)} less communication"
        assert f"{words} per step" in c["verdict"] and not said, (d, c["verdict"], c["noise"])
    else:
        assert "with no measured difference in exposed communication per step" in c["verdict"], (d, c["verdict"])
        assert len(said) == 1 and d.words().lstrip("+-").split(",")[0] in said[0], (d, said)
    html = out.read_text()
    assert c["verdict"].split(",")[0] in html and "verdict:" in p.stdout
    # compare.json: the roles (they add up to each run's peak), the spread of the step times, the noise said
    roles = {}
    for r in c["roles"]:
        roles[r["run"]] = roles.get(r["run"], 0.0) + r["bytes"]
    assert roles == pytest.approx({k: table["peak_allocated_bytes"][k] for k in (la, lb)})
    spread = {(r["run"], r["metric"]): r for r in c["spread"]}
    for lab in (la, lb):
        s = spread[(lab, "step_us")]
        assert s["min"] <= table["step_us"][lab] <= s["max"] and s["ranks"] == 2 and s["steps"] >= 2
    assert isinstance(c["noise"], list) and len(c["diff"]["memory_roles"]) == len(model.MEMORY_ROLES)
    assert re.search(r"memory at the peak: [+-][\d.]+ \S+ = params ", p.stdout), p.stdout


@pytest.mark.slow
def test_compare_needs_two_runs(recorded_run, tmp_path):
    p = run_fsdpprof("compare", str(recorded_run("fsdp2")), "-o", str(tmp_path / "c.html"), timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "at least two runs" in lines[0]


@pytest.mark.slow
def test_compare_different_models_refused_then_warned(recorded_run, tmp_path):
    src = recorded_run("fsdp2")
    other = tmp_path / "other-model"
    shutil.copytree(src, other, ignore=shutil.ignore_patterns("report.html", "summary.json"))
    for inv_path in other.glob("rank-*/inventory.json"):  # the same run claiming another model size
        inv = json.loads(inv_path.read_text())
        inv["totals"]["psi"] = inv["totals"]["psi"] * 2
        inv_path.write_text(json.dumps(inv))
    p = run_fsdpprof("compare", str(src), str(other), "-o", str(tmp_path / "c.html"), timeout=300)
    assert p.returncode == 2, p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not comparable" in lines[0] and "--force" in lines[0]
    p = run_fsdpprof("compare", str(src), str(other), "-o", str(tmp_path / "c.html"), "--force", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Not comparable" in (tmp_path / "c.html").read_text()
    assert not json.loads((tmp_path / "c.json").read_text())["comparable"]


# --------------------------------------------------------------------------- compare by role, one statistic, noise
def _analyses(*runs):
    return [analyze_run(load_run(str(r))) for r in runs]


@pytest.mark.slow
def test_roles_add_up_to_the_change_of_the_peak(recorded_run):
    """FULL_SHARD against DDP: DDP's whole params and grads are matched to FSDP's sharded and gathered ones by role,
    so the per-role changes add up to the peak's change (the categories alone do not line up)."""
    analyses = _analyses(recorded_run("ddp"), recorded_run("fsdp2"))
    c = compare_analyses(analyses)
    table = c.table.set_index("metric")
    ddp, fsdp = c.labels
    peak_change = table.loc["peak_allocated_bytes", fsdp] - table.loc["peak_allocated_bytes", ddp]
    roles = c.diff.memory_roles
    assert list(roles["role"]) == model.MEMORY_ROLES
    assert roles["diff_bytes"].sum() == pytest.approx(peak_change, abs=1.0)
    assert peak_change != 0
    for lab in (ddp, fsdp):                       # each run's roles add up to its peak
        col = "baseline_bytes" if lab == ddp else "run_bytes"
        assert roles[col].sum() == pytest.approx(table.loc["peak_allocated_bytes", lab], abs=1.0)
    # the roles gather the categories of each strategy: DDP's whole params, FSDP's sharded + gathered ones
    cats = c.diff.memory.set_index("category")
    r = roles.set_index("role")
    assert r.loc["params", "baseline_bytes"] == cats.loc["param", "baseline_bytes"] > 0
    assert r.loc["params", "run_bytes"] == pytest.approx(
        cats.loc["sharded_param", "run_bytes"] + cats.loc["unsharded_param", "run_bytes"])
    # the category rows alone would not add up to the peak's change when param (DDP) is one side only
    assert cats.loc["param", "run_bytes"] == 0 and cats.loc["sharded_param", "baseline_bytes"] == 0
    # the side-by-side table's roles are the diff's
    for role in model.MEMORY_ROLES:
        assert table.loc[f"role_{role}_bytes", ddp] == r.loc[role, "baseline_bytes"]
        assert table.loc[f"role_{role}_bytes", fsdp] == r.loc[role, "run_bytes"]
    # the terminal says the peak's change as the sum of the roles'
    text = diff_text(c)
    line = next(ln for ln in text.splitlines() if "memory at the peak:" in ln)
    assert line.split("memory at the peak: ")[1].startswith(("+" if peak_change > 0 else "-")
                                                           + model.fmt_bytes(abs(peak_change)) + " = params ")
    # CPU contention: rank.json's load, measured by what-if's host_load, the median over ranks
    loads = [host_load(json.loads(p.read_text())["cpu"]) for p in sorted(recorded_run("ddp").glob("rank-*/rank.json"))]
    assert all(x is not None for x in loads)
    spread = c.spread.set_index(["run", "metric"])
    got = spread.loc[(ddp, "cpu_contention")]
    assert got["value"] == pytest.approx(float(np.median([x.contention for x in loads])))
    assert got["min"] == pytest.approx(min(x.contention for x in loads)) and got["ranks"] == len(loads)


class _Cells(HTMLParser):
    """Every table of a page: its rows as lists of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables, self._row, self._cell = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._row is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


UNITS = {"B": 1.0, "KiB": 2.0 ** 10, "MiB": 2.0 ** 20, "GiB": 2.0 ** 30, "µs": 1.0, "ms": 1e3, "s": 1e6}


def _value(text: str, unit: str | None = None) -> float:
    """A shown number in bytes or µs: '12.3 MiB', '608 ms', or '608 (589–626)' in the column's unit; '<0.001'
    (below the table's last digit) is 0."""
    if text.strip().startswith("<"):
        return 0.0
    m = re.match(r"^([+-]?[\d,.]+)\s*([A-Za-zµ]+)?", text.strip())
    assert m, text
    return float(m.group(1).replace(",", "")) * UNITS[m.group(2) or unit]


def _with_units(row: list[str], head: list[str]) -> list[str]:
    """A row's cells with the unit its column's header names ("base (MiB)") written after each number."""
    out = []
    for cell, h in zip(row, head):
        m = re.search(r"\((B|KiB|MiB|GiB|µs|ms|s)\)$", h)
        out.append(f"{cell} {m.group(1)}" if m and re.match(r"^[+-]?[\d,.]+$", cell.strip()) else cell)
    return out


def _row(tables, first: str) -> list[str]:
    rows = [r for t in tables for r in t if r and r[0] == first]
    assert len(rows) == 1, (first, rows)
    return rows[0]


@pytest.mark.slow
def test_compare_page_shows_one_number_per_quantity(recorded_run):
    """SHARD_GRAD_OP against FULL_SHARD, rendered: every number the page shows twice (the side-by-side table, the
    ZeRO table, what changed) is shown equal, each table saying its scope."""
    c = compare_analyses(_analyses(recorded_run("fsdp2"), recorded_run("fsdp2-no-reshard")))
    html = render_compare(c)
    p = _Cells()
    p.feed(html)
    tables = p.tables
    base, run = c.labels
    side = next(t for t in tables if t[0][0] == "metric")
    heads = side[0]
    unit = re.search(r"\((\w+)\)", _row(tables, "peak allocated per rank (MiB)")[0] if any(
        r[0] == "peak allocated per rank (MiB)" for r in side) else "(KiB)").group(1)
    col = {lab: heads.index(lab) for lab in (base, run)}
    shown = 0

    def same(a: float, b: float, what):
        nonlocal shown
        if max(abs(a), abs(b)) < 0.01 * UNITS[unit]:       # below the table's last digit
            return
        assert a == pytest.approx(b, rel=0.02, abs=1.0), what
        shown += 1

    # memory: the side-by-side rows (one unit for the table) against "What changed" (each cell with its unit)
    by_cat = {lab: {} for lab in (base, run)}
    # (the diff tables show each column in one unit, named in its header: the cells get it back here)
    diff_rows = {r[0]: _with_units(r, t[0]) for t in tables for r in t
                 if len(r) == 4 and r[0] != "role" and r[0] != "category"}
    for r in side[1:]:
        m = re.match(r"^at the peak(?: by role)?: (.+) \((\w+)\)$", r[0])
        if not m:
            continue
        name = m.group(1)
        key = name if name in diff_rows else None
        if key is None:
            assert all(_value(r[col[lab]], m.group(2)) == 0 for lab in (base, run)), r
            continue
        for lab, i in ((base, 1), (run, 2)):
            same(_value(r[col[lab]], m.group(2)), _value(diff_rows[key][i]), (name, lab))
            by_cat[lab][name] = _value(r[col[lab]], m.group(2))
    assert {"gathered params", "sharded params", "optimizer states"} <= set(by_cat[run])
    # the peak: side by side, ZeRO's table, the roles' sum
    peak = _row(tables, f"peak allocated per rank ({unit})")
    roles_sum = next(_with_units(r, t[0]) for t in tables for r in t if r and r[0] == "peak (the roles' sum)")
    zero = {r[0]: r for t in tables for r in t if r and r[0] in (base, run)}
    for lab, i in ((base, 1), (run, 2)):
        same(_value(peak[col[lab]], unit), _value(roles_sum[i]), ("peak", lab))
        same(_value(peak[col[lab]], unit), _value(zero[lab][6], unit), ("peak, ZeRO table", lab))
    # times per step: side by side, ZeRO's table, the step decomposition of what changed
    step, exposed = _row(tables, "step time (ms)"), _row(tables, "exposed communication (ms)")
    dsteps = {r[0]: _with_units(r, t[0]) for t in tables for r in t if r and r[0] in ("step", "exposed communication")}
    for lab, i in ((base, 1), (run, 2)):
        same(_value(step[col[lab]], "ms"), _value(dsteps["step"][i]), ("step", lab))
        same(_value(exposed[col[lab]], "ms"), _value(dsteps["exposed communication"][i]), ("exposed", lab))
        same(_value(step[col[lab]], "ms"), _value(zero[lab][-1], "ms"), ("step, ZeRO table", lab))
        same(_value(exposed[col[lab]], "ms"), _value(zero[lab][-3], "ms"), ("exposed, ZeRO table", lab))
        assert re.search(r"\(\S+–\S+\)$", step[col[lab]]), step          # the spread beside the number
    assert shown >= 20, shown
    # each table says its scope: ranks and steps
    assert "the rank whose peak is highest" in html and "median over ranks" in html and "rank-steps" in html
    assert "min–max over every rank and step" in html


def _promise(rows):
    """A hand-built zero_promise frame: (run, strategy, N, peak MiB, step ms, exposed ms, baseline)."""
    out = []
    for run, strategy, n, peak, step, exposed, baseline in rows:
        out.append({"run": run, "strategy": strategy, "world_size": n, "peak_allocated_bytes": peak * 2.0 ** 20,
                    "step_us": step * 1e3, "exposed_comm_us": exposed * 1e3, "baseline": baseline,
                    "exposed_comm_pct": 100.0 * exposed / step, "peak_ratio": float("nan"),
                    "model_states_measured_ratio": float("nan"), "model_states_theory_ratio": float("nan"),
                    "model_states_measured_bytes": float("nan"), "traffic_measured_vs_ddp": float("nan"),
                    "traffic_measured_bytes": float("nan")})
    return pd.DataFrame(out)


def _spread(rows):
    """(run, metric, value, min, max) -> a Comparison.spread frame."""
    return pd.DataFrame([{"run": r, "metric": m, "value": v, "min": lo, "max": hi, "worst_rank": 0, "worst": hi,
                          "ranks": 2, "steps": 4} for r, m, v, lo, hi in rows])


def test_verdict_compares_runs_at_one_world_size():
    p = _promise([("ddp2", "DDP", 2, 63.0, 566, 126, True), ("fs4", "FULL_SHARD", 4, 43.0, 1336, 714, False),
                  ("fs2", "FULL_SHARD", 2, 51.0, 608, 169, False)])
    lines = cmp.verdict_lines(p)
    # the headline: FULL_SHARD on 2 ranks against DDP on 2 ranks, not the smaller peak on 4 ranks
    assert lines[0].startswith("FULL_SHARD on 2 ranks saves 12.0 MiB per rank at the peak compared with DDP on 2 "
                               "ranks"), lines[0]
    assert "N differs" not in lines[0]
    assert any(ln.startswith("FULL_SHARD on 4 ranks against DDP on 2 ranks") and "N differs: 4 ranks against 2"
               in ln for ln in lines)
    # no two runs at one N: the smallest peak against the largest, saying that N differs
    only = cmp.verdict_lines(p[p["run"] != "fs2"])
    assert "N differs: 4 ranks against 2" in only[0] and only[0].startswith("FULL_SHARD on 4 ranks saves")


def test_differences_inside_the_noise_and_contention_are_said():
    """The verdict states a difference only when its bootstrap interval excludes 0, and the noise note lists
    exactly the differences the verdict leaves out: the two never disagree."""
    p = _promise([("a", "DDP", 2, 63.0, 566, 126, True), ("b", "FULL_SHARD", 2, 51.0, 608, 169, False)])
    spread = _spread([("a", "step_us", 566e3, 474e3, 630e3), ("b", "step_us", 608e3, 589e3, 626e3),
                      ("a", "cpu_contention", 1.1, 1.05, 1.2), ("b", "cpu_contention", 3.0, 2.9, 3.1)])
    rng = np.random.default_rng(1)
    noisy = NoiseTest({"a": {"step_us": rng.normal(566e3, 60e3, 12), "exposed_comm_us": rng.normal(126e3, 3e3, 12)},
                       "b": {"step_us": rng.normal(608e3, 60e3, 12), "exposed_comm_us": rng.normal(169e3, 3e3, 12)}})
    lines, note = cmp.verdict_lines(p, spread, noisy), cmp.noise_lines(p, spread, noisy)
    # step time: inside the noise -> no "Fastest" claim, the note says why; exposed: +43 ms is measured
    assert lines[1].startswith("No measured difference in step time") and "Fastest" not in " ".join(lines)
    assert "exposed communication 169 ms per step (28% of its step, +43 ms)" in lines[-1]
    assert "at the cost of 43 ms more exposed communication" in lines[0]
    inside = [ln for ln in note if "not a measured change" in ln]
    assert len(inside) == 1 and "step time (566 ms against 608 ms; difference of medians" in inside[0] \
        and "exposed communication" not in inside[0]
    assert any("different CPU contention (x3.00 against x1.10" in ln for ln in note)
    # the same medians, tight samples: both differences are measured, the note is silent about them
    tight = NoiseTest({"a": {"step_us": rng.normal(566e3, 2e3, 12), "exposed_comm_us": rng.normal(126e3, 2e3, 12)},
                       "b": {"step_us": rng.normal(608e3, 2e3, 12), "exposed_comm_us": rng.normal(169e3, 2e3, 12)}})
    assert not any("not a measured change" in ln for ln in cmp.noise_lines(p, spread, tight))
    assert cmp.verdict_lines(p, spread, tight)[1].startswith("Fastest: DDP on 2 ranks")
    # exposed communication in the noise: the peak line claims no cost, the run's line says "no measured change"
    flat = NoiseTest({"a": {"step_us": rng.normal(566e3, 2e3, 12), "exposed_comm_us": rng.normal(150e3, 40e3, 12)},
                      "b": {"step_us": rng.normal(608e3, 2e3, 12), "exposed_comm_us": rng.normal(150e3, 40e3, 12)}})
    lines = cmp.verdict_lines(p, spread, flat)
    assert "with no measured difference in exposed communication" in lines[0] and "at the cost" not in lines[0]
    assert "no measured change)" in lines[-1]
    assert any("exposed communication (126 ms against 169 ms" in ln for ln in cmp.noise_lines(p, spread, flat))
    # one step x rank: nothing to test against; the verdict says so instead of claiming no difference
    single = NoiseTest({"a": {"step_us": rng.normal(566e3, 2e3, 12), "exposed_comm_us": rng.normal(126e3, 2e3, 12)},
                        "b": {"step_us": np.array([608e3]), "exposed_comm_us": np.array([169e3])}})
    lines = cmp.verdict_lines(p, spread, single)
    assert "not tested (too few steps" in lines[1] and "No measured difference" not in " ".join(lines)
    assert "not tested: too few steps)" in lines[-1] and "(exposed communication not tested" in lines[0]


def test_noise_test_is_one_answer_per_pair():
    """b against a is a against b negated (one bootstrap per pair): the verdict (the larger peak against the
    smaller) and the noise note (each run against the baseline) ask in either order and cannot disagree at the
    margin, as two bootstraps with their own resamples could."""
    rng = np.random.default_rng(2)
    t = NoiseTest({"x": {"exposed_comm_us": rng.normal(100e3, 20e3, 6)},
                   "y": {"exposed_comm_us": rng.normal(110e3, 20e3, 6)}})
    ab, ba = t.test("x", "y", "exposed_comm_us"), t.test("y", "x", "exposed_comm_us")
    assert (ba.diff_us, ba.low_us, ba.high_us) == (-ab.diff_us, -ab.high_us, -ab.low_us)
    assert (ba.median_a_us, ba.n_a) == (ab.median_b_us, ab.n_b) and ba.measured == ab.measured
    assert ab == median_difference(t.samples["x"]["exposed_comm_us"], t.samples["y"]["exposed_comm_us"],
                                   "exposed_comm_us")


def test_bootstrap_of_the_difference_of_medians():
    """Fixed seed: the same samples give the same interval; 7.7x apart is measured, two draws of one law are not."""
    rng = np.random.default_rng(3)
    slow, fast = rng.normal(952e3, 150e3, 8), rng.normal(123e3, 20e3, 8)
    slow[0] = 130e3            # one outlier makes the min-max ranges overlap: the medians still differ
    d = median_difference(fast, slow)
    assert d.measured and d.low_us > 300e3 and d == median_difference(fast, slow)
    same = median_difference(rng.normal(500e3, 50e3, 10), rng.normal(500e3, 50e3, 10))
    assert not same.measured and same.low_us < 0 < same.high_us
    assert median_difference([1.0], [2.0, 3.0]) is None       # one sample: nothing to test against


@pytest.mark.slow
def test_shard_grad_op_model_states_counted_as_held(recorded_run):
    """SHARD_GRAD_OP's measured model states count the gathered parameters it holds from forward to each unit's
    backward (at their most), with the sharded grads and optimizer state: equal to ZeRO-2's formula within 0.1 %
    (before: the parameter shards alone, "0.25x vs formula 0.44x" at N = 4), and the page says what was counted."""
    ddp, sgo = analyze_run(load_run(str(recorded_run("ddp")))), analyze_run(load_run(str(recorded_run("fsdp2-no-reshard"))))
    t = sgo.theory
    formula = t["model_states"]["total_bytes"]
    assert t["canonical_strategy"] == "ZERO2"
    assert abs(t["measured_model_states_bytes"] - formula) <= 0.001 * formula
    assert "gathered parameters at their most" in t["model_states_counted"]
    c = compare_analyses([ddp, sgo])
    table = {r: c.table.set_index("metric").loc[r] for r in ("model_states_measured_bytes", "model_states_theory_bytes")}
    la, lb = c.labels
    ratio_measured = table["model_states_measured_bytes"][lb] / table["model_states_measured_bytes"][la]
    ratio_formula = table["model_states_theory_bytes"][lb] / table["model_states_theory_bytes"][la]
    assert abs(ratio_measured - ratio_formula) <= 0.002
    assert any("gathered parameters at their most" in n and lb in n for n in c.notes)


def test_most_gathered_parameters_leave_out_fsdp2_flat_buffers():
    """Hand-built: two units' copy-outs held together (3 + 5 bytes) beside a flat all-gather output freed at its
    copy-out (8 bytes): the most held at once is 8, not 11; an FSDP1 snapshot keeps its flat parameters (11)."""
    from types import SimpleNamespace

    from fsdpprof.analyze.summary.model_states import most_alive_bytes
    up = model.MemoryCategory.UNSHARDED_PARAM.value
    allocs = pd.DataFrame({
        "bytes": [8, 3, 5, 9], "category": [up, up, up, "activation"],
        "alloc_seq": [0, 1, 2, 3], "free_seq": [2, 10, 11, 4],
        "fsdp_phase": [next(iter(model.FLAT_GATHER_PHASES)), None, None, None]})
    assert most_alive_bytes(SimpleNamespace(allocations=allocs), up) == 8.0
    flat = allocs.drop(columns="fsdp_phase").assign(fsdp_role=[model.FSDP_ROLE_ALL_GATHER_OUTPUT, None, None, None])
    assert most_alive_bytes(SimpleNamespace(allocations=flat, fsdp_family="fsdp2"), up) == 8.0
    assert most_alive_bytes(SimpleNamespace(allocations=flat, fsdp_family="fsdp1"), up) == 11.0
    assert most_alive_bytes(SimpleNamespace(allocations=None), up) is None
