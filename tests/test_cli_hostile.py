"""Every bad argument or path given to report / compare / plan / demo: exit code 2, exactly one line on
stderr (``fsdpprof <cmd>: error: ...``), no traceback, and nothing created or changed in the current
folder or beside the input. Then the good cases next to them: where the outputs go, that fsdpprof
replaces only its own files (or with --force), never an input, and writes both files of a pair or neither.

The real CLI (``run_fsdpprof``: in the test's process; the unreadable-path cases in a process of their own),
real profiler traces (tests/data), real recordings (``recorded_run``).
Unreadable paths: as root, the CLI runs without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (setpriv), so
that mode 000 means what it means for everyone else.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.report.plotly_bundle import plotly_js_name

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
USER_FILES = {"report.html": "<html>my own notes</html>", "summary.json": '{"mine": 1}',
              "compare.html": "my compare", "compare.json": '{"mine": 2}', "notes.txt": "keep me"}


# --- helpers -----------------------------------------------------------------------------------

def listing(*dirs: Path) -> dict:
    """Every entry under ``dirs`` (links not followed): file -> (mode, size, mtime_ns), folder -> mode."""
    out = {}
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            for name in subdirs + files:
                p = os.path.join(root, name)
                st = os.lstat(p)
                if os.path.isdir(p) and not os.path.islink(p):  # a folder: its entries are listed themselves
                    out[p] = ("dir", st.st_mode)
                else:
                    out[p] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (what every other JSON parser does)."""
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def _drop_dac() -> list[str]:
    """Command prefix that makes root obey file modes (mode 000 = unreadable), or [] when not root."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if not setpriv:
        pytest.skip("running as root without setpriv: mode 000 cannot be made unreadable here")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


def run_cli(*args: str, cwd: Path, unprivileged: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    if not unprivileged:
        return run_fsdpprof(*args, cwd=cwd, timeout=timeout)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*_drop_dac(), sys.executable, "-m", "fsdpprof", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(p: subprocess.CompletedProcess, cmd: str, *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdpprof {cmd}: error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


class Ctx:
    """A user's current folder (with files of their own) and an input folder, both watched for changes."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.cwd = tmp / "cwd"
        self.cwd.mkdir()
        for name, text in USER_FILES.items():
            (self.cwd / name).write_text(text)
        self.inp = tmp / "input"
        self.inp.mkdir()
        self.run: Path | None = None

    def trace(self, name: str = "trace.json.gz", rank: int = 0) -> Path:
        dst = self.inp / name
        shutil.copyfile(shared_data(*DLRM, f"rank-{rank}.json.gz"), dst)
        return dst

    def trace_folder(self, n: int = 2) -> Path:
        folder = self.inp / "traces"
        folder.mkdir()
        for r in range(n):
            shutil.copyfile(shared_data(*DLRM, f"rank-{r}.json.gz"), folder / f"rank-{r}.json.gz")
        return folder

    def run_dir(self, recorded_run) -> Path:
        if self.run is None:
            self.run = self.inp / "run"
            shutil.copytree(recorded_run("fsdp2"), self.run,
                            ignore=shutil.ignore_patterns("report.html", "summary.json", "*.report.html", "*.json.tmp"))
        return self.run

    def watched(self) -> dict:
        return listing(self.cwd, self.inp)


# --- the bad inputs ------------------------------------------------------------------------------
# Each case: (command, setup(ctx, recorded_run) -> argv after the command, words the error must contain,
#             run without root's file-mode override)

def _fifo(c, _):
    os.mkfifo(c.inp / "pipe")
    return [str(c.inp / "pipe")]


def _socket(c, _):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(c.inp / "sock"))
    s.close()
    return [str(c.inp / "sock")]


def _loop(c, _):
    os.symlink(c.inp / "b", c.inp / "a")
    os.symlink(c.inp / "a", c.inp / "b")
    return [str(c.inp / "a")]


def _dangling(c, _):
    os.symlink(c.inp / "gone.json.gz", c.inp / "link.json.gz")
    return [str(c.inp / "link.json.gz")]


