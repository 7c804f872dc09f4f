"""The suite's own tools: ``run_fsdpprof`` in this process gives what a fresh ``python -m fsdpprof`` gives
(exit code, stdout, stderr, the files written), with the call's own folder and environment; and tests/data
holds the real data its README lists, byte for byte."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import TEST_DATA, needs_fresh_process, run_fsdpprof, shared_data

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")


def _listing(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("args", [
    ("plan", "--params", "7.5e9", "--world", "8", "--json"),        # exit 0, stdout
    ("plan", "--params", "1e400", "--world", "8"),                  # a UserError: exit 2, one line
    ("report", "/dev/null"),                                        # refused after the command's imports
    ("report", "missing-folder"),                                   # a path relative to the call's folder
    ("compare", "missing-a"),                                       # argparse-level and command-level errors
    ("whatif", "missing-run", "--world", "0"),
    ("overlap", "missing-trace"),
    ("report", "{trace}", "--max-trace-bytes", "1000"),
    ("--version",),                                                 # argparse's SystemExit(0)
    ("nosuchcommand",),                                             # argparse's error: exit 2
    ("report", "--help"),                                           # argparse's help on stdout, exit 0
    (),                                                             # the help on stderr, exit 2
])
def test_in_process_call_is_the_fresh_process(tmp_path, args):
    results = {}
    for how in ("here", "fresh"):
        cwd = tmp_path / how
        cwd.mkdir()
        shutil.copyfile(shared_data(*DLRM, "rank-0.json.gz"), cwd / "trace.json.gz")
        argv = [a.replace("{trace}", str(cwd / "trace.json.gz")) for a in args]
        p = run_fsdpprof(*argv, cwd=cwd, timeout=120, fresh_process=how == "fresh")
        results[how] = (p.returncode, p.stdout.replace(str(cwd), "CWD"), p.stderr.replace(str(cwd), "CWD"),
                        _listing(cwd))
    assert results["here"] == results["fresh"]
    code, _, err, files = results["here"]
    assert code == (0 if args[:1] == ("--version",) or "--help" in args or "--json" in args else 2)
    assert "Traceback" not in err and files == {"trace.json.gz": (tmp_path / "here" / "trace.json.gz").stat().st_size}
    if code == 2 and args:
        assert err.count("\n") == 1 and err.startswith("fsdpprof"), err


def test_in_process_report_writes_what_the_fresh_process_writes(tmp_path):
    """A report on real traces: same exit code, output lines and files (the summary's numbers equal)."""
    runs = {}
    for how in ("here", "fresh"):
        folder = tmp_path / how / "traces"
        folder.mkdir(parents=True)
        (tmp_path / how / "out").mkdir()
        for r in (0, 1):
            shutil.copyfile(shared_data(*DLRM, f"rank-{r}.json.gz"), folder / f"rank-{r}.json.gz")
        p = run_fsdpprof("report", str(folder), "-o", str(tmp_path / how / "out" / "report.html"), cwd=tmp_path / how,
                         timeout=300, fresh_process=how == "fresh")
        assert p.returncode == 0, p.stderr[-2000:]
        summary = (tmp_path / how / "out" / "summary.json").read_text().replace(str(tmp_path / how), "DIR")
        runs[how] = (p.stdout.replace(str(tmp_path / how), "DIR"), p.stderr, _listing(tmp_path / how / "out").keys(),
                     json.loads(summary))
    assert runs["here"] == runs["fresh"]
    stdout, stderr, files, summary = runs["here"]
    plotly = {f for f in files if f.startswith("plotly-") and f.endswith(".min.js")}   # (written once beside pages)
    assert len(plotly) == 1 and files - plotly == {"report.html", "summary.json"}
    assert stderr == "" and "DDP, 8 ranks; ranks analysed 2" in stdout
    assert summary["overview"]


def test_a_call_has_its_own_folder_environment_and_timeout(tmp_path, monkeypatch):
    before = (dict(os.environ), os.getcwd(), sys.stdout, sys.stderr)
    (tmp_path / "a").mkdir()
    narrow = run_fsdpprof("plan", "--help", cwd=tmp_path / "a", env={"COLUMNS": "33"})
    wide = run_fsdpprof("plan", "--help", cwd=tmp_path, env={"COLUMNS": "200"})
    assert narrow.returncode == wide.returncode == 0
    assert len(narrow.stdout.splitlines()) > len(wide.stdout.splitlines())   # argparse read COLUMNS
    code = run_fsdpprof("report", "nothing-here", cwd=tmp_path / "a")
    assert code.returncode == 2 and code.stderr.startswith("fsdpprof report: error: ") and "nothing-here" in code.stderr
    assert (dict(os.environ), os.getcwd(), sys.stdout, sys.stderr) == before
    big = shared_data("gpu-traces", "hta-16rank-a100", "rank-0.json.gz")
    with pytest.raises(subprocess.TimeoutExpired):
        run_fsdpprof("report", str(big), "-o", str(tmp_path / "r.html"), timeout=0.01)
    assert (dict(os.environ), os.getcwd(), sys.stdout, sys.stderr) == before
    after = run_fsdpprof("plan", "--params", "1e9", "--world", "2")
    assert after.returncode == 0 and after.stdout and after.stderr == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert not needs_fresh_process({"FSDPPROF_X": "1", "OMP_NUM_THREADS": "3"})
    assert needs_fresh_process({"PYTHONWARNINGS": "error"}) and needs_fresh_process({"OMP_NUM_THREADS": "4"})


def test_test_data_is_what_its_readme_lists():
    """tests/data: every file (licences and README aside) listed with its SHA-256, and nothing else."""
    listed = dict(reversed(line.split("  ", 1)) for line in
                  re.search(r"## SHA-256\n+```\n(.*?)```", (TEST_DATA / "README.md").read_text(), re.S)
                  .group(1).splitlines())
    present = {str(p.relative_to(TEST_DATA)): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted(TEST_DATA.rglob("*"))
               if p.is_file() and p.name != "README.md" and "LICENSES" not in p.parts}
    assert present == listed
    assert {p.name for p in (TEST_DATA / "LICENSES").iterdir()} == {"MIT-HolisticTraceAnalysis.txt", "Apache-2.0.txt"}
