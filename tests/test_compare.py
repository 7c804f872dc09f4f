"""`fsdpprof compare`: runs side by side, a verdict computed from the numbers, bad input."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import run_fsdpprof
from fsdpprof.analyze import model

pytestmark = pytest.mark.slow  # compares real torchrun/gloo recordings


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
    assert re.search(r"(more exposed communication|exposes [\d.e+-]+ ms less communication) per step", c["verdict"])
    html = out.read_text()
    assert c["verdict"].split(",")[0] in html and "verdict:" in p.stdout


def test_compare_needs_two_runs(recorded_run, tmp_path):
    p = run_fsdpprof("compare", str(recorded_run("fsdp2")), "-o", str(tmp_path / "c.html"), timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "at least two runs" in lines[0]


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
