"""`fsdpprof demo` as README's first command: records, reports, compares, prints the paths."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import run_fsdpprof

pytestmark = pytest.mark.slow  # runs `fsdpprof demo` (records the example)


def test_demo_writes_reports_and_comparison(demo_out):
    """The demo's story, measured: model states per rank falling as 1/N (DDP -> FULL_SHARD on 2 -> on 4 ranks)
    and dominating the peak, the peak falling with them, FULL_SHARD moving 1.5x DDP's bytes.
    (The session's `fsdpprof demo --strategies ddp,fsdp2,fsdp2:4`, see conftest.)"""
    out, p = demo_out
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    printed = [Path(line.strip()) for line in p.stdout.splitlines() if line.startswith("  /")]
    names = {x.name for x in printed}
    assert {"report-fsdp2.html", "report-ddp.html", "report-fsdp2-4ranks.html", "compare.html",
            "summary-fsdp2.json"} <= names
    for path in printed:
        assert path.is_file() and path.stat().st_size > 1000
    # light pages: plotly.js once for the folder, each page alone at most 1.5 MB and loading it by a relative path
    js = [x for x in out.iterdir() if x.name.startswith("plotly-") and x.name.endswith(".min.js")]
    assert len(js) == 1 and js[0] in printed and js[0].stat().st_size > 1_000_000
    pages = [x for x in printed if x.suffix == ".html"]
    for page in pages:
        html = page.read_text()
        assert page.stat().st_size <= 1.5e6, (page.name, page.stat().st_size)
        assert re.findall(r"<script[^>]*\ssrc=\"([^\"]*)\"", html) == [js[0].name], page.name
        assert not re.search(r"\* plotly\.js v\d", html), page.name            # the bundle is not in the page
    s = json.loads((out / "summary-fsdp2.json").read_text())
    assert s["overview"]["strategy"] == "FULL_SHARD" and s["theory"]["psi"] > 0
    assert (out / "run-fsdp2" / "run.json").is_file() and (out / "run-fsdp2-4ranks" / "run.json").is_file()
    c = json.loads((out / "compare.json").read_text())
    assert "saves" in c["verdict"] or "same memory" in c["verdict"]
    rows = {r["run"]: r for r in c["promise"]}
    ddp, fs2, fs4 = (rows[lab] for lab in c["labels"])
    assert (ddp["world_size"], fs2["world_size"], fs4["world_size"]) == (2, 2, 4) and ddp["baseline"]
    # model states per rank: 1/N of DDP's, formula and measurement
    for r, ratio in ((fs2, 0.5), (fs4, 0.25)):
        assert r["model_states_theory_ratio"] == pytest.approx(ratio)
        assert r["model_states_measured_ratio"] == pytest.approx(ratio, rel=0.01)
        assert r["traffic_measured_vs_ddp"] == pytest.approx(1.5, rel=0.05)   # 3(N-1)/N S against 2(N-1)/N S
    # model states dominate the peak (the demo's model is sized for it), and the peak falls with them
    # DDP's peak also holds its gradient buckets (unsharded_grad: a second copy of the gradients, 4 Psi), which are
    # outside ZeRO's model states: model states plus buckets make the peak, the buckets as large as the gradients
    sd = json.loads((out / "summary-ddp.json").read_text())
    r_peak = max(sd["memory"], key=lambda r: sd["memory"][r]["peak_allocated_bytes"])
    at_peak = {b["category"]: b["bytes"] for b in sd["memory"][r_peak]["breakdown_at_peak"]}
    assert sd["memory"][r_peak]["peak_allocated_bytes"] == pytest.approx(ddp["peak_allocated_bytes"])
    assert at_peak["unsharded_grad"] == pytest.approx(at_peak["grad"], rel=0.02), at_peak
    assert ddp["model_states_measured_bytes"] + at_peak["unsharded_grad"] > 0.9 * ddp["peak_allocated_bytes"], at_peak
    assert fs2["model_states_measured_bytes"] > 0.5 * fs2["peak_allocated_bytes"]
    assert ddp["peak_allocated_bytes"] > fs2["peak_allocated_bytes"] > fs4["peak_allocated_bytes"]
    # the verdict speaks of every run; the page shows the promise beside the measurement
    assert len(c["verdict_lines"]) == 4 and all(any(x in line for line in c["verdict_lines"])
                                                 for x in ("FULL_SHARD on 2 ranks", "FULL_SHARD on 4 ranks"))
    html = (out / "compare.html").read_text()
    assert "What ZeRO promises, and what was measured" in html and "verdict:" in p.stdout


@pytest.mark.parametrize("spec", [" , ", "fsdp2:x", "hsdp:3", "fsdp2,fsdp2:2", "fsdp2:99", "nope"])
def test_demo_bad_strategy_is_one_line(tmp_path, spec):
    p = run_fsdpprof("demo", "--out", str(tmp_path / "d"), "--strategies", spec, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--strategies" in lines[0], lines
    assert not (tmp_path / "d").exists()


def test_demo_again_into_the_same_folder_keeps_the_users_files(demo_out, tmp_path):
    """A second demo into the same --out re-records its own runs (record --force) and replaces its own
    reports; a file of the user's beside them, or inside the earlier run folder, is left alone."""
    first_demo, p = demo_out                   # the first demo: the session's, its ddp part copied here
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "demo"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    shutil.copytree(first_demo / "run-ddp", out / "run-ddp")
    for name in ("report-ddp.html", "summary-ddp.json"):
        shutil.copy2(first_demo / name, out / name)
    (out / "run-ddp" / "my-analysis.txt").write_text("keep too")
    first = (out / "summary-ddp.json").stat().st_mtime_ns
    p = run_fsdpprof("demo", "--out", str(out), "--strategies", "ddp", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / "summary-ddp.json").stat().st_mtime_ns > first
    assert json.loads((out / "summary-ddp.json").read_text())["overview"]["strategy"] == "DDP"
    assert (out / "notes.txt").read_text() == "keep"
    assert (out / "run-ddp" / "my-analysis.txt").read_text() == "keep too"
