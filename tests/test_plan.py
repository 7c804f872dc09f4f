"""`fsdpprof plan` through the real CLI: exact ZeRO numbers, units, fits, bad input."""
import json

import pytest

from conftest import run_fsdpprof


def _plan_json(*args):
    p = run_fsdpprof("plan", *args, "--json", timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_plan_reproduces_zero_paper():
    r8 = {r["strategy"]: r for r in _plan_json("--params", "7.5e9", "--world", "8", "--gpu-mem", "40GB")["rows"]}
    assert [r8[s]["model_states_bytes"] / 1e9 for s in ("DDP", "ZERO1", "ZERO2", "ZERO3")] == [120, 41.25, 28.125, 15]
    assert [r8[s]["fits"] for s in ("DDP", "ZERO1", "ZERO2", "ZERO3")] == [False, False, True, True]
    assert r8["ZERO3"]["traffic_vs_ddp"] == pytest.approx(1.5)
    r16 = {r["strategy"]: r for r in _plan_json("--params", "7.5B", "--world", "16")["rows"]}
    assert [r16[s]["model_states_bytes"] / 1e9 for s in ("ZERO1", "ZERO2", "ZERO3")] == [35.625, 21.5625, 7.5]


def test_plan_text_says_units():
    p = run_fsdpprof("plan", "--params", "7.5e9", "--world", "8", "--gpu-mem", "40GB", timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "GB = 1e9 bytes" in out and "--units GiB" in out
    ddp_line = next(line for line in out.splitlines() if line.startswith("DDP"))
    assert "120" in ddp_line and ddp_line.rstrip().endswith("NO")
    z3 = next(line for line in out.splitlines() if line.startswith("ZeRO-3"))
    assert " 15 " in z3 and "1.5x" in z3 and z3.rstrip().endswith("yes")
    g = run_fsdpprof("plan", "--params", "7.5e9", "--world", "8", "--units", "GiB", "--shard-group", "4", timeout=120)
    assert g.returncode == 0 and "GiB = 2^30 bytes" in g.stdout and "HYBRID_SHARD" in g.stdout
    assert "111.759" in g.stdout  # 120e9 / 2**30


@pytest.mark.parametrize("args", [
    ("--params", "-1", "--world", "8"),
    ("--params", "0", "--world", "8"),
    ("--params", "lots", "--world", "8"),
    ("--params", "7.5e9", "--world", "0"),
    ("--params", "7.5e9", "--world", "eight"),
    ("--params", "7.5e9", "--world", "8", "--gpu-mem=-40GB"),
    ("--params", "7.5e9", "--world", "8", "--gpu-mem", "0GB"),
    ("--params", "7.5e9", "--world", "8", "--gpu-mem", "forty"),
    ("--params", "7.5e9", "--world", "8", "--shard-group", "3"),
    ("--params", "7.5e9", "--world", "8", "--param-dtype", "int3"),
])
def test_plan_bad_input_one_line_exit_2(args):
    p = run_fsdpprof("plan", *args, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdpprof plan: error:"), p.stderr
    assert "Traceback" not in p.stderr