def _unreadable_file(c, _):
    t = c.trace()
    t.chmod(0)
    return [str(t)]


def _unreadable_folder(c, _):
    f = c.trace_folder()
    f.chmod(0)
    return [str(f)]


def _unreadable_trace_in_folder(c, _):
    f = c.trace_folder(1)
    (f / "rank-0.json.gz").chmod(0)
    return [str(f)]


def _user_report_html_in_folder(c, _):
    f = c.trace_folder()
    (f / "report.html").write_text("the user's own page")
    return [str(f)]


def _user_summary_for_o(c, _):
    t = c.trace()
    (c.inp / "mine.summary.json").write_text('{"user": true}')
    return [str(t), "-o", str(c.inp / "mine.html")]


def _user_default_beside_trace(c, _):
    t = c.trace()
    (c.inp / "trace.summary.json").write_text('{"user": true}')
    return [str(t)]


def _user_file_in_cwd_when_input_readonly(c, _):
    t = c.trace()
    (c.cwd / "trace.report.html").write_text("user's")
    c.inp.chmod(0o555)
    return [str(t)]


def _o_symlink_to_user_file(c, _):
    t = c.trace()
    os.symlink(c.cwd / "notes.txt", c.inp / "r.html")
    return [str(t), "-o", str(c.inp / "r.html")]


def _o_devnull(c, _):
    return [str(c.trace()), "-o", "/dev/null", "--force"]


def _summary_devnull(c, _):
    return [str(c.trace()), "-o", str(c.inp / "r.html"), "--summary", "/dev/null", "--force"]


def _o_fifo(c, _):
    os.mkfifo(c.inp / "out.html")
    return [str(c.trace()), "-o", str(c.inp / "out.html"), "--force"]


def _same_html_and_json(c, _):
    return [str(c.trace()), "-o", str(c.inp / "r.html"), "--summary", str(c.inp / "r.html")]


def _o_is_the_trace(c, _):
    t = c.trace()
    return [str(t), "-o", str(t), "--force"]


def _summary_is_trace_in_folder(c, _):
    f = c.trace_folder()
    return [str(f), "--summary", str(f / "rank-1.json.gz"), "--force"]


def _summary_in_run(name):
    def setup(c, rr):
        run = c.run_dir(rr)
        return [str(run), "-o", str(c.inp / "r.html"), "--summary", str(run / name), "--force"]
    setup.__name__ = f"summary_is_{name.replace('/', '_')}"
    return setup


def _o_into_launchers(c, rr):
    run = c.run_dir(rr)
    return [str(run), "-o", str(run / "launchers"), "--force"]


def _summary_into_rank_folder(c, rr):
    run = c.run_dir(rr)
    return [str(run), "-o", str(c.inp / "r.html"), "--summary", str(run / "rank-0" / "s.json")]


def _newline_in_path(c, _):
    return [str(c.inp / "a\nb\tc")]


def _o_hardlink_to_run_json(c, rr):
    run = c.run_dir(rr)
    os.link(run / "run.json", c.inp / "linked.html")
    return [str(run), "-o", str(c.inp / "linked.html"), "--force"]


def _second_file_fails(c, _):
    """--summary below a regular file: the HTML must not be left behind, the error names the JSON path."""
    (c.inp / "afile").write_text("x")
    return [str(c.trace()), "-o", str(c.inp / "r.html"), "--summary", str(c.inp / "afile" / "s.json")]


def _summary_dir_unwritable(c, _):
    (c.inp / "locked").mkdir()
    (c.inp / "locked").chmod(0o555)
    return [str(c.trace()), "-o", str(c.inp / "r.html"), "--summary", str(c.inp / "locked" / "s.json")]


def _o_dir_unwritable(c, _):
    (c.inp / "locked").mkdir()
    (c.inp / "locked").chmod(0o555)
    return [str(c.trace()), "-o", str(c.inp / "locked" / "r.html")]


def _summary_through_loop(c, _):
    os.symlink(c.inp / "l2", c.inp / "l1")
    os.symlink(c.inp / "l1", c.inp / "l2")
    return [str(c.trace()), "-o", str(c.inp / "r.html"), "--summary", str(c.inp / "l1" / "s.json")]


