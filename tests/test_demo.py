"""`fsdpprof demo` as README's first command: records, reports, compares, prints the paths."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import run_fsdpprof


def test_demo_writes_reports_and_comparison(demo_out):
    # the session's `fsdpprof demo --out DIR --strategies fsdp2,ddp` (conftest: its recordings are
    # recorded_run's fsdp2 and ddp ones)
    out, p = demo_out
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    printed = [Path(line.strip()) for line in p.stdout.splitlines() if line.startswith("  /")]
    names = {x.name for x in printed}
    assert {"report-fsdp2.html", "report-ddp.html", "compare.html", "summary-fsdp2.json"} <= names
    for path in printed:
        assert path.is_file() and path.stat().st_size > 1000
    s = json.loads((out / "summary-fsdp2.json").read_text())
    assert s["overview"]["strategy"] == "FULL_SHARD" and s["theory"]["psi"] > 0
    assert (out / "run-fsdp2" / "run.json").is_file()
    c = json.loads((out / "compare.json").read_text())
    assert "saves" in c["verdict"] or "same memory" in c["verdict"]


def test_demo_bad_strategy_is_one_line(tmp_path):
    p = run_fsdpprof("demo", "--out", str(tmp_path / "d"), "--strategies", " , ", timeout=120)
    assert p.returncode == 2
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1


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
