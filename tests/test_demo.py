"""`fsdpprof demo` as README's first command: records, reports, compares, prints the paths."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import run_fsdpprof


def test_demo_writes_reports_and_comparison(tmp_path):
    out = tmp_path / "demo"
    p = run_fsdpprof("demo", "--out", str(out), "--strategies", "fsdp2,ddp", timeout=600)
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