def _workers(n):
    def setup(c, _):
        return [str(c.trace()), "--workers", n]
    setup.__name__ = f"workers_{n}"
    return setup


def _schema(file, value):
    def setup(c, rr):
        run = c.run_dir(rr)
        p = run / file
        doc = json.loads(p.read_text())
        doc["schema"] = value
        p.write_text(json.dumps(doc))
        os.utime(p, ns=(1, 1))  # a fixed mtime, so "unchanged" is checked against what we wrote
        return [str(run), "-o", str(c.inp / "r.html")]
    setup.__name__ = f"schema_{file.replace('/', '_')}_{value}"
    return setup


def _plain(*argv):
    def setup(c, _):
        return [a.replace("{inp}", str(c.inp)) for a in argv]
    setup.__name__ = "_".join(a.strip("-")[:12] or "empty" for a in argv) or "none"
    return setup


def _long_name(c, _):
    return [str(c.inp / ("x" * 300))]


def _through_file(c, _):
    return [str(c.trace()) + "/inside.json"]


def _cmp_devnull(c, _):
    return [str(c.trace_folder()), "/dev/null", "-o", str(c.inp / "c.html")]


def _cmp_fifo(c, _):
    os.mkfifo(c.inp / "pipe")
    return [str(c.trace_folder()), str(c.inp / "pipe"), "-o", str(c.inp / "c.html")]


def _cmp_o_run_json(c, rr):
    run = c.run_dir(rr)
    return [str(run), str(c.trace_folder()), "-o", str(c.inp / "c.html"), "--summary", str(run / "run.json"),
            "--force"]


def _cmp_o_trace(c, rr):
    f = c.trace_folder()
    return [str(c.run_dir(rr)), str(f), "-o", str(f / "rank-0.json.gz"), "--force"]


def _cmp_user_json(c, _):
    f = c.trace_folder()
    (c.inp / "c.json").write_text('{"user": 1}')
    return [str(f), str(f), "-o", str(c.inp / "c.html")]


def _cmp_default_in_cwd(c, _):
    f = c.trace_folder()
    return [str(f), str(f)]  # ./compare.html and ./compare.json are the user's


def _cmp_html_is_json(c, _):
    f = c.trace_folder()
    return [str(f), str(f), "-o", str(c.inp / "c.json")]


def _cmp_workers(c, _):
    f = c.trace_folder()
    return [str(f), str(f), "-o", str(c.inp / "c.html"), "--workers", "-3"]


def _cmp_newer_run(c, rr):
    run = c.run_dir(rr)
    p = run / "run.json"
    doc = json.loads(p.read_text())
    doc["schema"] = "fsdpprof.run/99"
    p.write_text(json.dumps(doc))
    return [str(run), str(c.trace_folder()), "-o", str(c.inp / "c.html")]


def _demo_out_is_file(c, _):
    return ["--out", str(c.cwd / "notes.txt")]


def _demo_user_compare(c, _):
    (c.inp / "compare.html").write_text("user's")
    return ["--out", str(c.inp)]


def _plotly_folder_beside(c, _):
    (c.inp / plotly_js_name()).mkdir()
    return [str(c.trace()), "-o", str(c.inp / "r.html"), "--force"]


def _cmp_user_plotly(c, _):
    f = c.trace_folder()
    (c.inp / plotly_js_name()).write_text("// the user's plotly build")
    return [str(f), str(f), "-o", str(c.inp / "c.html")]


def _demo_user_plotly(c, _):
    (c.inp / plotly_js_name()).write_text("// the user's plotly build")
    return ["--out", str(c.inp)]


def _demo_user_run_folder(c, _):
    (c.inp / "run-fsdp2").mkdir()
    (c.inp / "run-fsdp2" / "analysis.txt").write_text("user's own work")
    return ["--out", str(c.inp), "--strategies", "fsdp2"]


def _demo_user_summary(c, _):
    (c.inp / "summary-ddp.json").write_text("{}")
    return ["--out", str(c.inp), "--strategies", "ddp"]


CASES = [
    # report: what RUN is
    ("report", _plain("/dev/null"), ["/dev/null", "character device"], False),
    ("report", _fifo, ["named pipe"], False),
    ("report", _socket, ["socket"], False),
    ("report", _loop, ["loop of symbolic links"], False),
    ("report", _dangling, ["symbolic link", "does not exist"], False),
    ("report", _plain("{inp}/missing"), ["does not exist"], False),
    ("report", _plain(""), ["RUN is empty"], False),
    ("report", _long_name, ["File name too long"], False),
    ("report", _through_file, ["does not exist"], False),
    ("report", _unreadable_file, ["cannot be read", "permission denied"], True),
    ("report", _unreadable_folder, ["cannot be read", "permission denied"], True),
    ("report", _unreadable_trace_in_folder, ["cannot be read", "permission denied"], True),
    # report: where it would write
    ("report", _user_report_html_in_folder, ["report.html", "not written by fsdpprof", "--force"], False),
    ("report", _user_summary_for_o, ["mine.summary.json", "not written by fsdpprof"], False),
    ("report", _user_default_beside_trace, ["trace.summary.json", "not written by fsdpprof"], False),
    ("report", _user_file_in_cwd_when_input_readonly, ["cwd/trace.report.html", "not written by fsdpprof"], False),
    ("report", _o_symlink_to_user_file, ["symbolic link", "--force"], False),
    ("report", _o_devnull, ["/dev/null", "character device"], False),
    ("report", _summary_devnull, ["/dev/null", "character device"], False),
    ("report", _o_fifo, ["named pipe"], False),
    ("report", _same_html_and_json, ["same file"], False),
    ("report", _plain("{inp}", "-o", ""), ["-o", "empty"], False),
    ("report", _o_is_the_trace, ["one of the input files"], False),
    ("report", _plotly_folder_beside, ["the page's plotly.js", "a directory", "--self-contained"], False),
    ("report", _summary_is_trace_in_folder, ["one of the input files", "rank-1.json.gz"], False),
    *[("report", _summary_in_run(n), ["one of the input files", n.split("/")[-1]], False)
      for n in ("run.json", "rank-0/rank.json", "rank-0/inventory.json", "rank-0/trace.json.gz",
                "rank-1/collector.log")],
    ("report", _o_hardlink_to_run_json, ["one of the input files", "run.json"], False),
    ("report", _o_into_launchers, ["inside the run's own", "launchers"], False),
    ("report", _summary_into_rank_folder, ["inside the run's own", "rank-0"], False),
    ("report", _newline_in_path, ["a\\nb\\tc", "does not exist"], False),
    ("report", _second_file_fails, ["cannot write", "afile/s.json"], False),
    ("report", _summary_dir_unwritable, ["cannot write", "locked/s.json", "ermission denied"], True),
    ("report", _o_dir_unwritable, ["cannot write", "locked/r.html", "ermission denied"], True),
    ("report", _summary_through_loop, ["l1/s.json", "symbolic links"], False),
    ("report", _workers("0"), ["--workers: '0' is too small", "from 1 to"], False),
    ("report", _workers("-5"), ["--workers: '-5' is too small", "from 1 to"], False),
    ("report", _workers("many"), ["--workers", "'many' is not a number", "a whole number from 1 to"], False),
    ("report", _schema("run.json", "fsdpprof.run/99"), ["newer fsdpprof", "fsdpprof.run/99", "upgrade fsdpprof"], False),
    ("report", _schema("rank-0/rank.json", "fsdpprof.rank/2"), ["newer fsdpprof", "fsdpprof.rank/2"], False),
    ("report", _schema("rank-1/inventory.json", "fsdpprof.inventory/7"), ["newer fsdpprof", "inventory/7"], False),
    ("report", _schema("run.json", "fsdpprof.run/1.5"), ["does not know", "fsdpprof.run/1.5"], False),
    ("report", _plain("--no-such-flag", "x"), ["unrecognized arguments"], False),
    # compare
    ("compare", _cmp_devnull, ["/dev/null", "character device"], False),
    ("compare", _cmp_fifo, ["named pipe"], False),
    ("compare", _cmp_o_run_json, ["one of the input files", "run.json"], False),
    ("compare", _cmp_o_trace, ["one of the input files", "rank-0.json.gz"], False),
    ("compare", _cmp_user_json, ["c.json", "not written by fsdpprof"], False),
    ("compare", _cmp_default_in_cwd, ["compare.html", "not written by fsdpprof"], False),
    ("compare", _cmp_html_is_json, ["same file"], False),
    ("compare", _cmp_user_plotly, ["the page's plotly.js", "not written by fsdpprof", "--self-contained"], False),
    ("compare", _cmp_workers, ["--workers: '-3' is too small", "from 1 to"], False),
    ("compare", _cmp_newer_run, ["newer fsdpprof", "fsdpprof.run/99"], False),
    # demo: refused before anything is recorded
    ("demo", _demo_out_is_file, ["not a folder"], False),
    ("demo", _demo_user_compare, ["compare.html", "not written by fsdpprof"], False),
    ("demo", _demo_user_run_folder, ["run-fsdp2", "not an fsdpprof run"], False),
    ("demo", _demo_user_summary, ["summary-ddp.json", "not written by fsdpprof"], False),
    ("demo", _demo_user_plotly, [plotly_js_name(), "not written by fsdpprof", "--self-contained"], False),
    ("demo", _plain("--out", "{inp}/d", "--nproc", "100000"), ["--nproc", "'100000' is too large", "from 1 to 16"], False),
    ("demo", _plain("--out", "{inp}/d", "--nproc", "0"), ["--nproc: '0' is too small"], False),
    ("demo", _plain("--out", "{inp}/d", "--strategies", "fsdp2,../../etc"), ["not a strategy"], False),
    ("demo", _plain("--out", "{inp}/d", "--strategies", "ddp,ddp"), ["twice"], False),
]

PLAN_OK = ("--params", "7.5e9", "--world", "8")
PLAN_BAD = [
    # (option, value, words)
    ("--params", "1e308", ["too large", "from 1 to 1e15"]), ("--params", "1e400", ["too large"]),
    ("--params", "0", ["too small"]), ("--params=-7", "", ["too small"]), ("--params", "1e-300", ["too small"]),
    ("--params", "nan", ["not a number"]), ("--params", "inf", ["not a number"]),
    ("--params", "1e9zz", ["unknown unit"]), ("--params", "", ["not a number"]),
    ("--params", "x" * 5000, ["not a number", "..."]),
    ("--world", "0", ["too small"]), ("--world=-8", "", ["too small"]),
    ("--world", "1e308", ["too large", "ranks"]), ("--world", "8.5", ["whole number"]),
    ("--world", "nan", ["not a number"]), ("--world", "inf", ["not a number"]), ("--world", "eight", ["not a number"]),
    ("--gpu-mem", "0", ["too small"]), ("--gpu-mem=-40GB", "", ["too small"]),
    ("--gpu-mem", "1e308GB", ["too large"]), ("--gpu-mem", "nan", ["not a number"]),
    ("--gpu-mem", "inf", ["not a number"]), ("--gpu-mem", "40XB", ["unknown unit"]),
    ("--shard-group", "0", ["too small"]), ("--shard-group", "3", ["must divide"]),
    ("--shard-group", "1e300", ["too large"]), ("--shard-group", "2.5", ["whole number"]),
    ("--compression", "0", ["too small"]), ("--compression", "1e-320", ["too small", "from 1 to"]),
    ("--compression", "0.5", ["too small", "from 1 to"]), ("--compression", "nan", ["not a number"]),
    ("--compression", "inf", ["not a number"]), ("--compression", "1e400", ["too large"]),
    ("--compression", "lots", ["not a number"]), ("--compression=-2", "", ["too small"]),
    ("--param-dtype", "int3", ["unknown dtype"]), ("--param-dtype", "", ["--param-dtype is empty"]),
    ("--grad-dtype", "nan", ["unknown dtype"]), ("--state-dtype", "y" * 3000, ["unknown dtype", "..."]),
    ("--optimizer", "adamz", ["unknown optimizer"]), ("--optimizer", "", ["--optimizer is empty"]),
    ("--units", "TB", ["invalid choice"]), ("--offload", "gpu", ["invalid choice"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("cmd,setup,words,unprivileged", CASES,
                         ids=[f"{c[0]}-{c[1].__name__.strip('_')}" for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(tmp_path, recorded_run, cmd, setup, words, unprivileged):
    c = Ctx(tmp_path)
    argv = setup(c, recorded_run)
    before = c.watched()
    p = run_cli(cmd, *argv, cwd=c.cwd, unprivileged=unprivileged)
    after = c.watched()
    for d in (c.inp, *c.inp.rglob("*")):  # give folders their modes back, for pytest's clean-up
        if d.is_dir() and not d.is_symlink():
            d.chmod(0o755)
    assert_one_line_error(p, cmd, *words)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                             if before.get(k) != after.get(k)}


@pytest.mark.parametrize("opt,value,words", PLAN_BAD, ids=[f"{o}={v[:12]}" for o, v, _ in PLAN_BAD])
def test_plan_bad_option_one_line(tmp_path, opt, value, words):
    base = dict(zip(PLAN_OK[::2], PLAN_OK[1::2]))
    name = opt.split("=")[0]
    base.pop(name, None)
    argv = [a for k, v in base.items() for a in (k, v)] + ([opt] if "=" in opt else [opt, value])
    before = listing(tmp_path)
    for extra in ((), ("--json",)):
        p = run_cli("plan", *argv, *extra, cwd=tmp_path)
        assert_one_line_error(p, "plan", *words)
        assert p.stdout == ""
    assert listing(tmp_path) == before


@pytest.mark.parametrize("argv", [
    ("--params", "1e15", "--world", "1"), ("--params", "1e15", "--world", "10000000", "--gpu-mem", "1e18"),
    ("--params", "1", "--world", "1", "--compression", "1e6", "--param-dtype", "fp8", "--optimizer", "none"),
    ("--params", "7.5e9", "--world", "8", "--shard-group", "8"),
])
def test_plan_extremes_print_finite_numbers(tmp_path, argv):
    """The largest and smallest accepted values: exit 0, every number finite, --json valid JSON."""
    p = run_cli("plan", *argv, cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    low = p.stdout.lower()
    assert "inf" not in low.replace("info", "") and "nan" not in low, p.stdout
    j = run_cli("plan", *argv, "--json", cwd=tmp_path)
    assert j.returncode == 0, j.stderr
    res = strict_json(j.stdout)

    def numbers(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from numbers(v)
        elif isinstance(x, list):
            for v in x:
                yield from numbers(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            yield x
    assert all(math.isfinite(v) for v in numbers(res))
    if argv[3] == "1":  # one rank: DDP sends nothing, so "vs DDP" has no value (printed as -)
        assert all(r["traffic_vs_ddp"] is None for r in res["rows"])


# --- where outputs go, and what may be replaced ----------------------------------------------------

def test_o_names_its_own_summary_and_leaves_the_folders_summary_alone(tmp_path):
    c = Ctx(tmp_path)
    t = c.trace()
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"user": "do not touch"}')
    before = listing(out)
    p = run_cli("report", str(t), "-o", str(out / "mine.html"), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    assert (out / "summary.json").read_text() == '{"user": "do not touch"}'
    assert listing(out)[str(out / "summary.json")] == before[str(out / "summary.json")]
    s = strict_json((out / "mine.summary.json").read_text())
    assert s["schema"] == "fsdpprof.summary/2" and s["source"] == "trace_file"
    assert f"summary: {out / 'mine.summary.json'}" in p.stdout


def test_single_trace_report_goes_beside_the_input_not_the_cwd(tmp_path):
    c = Ctx(tmp_path)
    t = c.trace()
    cwd_before = listing(c.cwd)
    p = run_cli("report", str(t), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    assert listing(c.cwd) == cwd_before
    html, js = c.inp / "trace.report.html", c.inp / "trace.summary.json"
    assert '<meta name="generator" content="fsdpprof ' in html.read_text()[:400]
    assert strict_json(js.read_text())["path"] == str(t)
    # again: our own files are replaced without --force
    p = run_cli("report", str(t), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    # a read-only input folder: the same names in the current folder
    c.inp.chmod(0o555)
    try:
        p = run_cli("report", str(t), cwd=c.cwd)
    finally:
        c.inp.chmod(0o755)
    assert p.returncode == 0, p.stderr
    assert (c.cwd / "trace.report.html").is_file() and (c.cwd / "trace.summary.json").is_file()
    for name, text in USER_FILES.items():
        assert (c.cwd / name).read_text() == text


def test_snapshot_report_goes_beside_it(tmp_path):
    c = Ctx(tmp_path)
    snap = c.inp / "oom.pickle"
    shutil.copyfile(shared_data("cuda-snapshots", "lm-step-user-metadata.pickle"), snap)
    p = run_cli("report", str(snap), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    assert (c.inp / "oom.report.html").is_file() and (c.inp / "oom.summary.json").is_file()
    for name, text in USER_FILES.items():
        assert (c.cwd / name).read_text() == text


def test_force_overwrites_a_user_file_but_never_an_input(tmp_path):
    c = Ctx(tmp_path)
    f = c.trace_folder()
    (f / "report.html").write_text("user's page")
    p = run_cli("report", str(f), "--force", cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    assert "fsdpprof" in (f / "report.html").read_text()[:300]
    assert strict_json((f / "summary.json").read_text())["source"] == "trace_folder"
    # our summary.json in the folder is not taken for a trace the next time
    p = run_cli("report", str(f), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    s = strict_json((f / "summary.json").read_text())
    assert not s["missing"] and s["overview"]["ranks_present"] == [0, 1]


def test_o_folder_writes_inside_it(tmp_path):
    c = Ctx(tmp_path)
    t = c.trace()
    out = tmp_path / "reports"
    out.mkdir()
    p = run_cli("report", str(t), "-o", str(out), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in out.iterdir()) == [plotly_js_name(), "trace.report.html", "trace.summary.json"]


def test_workers_bounded_by_ranks_and_cores(monkeypatch):
    """--workers 100000 starts at most min(ranks, cores) processes (the pool is watched, not replaced)."""
    import concurrent.futures as cf

    from fsdpprof.analyze.load import run as run_mod

    asked = []

    class Watched(cf.ProcessPoolExecutor):
        def __init__(self, max_workers=None, **kw):
            asked.append(max_workers)
            super().__init__(max_workers=min(max_workers or 1, 2), **kw)  # never fork 100000, even today

    monkeypatch.setattr(cf, "ProcessPoolExecutor", Watched)     # (run.py imports the pool where it uses it)
    r = run_mod.load_run(shared_data(*DLRM), workers=100000)
    assert len(r.ranks) == 8
    assert asked and max(asked) <= min(8, os.cpu_count() or 1), asked
    with pytest.raises(run_mod.UserError):
        run_mod.load_run(shared_data(*DLRM), workers=0)


@pytest.mark.slow
def test_run_json_without_our_schema_is_ignored_with_a_warning(tmp_path, recorded_run):
    c = Ctx(tmp_path)
    run = c.run_dir(recorded_run)
    doc = json.loads((run / "run.json").read_text())
    doc.pop("schema")
    (run / "run.json").write_text(json.dumps(doc))
    p = run_cli("report", str(run), "-o", str(tmp_path / "r.html"), cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    s = strict_json((tmp_path / "r.summary.json").read_text())
    assert s["source"] == "run_dir" and any("not an fsdpprof run file" in w for w in s["warnings"])
    # an older or equal version keeps working
    doc["schema"] = "fsdpprof.run/1"
    (run / "run.json").write_text(json.dumps(doc))
    p = run_cli("report", str(run), "-o", str(tmp_path / "r.html"), cwd=c.cwd)
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_compare_json_is_strict_json(tmp_path, recorded_run):
    """A trace folder (no memory numbers) beside a run: the missing numbers are null, not NaN."""
    c = Ctx(tmp_path)
    p = run_cli("compare", str(c.run_dir(recorded_run)), str(c.trace_folder()), "-o", str(tmp_path / "c.html"),
                "--force", cwd=c.cwd)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "c.json").read_text()
    doc = strict_json(text)
    assert doc["schema"] == "fsdpprof.compare/1" and "NaN" not in text
    assert '<meta name="generator" content="fsdpprof ' in (tmp_path / "c.html").read_text()[:400]
    assert any(v is None for row in doc["table"] for v in row.values())


def test_json_bytes_turns_non_finite_into_null():
    import numpy as np
    import pandas as pd

    from fsdpprof.report.outputs import json_bytes

    obj = {"a": float("nan"), "b": [np.float64("inf"), -math.inf, 1.5], "c": pd.DataFrame({"x": [np.nan, 2.0]}),
           "d": {1: np.int64(3), "e": pd.NA}}
    assert strict_json(json_bytes(obj).decode()) == {"a": None, "b": [None, None, 1.5], "c": [{"x": None}, {"x": 2.0}],
                                                     "d": {"1": 3, "e": None}}


def test_write_files_undoes_the_first_when_the_second_rename_fails(tmp_path):
    """Both temporaries written, the second rename fails (its path is a folder): the first file is back as
    it was, no temporary is left, and the error names the second path."""
    from fsdpprof.errors import UserError
    from fsdpprof.report.outputs import write_files

    first = tmp_path / "a.html"
    first.write_text("previous report")
    (tmp_path / "b.json").mkdir()
    (tmp_path / "b.json" / "keep").write_text("x")
    before = listing(tmp_path)
    with pytest.raises(UserError, match="b.json"):
        write_files([(str(first), b"new"), (str(tmp_path / "b.json"), b"{}")])
    assert first.read_text() == "previous report"
    assert listing(tmp_path) == before
    # a new first file (nothing there before) is removed again
    with pytest.raises(UserError):
        write_files([(str(tmp_path / "new.html"), b"new"), (str(tmp_path / "b.json"), b"{}")])
    assert not (tmp_path / "new.html").exists() and listing(tmp_path) == before


def test_demo_reuses_its_own_run_folder_only(tmp_path):
    """demo never deletes a folder it did not record: a user's run-<s>/ is refused before any recording
    (test_bad_input...demo_user_run_folder); an earlier demo run is recognised by its run.json schema."""
    from fsdpprof.commands.demo import _previous_run

    ours = tmp_path / "run-ddp"
    ours.mkdir()
    (ours / "run.json").write_text(json.dumps({"schema": "fsdpprof.run/1", "status": "complete"}))
    assert _previous_run(str(ours)) is True
    assert _previous_run(str(tmp_path / "absent")) is False
    (tmp_path / "empty").mkdir()
    assert _previous_run(str(tmp_path / "empty")) is False


@pytest.mark.parametrize("argv", [
    ["report", "{missing}"], ["report", "{empty}"], ["report", "{empty}", "-o", "{empty}/a/b/report.html"],
    ["compare", "{empty}", "{missing}"], ["compare", "{empty}", "{empty}", "--iteration", "last"],
    ["whatif", "{missing}"], ["whatif", "{empty}"]], ids=lambda a: "-".join(a).replace("{", "").replace("}", ""))
def test_bad_path_refused_before_the_analysis_is_imported(tmp_path, argv):
    """A path or option that is refused before any trace is read is refused before pandas (and the analysis
    behind it, half a second of imports) is loaded."""
    (tmp_path / "empty").mkdir()
    args = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty") for a in argv]
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "fsdpprof", *args], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if not x.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith(f"fsdpprof {argv[0]}: error: "), lines
    imported = {x.split("|")[-1].strip().split(".")[0] for x in p.stderr.splitlines() if x.startswith("import time:")}
    assert "fsdpprof" in imported and not imported & {"numpy", "pandas", "torch", "plotly"}, \
        sorted(imported & {"numpy", "pandas", "torch", "plotly"})
