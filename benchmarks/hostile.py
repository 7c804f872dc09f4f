"""Hostile-input campaign (issue 31): every concrete case the issue lists, each a real ``fsdpprof`` subprocess.

    python benchmarks/hostile.py [--work DIR] [--only GROUP ...] [--fuzz-traces N] [--fuzz-snapshots N]
                                 [--big-blanks-mib 1024] [--keep]

Groups, one per bullet of the issue:

- ``decode``: traces whose decoding crawled (a name of 1 / 4 / 16 MiB of ``}``, 64 / 128 / 1024 MiB of blanks
  between two events, 64 / 256 MiB of zero bytes gzipped, a 256 MiB file of zero bytes, the other layouts of
  bench_decode) and garbage snapshots (3 GiB sparse, a pickle claiming a 2**62-byte frame, gzip of zeros):
  ``report`` on each, bounded in time (the case's timeout) and, for the snapshots, in memory (peak RSS < 1 GiB).
- ``record``: the example recorded into a 1 MiB tmpfs (one process, and 2 ranks under torchrun), a job that fills
  the disk leaving a little room then exits 0 or 6, a read-only ``--out`` (from the start; made read-only by the
  job, exit 6), ``2>/dev/full`` and ``2>&-`` with a job that exits 7 (a plain one and the example itself).
  The tmpfs cases are skipped, with the reason, where this machine cannot mount one.
- ``dask``: ``--scheduler`` at a local server that accepts and never speaks, one that answers 3 EiB, one that
  answers HTTP, and ``inproc://nothing``, for report / compare / overlap / whatif with ``--connect-timeout 1`` (one
  with the default timeout).
- ``force``: ``record --force`` over a run recorded before manifests existed, one whose manifest is emptied, one
  whose manifest is intact, each with the user's ``rank-0/my_notes.txt``; notes beside the run and in launchers/.
- ``outputs``: two ``report``s to one ``-o`` at once (a 3 s delay injected after the first's first rename),
  real SIGINT / SIGTERM / SIGKILL sent while ``report --tables`` really writes its ~70 files (nothing patched;
  after SIGKILL, the next write at once: the dead pid's temporaries go), stdout on /dev/full for report / overlap /
  plan / whatif.
- ``rank``: ``whatif`` and ``report`` on a 2-rank run with a truncated rank-1 trace, a missing rank-1 trace, a
  garbage rank-1 inventory.json; a run still being recorded; a run expecting 3 ranks that has 2.
- ``values``: every bad value the issue names, and for every numeric option of every command (found in the
  parsers) a value under, over, far over its range, not a number, NaN, infinite, empty, fractional.
- ``streams``: every command (report, overlap, plan, whatif, timeline, compare, demo, record, --help, --version)
  with stdout closed (``>&-``) and with stderr closed (``2>&-``): the outcome's exit code (record: the job's 7),
  no traceback; timeline / compare / --help / --version on ``>/dev/full`` (exit 1, one line).
- ``tables``: ``report --tables`` of names planted in a trace (ops, kernels), a run directory (unit names) and a
  snapshot (frames), its CSV cells counted in the column ``formula cells``; an edited CSV and a copied
  ``tables.json`` (the user's files kept), ``--tables`` into a rank folder (refused; the next ``record --force``
  works), a rank.json with NVML's 2**64-1.
- ``shell``: ``ucx://`` schedulers (one line, nothing after it), ``record`` of a missing program (127), hand-edited
  merged timelines (the bad field named), a newer timeline schema (a number), ``--connect-timeout`` without
  ``--scheduler`` (a warning).
- ``snapshot``: malformed CUDA snapshots (every segment and entry an empty dict; a segment without address and a
  malformed entry; every block size missing).
- ``damaged``: damaged inputs that must not turn into wrong numbers (issue 39): CUDA snapshots breaking the
  allocator's rules (segments of 0 bytes or overlapping, blocks of 0 bytes, outside their segment or overlapping,
  ``is_expandable`` / ``expandable_segments`` of "yes please"), each said with its count, no byte figure < 0 and
  the peak that of the snapshot with the damage deleted; rank.json process memory below the allocator's
  ("contradicts the allocator", never a negative figure); merged timelines with one rank's events deleted
  (report / overlap / compare name the rank missing, "ranks analysed" counts it out).

Every case runs as a subprocess with a timeout (talking only to 127.0.0.1) and is classified: ``ok``,
``clean error`` (one line, the documented exit code: 2 for bad input, 1 for a stdout that cannot be written,
130 / 143 for SIGINT / SIGTERM), and the failures ``traceback`` (or a crash by a signal), ``hang`` (killed at
the timeout), ``file lost`` (a user's file removed or changed: the tree is hashed before and after),
``job harmed`` (the job's exit code or stdout not passed through), ``bad input accepted`` (exit 0 on an invalid
value; also a bad rank analysed without being named), ``formula cells`` (a CSV cell a spreadsheet would run as
a formula: text starting with = + - @, tab or CR), ``other`` (anything else not as the issue asks: two lines,
another exit code, a temporary left behind, memory unbounded, a missing word).  Prints the table and the failing
cases; exit 1 when any failure column is not 0.  ``--fuzz-traces/--fuzz-snapshots`` also run benchmarks/fuzz.py's
seeded campaign and add its counts as a row.  Recordings (the packaged example, ~20 CPU-s each): 7 (one of them the `demo` of the streams group).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
import fuzz  # noqa: E402  (the seeded fuzz campaign, added as a row)
from bench_decode import hostile_json, hostile_trace  # noqa: E402  (the hostile layouts, defined once)
from fsdpprof import cli, options, runfmt  # noqa: E402
from fsdpprof.analyze.memory import safe_pickle  # noqa: E402  (never pickle.load a file: fsdpprof's restricted one)

PY = sys.executable
DATA = ROOT / "tests" / "data"
DLRM = DATA / "gpu-traces" / "param-dlrm-8rank-v100"
SNAPSHOT = next((p for p in (ROOT.parent / "shared" / "data" / "cuda-snapshots" / "lm-step-user-metadata.pickle",)
                 if p.exists()), DATA / "cuda-snapshots" / "flexgen-opt1.3b-legacy.pickle")
MIB = 1 << 20
EXAMPLE_ARGS = ["--strategy", "fsdp2", "--steps", "10"]
EXAMPLE = [PY, "-m", "fsdpprof.examples.train_fsdp", *EXAMPLE_ARGS]
EXAMPLE_2RANKS = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                  "fsdpprof.examples.train_fsdp", *EXAMPLE_ARGS]
EXAMPLE_EXIT_7 = [PY, "-c", "import sys\nfrom fsdpprof.examples.train_fsdp import main\n"
                  f"main({EXAMPLE_ARGS!r})\nsys.exit(7)"]
EXAMPLE_OUT = re.compile(r"train_fsdp: strategy=fsdp2 world=(\d) steps=10 final_loss=\S+\n")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")

COLUMNS = ("ok", "clean error", "traceback", "hang", "file lost", "job harmed", "bad input accepted", "formula cells",
           "other")
FAILURES = COLUMNS[2:]


# ------------------------------------------------------------------------------------------------ running
@dataclass
class Result:
    argv: list
    rc: int | None
    out: str
    err: str
    seconds: float
    timed_out: bool
    timeout: float
    peak_rss: int           # bytes, the top process's VmHWM (0: unknown)


class Proc:
    """A subprocess in a session of its own (killed whole at its timeout), stdout/stderr to files (or
    /dev/full, or stderr closed), its peak RSS sampled while it runs."""

    def __init__(self, argv, *, cwd, stdout="pipe", stderr="pipe", env=None):
        self.argv = [str(a) for a in argv]
        self._files = []
        kw = {}

        def sink(mode):
            if mode == "pipe":
                f = tempfile.TemporaryFile()
                self._files.append(f)
                return f
            if mode == "devfull":
                f = open("/dev/full", "wb")
                self._files.append(f)
                return f
            return None
        self.out_f, self.err_f = sink(stdout), sink(stderr)
        closed = [fd for fd, mode in ((1, stdout), (2, stderr)) if mode == "closed"]     # `>&-`, `2>&-`
        if closed:
            kw["preexec_fn"] = lambda: [os.close(fd) for fd in closed]
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(self.argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self.out_f,
                                  stderr=self.err_f, env=env or ENV, start_new_session=True, **kw)
        self.peak = 0

    def sample(self):
        try:
            with open(f"/proc/{self.p.pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            pass

    def signal(self, sig):
        try:
            os.kill(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float) -> Result:
        timed_out = False
        while self.p.poll() is None:
            self.sample()
            if time.monotonic() - self.t0 > timeout:
                timed_out = True
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait()
                break
            time.sleep(0.05)
        seconds = time.monotonic() - self.t0
        if not timed_out:          # whatever it left running in its session (a torchrun worker): not ours to keep
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

        def read(f):
            if f is None or f.name == "/dev/full":
                return ""
            f.seek(0)
            return f.read().decode("utf-8", "replace")
        out, err = read(self.out_f), read(self.err_f)
        for f in self._files:
            f.close()
        return Result(self.argv, self.p.returncode, out, err, seconds, timed_out, timeout, self.peak)


def run(argv, *, cwd, timeout=60.0, **kw) -> Result:
    return Proc(argv, cwd=cwd, **kw).finish(timeout)


def fsdpprof(*args) -> list[str]:
    return [PY, "-m", "fsdpprof", *map(str, args)]


# ------------------------------------------------------------------------------------------------ files
def tree_state(*roots) -> dict[str, str]:
    """path -> sha1 of every regular file under ``roots`` (a file root: itself), symbolic links as their target."""
    state = {}
    for root in map(str, roots):
        if os.path.islink(root) or os.path.isfile(root):
            walk = [(os.path.dirname(root), [], [os.path.basename(root)])]
        else:
            walk = os.walk(root)
        for d, _, names in walk:
            for n in names:
                p = os.path.join(d, n)
                if os.path.islink(p):
                    state[p] = "-> " + os.readlink(p)
                    continue
                h = hashlib.sha1()
                try:
                    with open(p, "rb") as fh:
                        for chunk in iter(lambda: fh.read(MIB), b""):
                            h.update(chunk)
                except OSError as exc:
                    state[p] = f"unreadable ({exc.strerror})"
                    continue
                state[p] = h.hexdigest()
    return state


def lost_files(before: dict, after: dict, allowed=()) -> list[str]:
    """Files of ``before`` gone or changed in ``after`` (``allowed``: paths that may change: fsdpprof's outputs)."""
    return [f"{p} {'removed' if p not in after else 'changed'}" for p, h in before.items()
            if p not in allowed and after.get(p) != h]


def temporaries(*dirs) -> list[str]:
    """fsdpprof's temporaries and lock files left under ``dirs``: hidden ``.*.tmp`` / ``.*.lock`` / ``.trace.*``."""
    left = []
    for d in map(str, dirs):
        for root, _, names in os.walk(d):
            left += [os.path.join(root, n) for n in names
                     if n.startswith(".") and (n.endswith((".tmp", ".lock")) or n.startswith(".trace."))]
    return left


# ------------------------------------------------------------------------------------------------ judging
@dataclass
class Case:
    group: str
    name: str
    outcome: str
    details: list = field(default_factory=list)
    command: str = ""
    seconds: float = 0.0
    said: str = ""


CASES: list[Case] = []
SKIPPED: list[tuple[str, str, str]] = []


def _said(res: Result) -> str:
    lines = [ln for ln in (res.err + res.out).splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[:400]


def judge(group: str, name: str, res: Result, *, expect: str, cmd: str | None = None, codes=(2,), words=(),
          lost=(), job=None, other=(), accepted=(), stderr_lost: bool = False, formula=()) -> Case:
    """Classify ``res``.  expect: "ok" (exit 0), "error" (a clean one-line error, exit in ``codes``), "any" (either),
    "job" (``job`` = (exit code, stdout regex or text) passed through), "job-or-error" (that, or a clean refusal
    before the job ran).  ``cmd``: the sub-command whose one line is expected ("fsdpprof CMD: ..."); ``words``: in
    that line (an error) or in the output (ok); ``lost``: files lost; ``other``: failed expectations (strings);
    ``accepted``: a bad input analysed without a word (strings); ``stderr_lost``: stderr could take no line;
    ``formula``: CSV cells written that a spreadsheet would run (strings)."""
    fails: dict[str, list[str]] = {}
    text = res.out + res.err

    def add(column: str, items) -> None:
        items = list(items)
        if items:
            fails.setdefault(column, []).extend(items)
    if res.timed_out:
        add("hang", [f"killed after {res.timeout:g} s"])
    if "Traceback (most recent call last)" in text:
        tb = [ln for ln in text.splitlines() if ln.strip()]
        add("traceback", [tb[-1][:200] if tb else "traceback"])
    elif res.rc is not None and res.rc < 0 and not res.timed_out:
        add("traceback", [f"killed by signal {-res.rc}"])
    add("file lost", lost)
    err_lines = [ln for ln in res.err.splitlines() if ln.strip()]

    def clean_error() -> list[str]:
        why = []
        if res.rc not in codes:
            why.append(f"exit {res.rc}, not {'/'.join(map(str, codes))}")
        if stderr_lost:
            return why
        if len(err_lines) != 1:
            why.append(f"{len(err_lines)} lines on stderr")
        if cmd and not (err_lines and err_lines[0].startswith(f"fsdpprof {cmd}")):
            why.append(f"not a 'fsdpprof {cmd}' line")
        line = err_lines[0] if err_lines else ""
        why += [f"no {w!r} in the line" for w in words if w not in line]
        return why

    clean = False
    if expect == "error":
        if res.rc == 0:
            add("bad input accepted", ["exit 0"])
        elif not res.timed_out:
            add("other", clean_error())
            clean = True
    elif expect in ("ok", "any"):
        if res.rc == 0:
            add("other", [f"no {w!r} in the output" for w in words if w not in text])
        elif expect == "any" and not res.timed_out:
            add("other", (w for w in clean_error() if not w.startswith("no ")))
            clean = True
        elif not res.timed_out:
            add("other", [f"exit {res.rc}: {_said(res)}"])
    elif expect in ("job", "job-or-error"):
        code, stdout = job
        refused = (expect == "job-or-error" and res.rc == 2 and res.out == "" and len(err_lines) == 1
                   and err_lines[0].startswith("fsdpprof record: error:"))
        if refused:
            clean = True
        elif not res.timed_out:
            same_out = (stdout.fullmatch(res.out) is not None) if isinstance(stdout, re.Pattern) else res.out == stdout
            if res.rc != code or not same_out:
                add("job harmed", [f"exit {res.rc} (job {code}); stdout {res.out[-120:]!r}"])
    add("bad input accepted", accepted)
    add("formula cells", formula)
    add("other", other)
    outcome = next((c for c in FAILURES if c in fails), "clean error" if clean else "ok")
    case = Case(group, name, outcome, [f"{k}: {d}" for k, v in fails.items() for d in v],
                " ".join(shell_word(a) for a in res.argv), res.seconds, _said(res))
    CASES.append(case)
    mark = "FAIL" if outcome in FAILURES else "    "
    print(f"{mark} {group:8s} {outcome:18s} {res.seconds:6.1f}s  {name}"
          + (f"  [{'; '.join(case.details)[:300]}]" if outcome in FAILURES else ""), flush=True)
    return case


def shell_word(a: str) -> str:
    a = str(a)
    if len(a) > 160:
        a = a[:150] + "...(" + str(len(a)) + " chars)"
    return a if re.fullmatch(r"[\w@%+=:,./-]+", a) else "'" + a.replace("'", "'\\''") + "'"


def skip(group: str, name: str, why: str) -> None:
    SKIPPED.append((group, name, why))
    print(f"SKIP {group:8s} {name}: {why}", flush=True)


# ------------------------------------------------------------------------------------------------ fixtures
class Fixtures:
    """The campaign's shared inputs, made once: the two base recordings, small mounts."""

    def __init__(self, work: Path):
        self.work = work
        self._runs: dict[str, Path] = {}
        self._ref_out: dict[str, str] = {}
        self.mounts: list[Path] = []
        self.recordings = 0

    def record(self, name: str, job: list[str]) -> Path:
        """A run recorded once (the packaged example); its job stdout kept as the reference."""
        if name not in self._runs:
            out = self.work / "base" / name
            self.recordings += 1
            res = run(fsdpprof("record", "--out", out, "--", *job), cwd=self.work, timeout=300)
            if res.rc != 0:
                raise SystemExit(f"hostile: the base recording {name} failed (exit {res.rc}): {res.err[-2000:]}")
            self._runs[name], self._ref_out[name] = out, res.out
        return self._runs[name]

    def run1(self) -> Path:
        return self.record("one-process", EXAMPLE)

    def run2(self) -> Path:
        return self.record("two-ranks", EXAMPLE_2RANKS)

    def copy(self, run: Path, name: str) -> Path:
        dst = self.work / "copies" / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(run, dst, symlinks=True)
        return dst

    def mount(self, name: str, size: str, read_only: bool = False) -> tuple[Path | None, str]:
        """A tmpfs of ``size`` at work/mnt/name; (None, why) where it cannot be mounted."""
        mnt = self.work / "mnt" / name
        mnt.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if read_only else "")
        try:
            p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True,
                               text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"cannot run mount ({exc})"
        if p.returncode != 0:
            return None, f"cannot mount a tmpfs here ({(p.stderr or p.stdout).strip() or p.returncode})"
        self.mounts.append(mnt)
        return mnt, ""

    def unmount_all(self) -> None:
        for mnt in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        self.mounts.clear()


def scratch(fx: Fixtures, name: str) -> Path:
    d = fx.work / "cases" / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


# ------------------------------------------------------------------------------------------------ decode
def blanks_trace_stream(path: Path, nbytes: int) -> int:
    """bench_decode's "blanks" trace with ``nbytes`` of blanks, gzipped as it is built (a GiB never in memory)."""
    a, b = hostile_json("blanks", 0), hostile_json("blanks", 1)
    i = next(k for k in range(len(a)) if a[k] != b[k])     # where the blanks go
    head, tail = a[:i], a[i:]
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    chunk = b" " * (8 * MIB)
    with open(path, "wb") as fh:
        fh.write(c.compress(head))
        left = nbytes
        while left > 0:
            fh.write(c.compress(chunk[: min(left, len(chunk))]))
            left -= len(chunk)
        fh.write(c.compress(tail))
        fh.write(c.flush())
    return len(head) + nbytes + len(tail)


def group_decode(fx: Fixtures, args) -> None:
    d = scratch(fx, "decode")
    cases = [("name", n) for n in (1, 4, 16)] + [("blanks", n) for n in (64, 128)]
    cases += [("seps", 16), ("braces", 16), ("tiny", 8), ("nesting", 2)]
    for kind, mib in cases:
        path = d / f"{kind}-{mib}MiB.json.gz"
        hostile_trace(kind, mib * MIB, path)
        before = tree_state(path)
        res = run(fsdpprof("report", path, "-o", d / f"{path.name}.html"), cwd=d, timeout=60)
        expect = "error" if kind == "nesting" else "ok"
        judge("decode", f"report: {kind} {mib} MiB ({path.stat().st_size:,} B gzipped)", res, expect=expect,
              cmd="report", words=() if expect == "ok" else ("nests",), lost=lost_files(before, tree_state(path)))
    # before the "traceEvents" key (its search was quadratic): blanks, a long value, fake keys inside a string
    events = hostile_json("blanks", 0)
    assert events.startswith(b"{")
    before_key = {"blanks before the key, 64 MiB": b"{" + b" " * (64 * MIB) + events[1:],
                  "a 16 MiB string before the key": b'{"deviceProperties": "' + b"x" * (16 * MIB) + b'", '
                  + events[1:],
                  "4 MiB of escaped fake keys in a string before it": b'{"note": "' + b'\\"traceEvents\\": [' * (
                      4 * MIB // 18) + b'", ' + events[1:]}
    for i, (label, data) in enumerate(before_key.items()):
        path = d / f"key-{i}.json.gz"
        path.write_bytes(gzip.compress(data, 1))
        res = run(fsdpprof("report", path, "-o", d / f"{path.name}.html"), cwd=d, timeout=60)
        judge("decode", f"report: {label} ({path.stat().st_size:,} B gzipped)", res, expect="ok")
    if args.big_blanks_mib:
        path = d / f"blanks-{args.big_blanks_mib}MiB.json.gz"
        blanks_trace_stream(path, args.big_blanks_mib * MIB)
        res = run(fsdpprof("report", path, "-o", d / "big.html"), cwd=d, timeout=120)
        judge("decode", f"report: blanks {args.big_blanks_mib} MiB ({path.stat().st_size:,} B gzipped)", res,
              expect="ok")
    for mib in (64, 256):                                         # head -c NM /dev/zero | gzip -1
        path = d / f"zeros-{mib}MiB.json.gz"
        hostile_trace("zeros", mib * MIB, path)
        res = run(fsdpprof("report", path, "-o", d / "z.html"), cwd=d, timeout=60)
        judge("decode", f"report: {mib} MiB of zero bytes, gzipped ({path.stat().st_size:,} B)", res, expect="error",
              cmd="report", words=(str(path),), other=_exists(d / "z.html"))
    path = d / "zeros-raw.json"                                   # not gzipped: a sparse file
    with open(path, "wb") as fh:
        fh.truncate(256 * MIB)
    res = run(fsdpprof("report", path, "-o", d / "z.html"), cwd=d, timeout=60)
    judge("decode", "report: 256 MiB of zero bytes, a plain .json", res, expect="error", cmd="report")
    # garbage snapshots: refused without being read whole (memory bounded)
    snaps = {
        "3 GiB of garbage (sparse) as .pickle": lambda p: _sparse(p, b"garbage!", 3 << 30),
        "a pickle header claiming a frame of 2**62 bytes": lambda p: p.write_bytes(
            b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"\x00" * 64),
        "a pickle claiming a bytes object of 2**62 bytes": lambda p: p.write_bytes(
            b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"\x00" * 64),
        "256 MiB of zero bytes gzipped as .pickle.gz": lambda p: p.write_bytes(gzip.compress(bytes(256 * MIB), 1)),
    }
    for i, (label, make) in enumerate(snaps.items()):
        path = d / (f"snap-{i}.pickle.gz" if "gz" in label else f"snap-{i}.pickle")
        make(path)
        res = run(fsdpprof("report", path, "-o", d / "s.html"), cwd=d, timeout=60)
        judge("decode", f"report: snapshot, {label} (peak RSS {res.peak_rss / MIB:.0f} MiB)", res, expect="error",
              cmd="report", words=(str(path),),
              other=[f"peak memory {res.peak_rss / MIB:.0f} MiB (over 1 GiB)"] if res.peak_rss > 1 << 30 else [])
        path.unlink()
    for p in d.glob("*.json*"):
        p.unlink()


def _sparse(path: Path, head: bytes, size: int) -> None:
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)


def _exists(*paths) -> list[str]:
    return [f"{p} was written" for p in paths if os.path.exists(p)]


# ------------------------------------------------------------------------------------------------ record
def _rank_disk_full(run: Path, ranks, said: str) -> list[str]:
    """What the issue asks of a rank on a full disk: status failed/partial, "disk full: <path>", said in a line."""
    why = []
    for r in ranks:
        try:
            info = json.loads((run / f"rank-{r}" / "rank.json").read_text())
        except (OSError, ValueError) as exc:
            why.append(f"rank-{r}/rank.json unreadable ({exc})")
            continue
        if info.get("status") not in ("partial", "failed"):
            why.append(f"rank {r} status {info.get('status')!r}")
        if not str(info.get("write_error", "")).startswith("disk full: "):
            why.append(f"rank {r} write_error {info.get('write_error')!r}")
        elif info["write_error"] not in said:
            why.append(f"rank {r}: no fsdpprof line says {info['write_error']!r}")
    return why


def _run_json(run: Path, code: int) -> list[str]:
    try:
        meta = json.loads((run / "run.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"run.json unreadable ({exc})"]
    why = []
    if meta.get("status") == "running":
        why.append("run.json stays 'running'")
    if meta.get("exit_code") != code:
        why.append(f"run.json exit_code {meta.get('exit_code')!r}, job {code}")
    return why


def group_record(fx: Fixtures, args) -> None:
    fx.run1()                       # (the reference stdout of the example, before anything is full)
    mnt, why = fx.mount("full-1m", "1m")
    if mnt is None:
        for n in ("example on a 1 MiB tmpfs (one process)", "example on a 1 MiB tmpfs (2 ranks, torchrun)",
                  "job fills the disk, a little room left, exit 0", "job fills the disk, exit 6",
                  "--out made read-only by the job, exit 6", "read-only --out from the start"):
            skip("record", n, why)
    else:
        for label, job, ranks in (("one process", EXAMPLE, [0]), ("2 ranks, torchrun", EXAMPLE_2RANKS, [0, 1])):
            out = mnt / ("run-" + str(len(ranks)))
            fx.recordings += 1
            res = run(fsdpprof("record", "--out", out, "--", *job), cwd=fx.work, timeout=300)
            stdout = EXAMPLE_OUT if len(ranks) > 1 else fx._ref_out["one-process"]
            judge("record", f"example on a 1 MiB tmpfs ({label})", res, expect="job", job=(0, stdout),
                  other=_rank_disk_full(out, ranks, res.err) + [f"left behind: {t}" for t in temporaries(out)])
            shutil.rmtree(out, ignore_errors=True)
        filler = mnt / "filler"
        for code, room in ((0, 4096), (6, 0)):
            out = mnt / f"fill-{code}"
            job = (f"import os, sys\nst = os.statvfs({str(mnt)!r})\n"
                   f"want = st.f_bavail * st.f_frsize - {room} if {room} else 2 << 20\n"
                   f"fd = os.open({str(filler)!r}, os.O_WRONLY | os.O_CREAT)\n"
                   f"try:\n    os.write(fd, b'x' * max(want, 0))\nexcept OSError:\n    pass\n"
                   f"print('filled')\nsys.exit({code})")
            res = run(fsdpprof("record", "--out", out, "--", PY, "-c", job), cwd=fx.work, timeout=120)
            judge("record", f"job fills the 1 MiB disk ({room} B left), exit {code}", res, expect="job",
                  job=(code, "filled\n"),
                  other=[f"left behind: {t}" for t in temporaries(out)] + _run_json(out, code))
            filler.unlink(missing_ok=True)
            shutil.rmtree(out, ignore_errors=True)
        out = mnt / "ro-later"
        job = (f"import subprocess, sys\nsubprocess.run(['mount', '-o', 'remount,ro', {str(mnt)!r}], check=True)\n"
               "print('job')\nsys.exit(6)")
        try:
            res = run(fsdpprof("record", "--out", out, "--", PY, "-c", job), cwd=fx.work, timeout=120)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True)
        lines = [ln for ln in res.err.splitlines() if ln.startswith("fsdpprof")]
        judge("record", "--out made read-only by the job, exit 6", res, expect="job", job=(6, "job\n"),
              other=[] if len(lines) == 1 and "read-only" in lines[0] else [f"fsdpprof lines: {lines}"])
        ro, why = fx.mount("read-only", "1m", read_only=True)
        if ro is None:
            skip("record", "read-only --out from the start", why)
        else:
            res = run(fsdpprof("record", "--out", ro / "run", "--", PY, "-c", "print('job'); raise SystemExit(6)"),
                      cwd=fx.work, timeout=120)
            judge("record", "read-only --out from the start, job exit 6", res, expect="job-or-error",
                  job=(6, "job\n"))
    for label, mode in (("2>/dev/full", "devfull"), ("2>&-", "closed")):
        out = scratch(fx, f"stderr-{mode}") / "run"
        res = run(fsdpprof("record", "--out", out, "--", PY, "-c", "print('hi'); raise SystemExit(7)"),
                  cwd=fx.work, stderr=mode, timeout=120)
        judge("record", f"{label}, a job that exits 7", res, expect="job", job=(7, "hi\n"), other=_run_json(out, 7))
        out = scratch(fx, f"stderr-{mode}-example") / "run"
        fx.recordings += 1
        res = run(fsdpprof("record", "--out", out, "--", *EXAMPLE_EXIT_7), cwd=fx.work, stderr=mode, timeout=300)
        judge("record", f"{label}, the example, then exit 7", res, expect="job",
              job=(7, fx._ref_out["one-process"]), other=_run_json(out, 7))


# ------------------------------------------------------------------------------------------------ dask
class Peer:
    """A TCP server on 127.0.0.1: ``silent`` (accepts, never speaks) or bytes to send, then silent."""

    def __init__(self, mode):
        self.mode, self.conns = mode, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if isinstance(self.mode, bytes):
                try:
                    conn.sendall(self.mode)
                except OSError:
                    pass
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def group_dask(fx: Fixtures, args) -> None:
    if importlib.util.find_spec("distributed") is None:
        skip("dask", "every --scheduler case", "dask.distributed is not installed")
        return
    d = scratch(fx, "dask")
    trace = DLRM / "rank-0.json.gz"
    peers = {"silent": "silent", "3 EiB": struct.pack("<Q", 3 * 2**60) + b"\x00" * 64,
             "HTTP": b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"}
    argvs = {"report": lambda: ["report", trace, "-o", d / "r.html"], "compare": lambda: ["compare", DLRM, DLRM, "-o",
             d / "c.html"], "overlap": lambda: ["overlap", trace], "whatif": lambda: ["whatif", fx.run1()]}
    for cmd, argv in argvs.items():
        for label, mode in [*peers.items(), ("inproc://nothing", None)]:
            peer = Peer(mode) if mode is not None else None
            address = peer.address if peer else label
            try:
                res = run(fsdpprof(*argv(), "--scheduler", address, "--connect-timeout", "1"), cwd=d, timeout=60)
            finally:
                if peer:
                    peer.close()
            slow = [f"took {res.seconds:.1f} s with --connect-timeout 1"] if res.seconds > 30 else []
            judge("dask", f"{cmd} --scheduler {label} --connect-timeout 1", res, expect="error", cmd=cmd,
                  words=(address,), other=slow + _exists(d / "r.html", d / "c.html"))
    peer = Peer("silent")
    try:
        res = run(fsdpprof("report", trace, "-o", d / "r.html", "--scheduler", peer.address), cwd=d, timeout=90)
    finally:
        peer.close()
    judge("dask", "report --scheduler silent, the default --connect-timeout", res, expect="error", cmd="report",
          words=(peer.address,), other=[f"took {res.seconds:.1f} s"] if res.seconds > 60 else [])


# ------------------------------------------------------------------------------------------------ force
def group_force(fx: Fixtures, args) -> None:
    base = fx.run1()
    job = [PY, "-c", "print('job')"]

    def case(name, prepare, notes_rel, expect):
        run_dir = fx.copy(base, "force-" + re.sub(r"\W+", "-", name))
        prepare(run_dir)
        notes = run_dir / notes_rel
        notes.parent.mkdir(parents=True, exist_ok=True)
        notes.write_text("my notes: do not lose\n")
        before = tree_state(notes)
        res = run(fsdpprof("record", "--force", "--out", run_dir, "--", *job), cwd=fx.work, timeout=120)
        judge("force", name, res, expect=expect, cmd="record", job=(0, "job\n"),
              lost=lost_files(before, tree_state(notes) if notes.exists() else {}))

    def legacy(run_dir):       # recorded before manifest.json existed (nor the launchers' file lists)
        for m in run_dir.glob("rank-*/manifest.json"):
            m.unlink()
        for f in (run_dir / "launchers").glob("*.json"):
            doc = json.loads(f.read_text())
            doc.pop("files", None)
            f.write_text(json.dumps(doc))

    def emptied(run_dir):
        (run_dir / "rank-0" / "manifest.json").write_text("")

    def not_json(run_dir):
        (run_dir / "rank-0" / "manifest.json").write_text("{\"schema\": \"fsdpprof.manifest/1\", \"files\": [")

    def other_schema(run_dir):
        (run_dir / "rank-0" / "manifest.json").write_text(json.dumps({"files": ["my_notes.txt"]}))

    case("legacy run (no manifest.json), rank-0/my_notes.txt", legacy, "rank-0/my_notes.txt", "job-or-error")
    case("emptied rank-0/manifest.json, rank-0/my_notes.txt", emptied, "rank-0/my_notes.txt", "error")
    case("rank-0/manifest.json not JSON, rank-0/my_notes.txt", not_json, "rank-0/my_notes.txt", "error")
    case("manifest.json without fsdpprof's schema listing my_notes.txt", other_schema, "rank-0/my_notes.txt",
         "job-or-error")
    case("intact manifest, rank-0/my_notes.txt", lambda r: None, "rank-0/my_notes.txt", "error")
    case("my_notes.txt beside run.json", lambda r: None, "my_notes.txt", "job-or-error")
    case("launchers/my_notes.txt", lambda r: None, "launchers/my_notes.txt", "job-or-error")
    case("a rank-5/ folder of the user's (no rank.json)", lambda r: None, "rank-5/my_notes.txt", "job-or-error")


# ------------------------------------------------------------------------------------------------ outputs
_SLOW_RENAME = """
import os, sys, time
from fsdpprof import cli
real_replace = os.replace
def replace_then_wait(src, dst, *a, **k):      # (the issue's injected delay: 3 s after the first rename)
    real_replace(src, dst, *a, **k)
    if not os.path.exists({mark!r}):
        open({mark!r}, "w").close()
        time.sleep(3)
os.replace = replace_then_wait
sys.exit(cli.main({argv!r}))
"""


def _wait_for(path: Path, proc: Proc, limit: float = 120) -> bool:
    t0 = time.monotonic()
    while not path.exists() and proc.p.poll() is None and time.monotonic() - t0 < limit:
        proc.sample()
        time.sleep(0.05)
    return path.exists()


def _signal_during_write(trace: Path, top: Path, sig, tries: int = 4) -> tuple[Result, bool]:
    """``report TRACE -o TOP/deeper/r.html --tables TOP/tables`` (some 70 files, each written and fsync'ed), sent
    ``sig`` as soon as one of its temporaries exists: a real signal in the real write (nothing patched).  (the
    result, whether a temporary was there when the signal went)."""
    res, caught = None, False
    for _ in range(tries):
        shutil.rmtree(top, ignore_errors=True)
        p = Proc(fsdpprof("report", trace, "-o", top / "deeper" / "r.html", "--tables", top / "tables"),
                 cwd=top.parent)
        while p.p.poll() is None and time.monotonic() - p.t0 < 120:
            try:
                names = [n for sub in (top / "deeper", top / "tables") if sub.is_dir() for n in os.listdir(sub)]
            except OSError:
                names = []
            if any(n.endswith(".tmp") for n in names):
                p.signal(sig)
                caught = True
                break
            time.sleep(0.002)
        res = p.finish(60)
        if caught:
            break
    return res, caught


def group_outputs(fx: Fixtures, args) -> None:
    d = scratch(fx, "outputs")
    (d / "in-a").mkdir()
    (d / "in-b").mkdir()
    a, b = d / "in-a" / "rank-0.json.gz", d / "in-b" / "rank-1.json.gz"
    shutil.copy(DLRM / "rank-0.json.gz", a)
    shutil.copy(DLRM / "rank-1.json.gz", b)
    inputs = tree_state(d / "in-a", d / "in-b")
    out = d / "out" / "r.html"
    out.parent.mkdir()
    mark = d / "a-renamed"
    pa = Proc([PY, "-c", _SLOW_RENAME.format(mark=str(mark), argv=["report", str(a), "-o", str(out)])], cwd=d)
    if not _wait_for(mark, pa):
        res = pa.finish(60)
        judge("outputs", "two reports to one -o at once", res, expect="ok", other=["A never renamed its first file"])
    else:
        rb = run(fsdpprof("report", b, "-o", out), cwd=d, timeout=120)
        ra = pa.finish(120)
        html, js = out.read_text(errors="replace"), json.loads(out.with_name("r.summary.json").read_text())
        html_run = [str(p) for p in (a, b) if str(p) in html]
        pair = [] if html_run == [js.get("path")] else [f"HTML of {html_run}, summary.json of {js.get('path')}"]
        judge("outputs", "two reports to one -o at once (A slowed 3 s after its first rename)", ra, expect="ok",
              other=pair + [f"left behind: {t}" for t in temporaries(d / "out")] + (
                  [f"B exit {rb.rc}: {_said(rb)}"] if rb.rc != 0 else []),
              lost=lost_files(inputs, tree_state(d / "in-a", d / "in-b")))
    for sig, code, word in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
        top = d / f"sig-{sig.name}"
        res, caught = _signal_during_write(a, top, sig)
        left = temporaries(top) + [str(x) for x in top.rglob("*")] if top.exists() else []
        judge("outputs", f"{sig.name} (a real signal) during the real write of report --tables", res,
              expect="error", cmd="report", codes=(code,), words=(word,),
              other=([] if caught else ["not caught during the write"]) + [f"left behind: {x}" for x in left],
              lost=lost_files(inputs, tree_state(d / "in-a", d / "in-b")))
    top = d / "sig-KILL"
    _, caught = _signal_during_write(a, top, signal.SIGKILL)
    stale = temporaries(top)
    res = run(fsdpprof("report", a, "-o", top / "deeper" / "r.html", "--tables", top / "tables"), cwd=d, timeout=120)
    judge("outputs", f"SIGKILL during the real write ({len(stale)} temporaries/locks left), the next write at once",
          res, expect="ok", other=[f"left behind: {t}" for t in temporaries(top)] + (
              [] if stale else ["nothing was left"]) + ([] if caught else ["not caught during the write"]))
    run1 = fx.run1()
    for label, argv in (("report", ["report", a, "-o", d / "full" / "r.html"]), ("overlap", ["overlap", a]),
                        ("overlap --json", ["overlap", a, "--json"]), ("plan", ["plan", "--params", "7B", "--world",
                                                                                  "8"]),
                        ("plan --json", ["plan", "--params", "7B", "--world", "8", "--json"]),
                        ("whatif", ["whatif", run1]), ("whatif --json", ["whatif", run1, "--json"])):
        before = tree_state(run1)
        res = run(fsdpprof(*argv), cwd=d, stdout="devfull", timeout=120)
        judge("outputs", f"{label} >/dev/full", res, expect="error", cmd=argv[0], codes=(1,),
              words=("cannot write to standard output",), lost=lost_files(before, tree_state(run1)))
    res = run(fsdpprof("report", d / "no-such-run"), cwd=d, stderr="devfull", timeout=60)
    judge("outputs", "report of a missing path 2>/dev/full", res, expect="error", stderr_lost=True)


# ------------------------------------------------------------------------------------------------ bad rank
def group_rank(fx: Fixtures, args) -> None:
    base = fx.run2()

    def trunc(r):
        p = r / "rank-1" / "trace.json.gz"
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])

    def missing(r):
        (r / "rank-1" / "trace.json.gz").unlink()

    def garbage_inventory(r):
        (r / "rank-1" / "inventory.json").write_text('{"garbage": [1, 2')

    for label, make, reason in (("truncated rank-1 trace", trunc, "truncated"),
                                ("missing rank-1 trace", missing, "no trace"),
                                ("garbage rank-1 inventory.json", garbage_inventory, "inventory")):
        r = fx.copy(base, "rank-" + re.sub(r"\W+", "-", label))
        make(r)
        for cmd in ("whatif", "report"):
            before = tree_state(r)
            res = run(fsdpprof(cmd, r), cwd=fx.work, timeout=180)
            named = [ln for ln in res.out.splitlines() if "rank-1" in ln and reason in ln]
            acc = [] if named else [f"rank-1 not named with its reason ({reason!r})"]
            other = []
            if cmd == "report":
                m = re.search(r"ranks analysed (\d+)", res.out)
                partial = "PARTIAL: missing rank-1" in res.out
                if m and partial and m.group(1) != "1":
                    other.append(f"'ranks analysed {m.group(1)}' beside 'PARTIAL: missing rank-1'")
            if cmd == "whatif" and reason == "inventory" and "no inventory.json" in res.out:
                other.append("a garbage inventory.json said as 'no inventory.json'")
            judge("rank", f"{cmd}: {label}", res, expect="ok", accepted=acc, other=other,
                  lost=lost_files(before, tree_state(r), allowed={str(r / "report.html"), str(r / "summary.json")}))
    # still being recorded: run.json running, a live launcher (this process), rank-1 not there yet
    r = fx.copy(base, "rank-still-recording")
    shutil.rmtree(r / "rank-1")
    meta = json.loads((r / "run.json").read_text())
    meta.update(status="running", exit_code=None, ended_at=None)
    (r / "run.json").write_text(json.dumps(meta))
    for f in (r / "launchers").glob("*.json"):
        doc = json.loads(f.read_text())
        doc.update(pid=os.getpid(), pid_start=runfmt.process_start_ticks(os.getpid()), host=socket.gethostname(),
                   exit_code=None, ended_at=None)
        f.write_text(json.dumps(doc))
    for cmd in ("report", "whatif"):
        res = run(fsdpprof(cmd, r), cwd=fx.work, timeout=180)
        other = ["called 'did not record or died early'"] if "died early" in res.out else []
        judge("rank", f"{cmd}: a run still being recorded (rank-1 not saved yet)", res, expect="any",
              words=("still being recorded",), accepted=[] if "rank-1" in res.out + res.err else ["rank-1 not named"],
              other=other + ([] if "still being recorded" in res.out + res.err
                             else ["not said 'still being recorded'"]))
    # three ranks expected, two there
    r = fx.copy(base, "rank-three-expected")
    meta = json.loads((r / "run.json").read_text())
    meta["ranks_expected"] = 3
    (r / "run.json").write_text(json.dumps(meta))
    for cmd in ("report", "whatif"):
        res = run(fsdpprof(cmd, r), cwd=fx.work, timeout=180)
        other = ["'rank-2: rank-2:'"] if "rank-2: rank-2:" in res.out else []
        m = re.search(r"ranks analysed (\d+)", res.out)
        if m and m.group(1) != "2":
            other.append(f"'ranks analysed {m.group(1)}' of 2 present")
        judge("rank", f"{cmd}: 3 ranks expected, rank-2 absent", res, expect="ok", other=other,
              accepted=[] if "rank-2" in res.out else ["rank-2 not named"])


# ------------------------------------------------------------------------------------------------ values
def _bad_values(n) -> list[str]:
    """Values out of ``n``'s range (an options.Number), or not numbers."""
    vals = ["abc", "", "nan", "inf", "-inf", "1e400", "99999999999999999999999", "-1"]
    small = n.lo - 1 if n.whole or n.lo == 0 else n.lo / 2
    large = n.hi * 10 if n.whole else n.hi * 1.5
    vals += [repr(small), repr(large)]
    if n.whole and n.lo <= 2.5 <= n.hi:
        vals.append("2.5")
    if n.units:
        vals.append("3parsecs")
    return [v for v in dict.fromkeys(vals) if not _in_range(n, v)]


def _in_range(n, v) -> bool:
    try:
        n.check(v)
        return True
    except ValueError:
        return False


def group_values(fx: Fixtures, args) -> None:
    d = scratch(fx, "values")
    trace = DLRM / "rank-0.json.gz"
    run1 = fx.run1()
    job = ["--", PY, "-c", "print('JOB RAN')"]
    base = {"record": lambda: ["record", "--out", d / "rec"], "report": lambda: ["report", trace, "-o",
            d / "r.html"], "compare": lambda: ["compare", DLRM, DLRM, "-o", d / "c.html"],
            "overlap": lambda: ["overlap", trace], "plan": lambda: ["plan", "--params", "7B", "--world", "8"],
            "whatif": lambda: ["whatif", run1], "demo": lambda: ["demo", "--out", d / "demo"],
            "timeline": lambda: ["timeline", DLRM, "-o", d / "t.json.gz"]}
    tail = {"record": job}
    named = [("record", ["--warmup-steps", "99999999999999999999999"]), ("record", ["--ranks", ""]),
             ("plan", ["--params", "1e-300"]), ("report", ["--max-trace-bytes", "-1"]),
             ("overlap", ["--max-trace-bytes", "-1"])]
    cases = [(c, a, "the issue's") for c, a in named]
    for cmd, sub in cli.build_parser().commands.items():
        for action in sub._actions:
            opt = action.option_strings[-1] if action.option_strings else None
            if opt is None:
                continue
            if isinstance(action.type, options.Number):
                cases += [(cmd, [opt, v], "range") for v in _bad_values(action.type)]
            elif action.type is options.ranks_list:
                cases += [(cmd, [opt, v], "range") for v in ("", ",", "0,,1", "-1", "10000000", "x", "0-3", "1.5")]
            elif action.type is getattr(options, "steps_list", None):
                cases += [(cmd, [opt, v], "range") for v in ("", ",", "2,,3", "-1", "1e13", "x", "2-3", "1.5")]
            elif action.type is options.reshard_after_forward:
                cases += [(cmd, [opt, v], "range") for v in ("maybe", "1e8", "2.5", "-1", "nan", "")]
    cases += [("compare", ["--iteration", v], "range") for v in ("-1", "1e13", "2.5", "last", "nan", "")]
    cases += [("demo", ["--strategies", v], "range") for v in ("fsdp2:0", "fsdp2:17", "fsdp2:x", "fsdp2:-1", "")]
    cases += [("whatif", ["--world", "1", "--strategy", "HYBRID_SHARD", "--shard-group", "3"], "combination")]
    seen = set()
    for cmd, opts, why in cases:
        key = (cmd, tuple(opts))
        if key in seen:
            continue
        seen.add(key)
        for p in (d / "rec", d / "demo"):
            shutil.rmtree(p, ignore_errors=True)
        res = run(fsdpprof(*base[cmd](), *opts, *tail.get(cmd, [])), cwd=d, timeout=60)
        ran = ["the job ran"] if "JOB RAN" in res.out else []
        judge("values", f"{cmd} {' '.join(shell_word(o) for o in opts)} ({why})", res, expect="error", cmd=cmd,
              words=(opts[0],) if why != "combination" else (), accepted=ran if res.rc == 0 else [],
              other=ran if res.rc != 0 else [])


# ------------------------------------------------------------------------------------------------ snapshots
def _load_real_snapshot():
    return safe_pickle.load_sized(str(SNAPSHOT), max_bytes=1 << 30)[0]


def _frames():
    return [{"filename": "train.py", "line": 1, "name": "step"}]


def _hand_snapshot():
    seg = {"device": 0, "address": 0x1000, "total_size": 4096, "allocated_size": 1536, "active_size": 1536,
           "stream": 0, "is_expandable": False,
           "blocks": [{"state": "active_allocated", "address": 0x1200, "size": 1024, "frames": _frames()}]}
    entries = [{"action": a, "addr": addr, "size": s, "stream": 0, "time_us": t, "frames": _frames()}
               for a, addr, s, t in (("alloc", 0x1000, 512, 1.0), ("alloc", 0x1200, 1024, 2.0),
                                     ("free_requested", 0x1000, 512, 3.0), ("free_completed", 0x1000, 512, 3.5))]
    return {"segments": [seg], "device_traces": [entries], "allocator_settings": {}}


def _peak(summary_path: Path):
    try:
        s = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None
    mem = s.get("memory") or {}
    peaks = [v.get("peak_allocated_bytes") for v in (mem.values() if isinstance(mem, dict) else mem)
             if isinstance(v, dict)]
    return max((p for p in peaks if isinstance(p, (int, float))), default=None)


def group_snapshot(fx: Fixtures, args) -> None:
    d = scratch(fx, "snapshot")
    real = _load_real_snapshot()
    hand = _hand_snapshot()
    no_address = {k: v for k, v in hand["segments"][0].items() if k != "address"}

    def emptied(s):
        return dict(s, segments=[{} for _ in s["segments"]],
                    device_traces=[[{} for _ in t] for t in s["device_traces"]])

    bad = {"real snapshot, every segment and entry an empty dict": emptied(real),
           "hand-built, every segment and entry an empty dict": emptied(hand),
           "one segment without address, one malformed entry": {"segments": [no_address],
                                                                "device_traces": [[{"action": "alloc", "size": -3}]]},
           "segments not a list": {"segments": {"a": 1}, "device_traces": []},
           "not a snapshot (a list)": [1, 2, 3]}
    for label, content in bad.items():
        path = d / "broken.pickle"
        path.write_bytes(pickle.dumps(content, protocol=4))
        res = run(fsdpprof("report", path, "-o", d / "b.html"), cwd=d, timeout=120)
        judge("snapshot", f"report: {label}", res, expect="error", cmd="report", words=(str(path),),
              other=(["said 'peak 0 B'"] if "peak 0 B" in res.out else [])
              + (["advised expandable_segments"] if "expandable_segments" in res.out else []) + _exists(d / "b.html"))
    whole, sizeless = d / "whole.pickle", d / "no-sizes.pickle"
    whole.write_bytes(pickle.dumps(real, protocol=4))
    cut = dict(real, segments=[dict(seg, blocks=[{k: v for k, v in b.items() if k != "size"} for b in seg["blocks"]])
                               for seg in real["segments"]])
    sizeless.write_bytes(pickle.dumps(cut, protocol=4))
    ra = run(fsdpprof("report", whole, "-o", d / "whole.html"), cwd=d, timeout=180)
    rb = run(fsdpprof("report", sizeless, "-o", d / "cut.html"), cwd=d, timeout=180)
    pa, pb = _peak(d / "whole.summary.json"), _peak(d / "cut.summary.json")
    warned = "have no size" in rb.out or "have no size" in (d / "cut.summary.json").read_text(errors="replace") \
        if (d / "cut.summary.json").exists() else False
    judge("snapshot", f"report: every block size missing ({SNAPSHOT.name})", rb, expect="ok",
          accepted=[] if warned else ["no warning that the block sizes are missing"],
          other=([] if pa == pb and pa is not None else [f"peak {pb} B, with the sizes {pa} B"])
          + ([f"the intact snapshot: exit {ra.rc}"] if ra.rc != 0 else []))


# ------------------------------------------------------------------------------------------------ streams
def group_streams(fx: Fixtures, args) -> None:
    d = scratch(fx, "streams")
    trace = DLRM / "rank-0.json.gz"
    run1 = fx.run1()
    cmds = {"report": lambda o: ["report", trace, "-o", o / "r.html", "--tables", o / "tables"],
            "overlap": lambda o: ["overlap", trace], "plan": lambda o: ["plan", "--params", "7B", "--world", "8"],
            "plan --json": lambda o: ["plan", "--params", "7B", "--world", "8", "--json"],
            "whatif": lambda o: ["whatif", run1], "timeline": lambda o: ["timeline", DLRM, "-o", o / "t.json.gz"],
            "compare": lambda o: ["compare", DLRM, trace, "-o", o / "c.html"],
            "demo": lambda o: ["demo", "--out", o / "demo", "--strategies", "fsdp2:1"],
            "--help": lambda o: ["--help"], "--version": lambda o: ["--version"],
            "report of a missing path": lambda o: ["report", o / "no-such-run"]}
    leaves = {"report": ["r.html", "r.summary.json", "tables/tables.json"], "timeline": ["t.json.gz"],
              "compare": ["c.html"], "demo": ["demo/report-*.html", "demo/summary-*.json"]}
    for label, stdout, stderr in ((">&-", "closed", "pipe"), ("2>&-", "pipe", "closed")):
        for name, argv in cmds.items():
            if name == "demo" and label == "2>&-":
                continue                                # (one demo: 2 recordings' worth of time)
            o = scratch(fx, f"streams-{stdout}-{re.sub(r'[^a-z]+', '-', name)}")
            before = tree_state(run1)
            if name == "demo":
                fx.recordings += 1
            res = run(fsdpprof(*argv(o)), cwd=o, stdout=stdout, stderr=stderr, timeout=600 if name == "demo" else 180)
            missing = [f"{f} not written" for f in leaves.get(name, []) if not list(o.glob(f))]
            bad = name == "report of a missing path"
            judge("streams", f"{name} {label}", res, expect="error" if bad else "ok", cmd=name.split()[0],
                  stderr_lost=stderr == "closed", other=missing + (["said something after the line"]
                                                                   if "Exception ignored" in res.err else []),
                  lost=lost_files(before, tree_state(run1)))
        out = scratch(fx, f"streams-record-{stdout}") / "run"
        res = run(fsdpprof("record", "--out", out, "--", PY, "-c", "import sys; print('hi'); sys.exit(7)"),
                  cwd=fx.work, stdout=stdout, stderr=stderr, timeout=120)
        judge("streams", f"record {label}, a job that exits 7", res, expect="job",
              job=(7, "" if stdout == "closed" else "hi\n"), other=_run_json(out, 7))
    out = scratch(fx, "streams-record-both") / "run"
    res = run(fsdpprof("record", "--out", out, "--", PY, "-c", "import sys; print('hi'); sys.exit(7)"),
              cwd=fx.work, stdout="closed", stderr="closed", timeout=120)
    judge("streams", "record >&- 2>&-, a job that exits 7", res, expect="job", job=(7, ""), other=_run_json(out, 7))
    for name in ("timeline", "compare", "--help", "--version"):
        o = scratch(fx, f"streams-full-{name.strip('-')}")
        res = run(fsdpprof(*cmds[name](o)), cwd=o, stdout="devfull", timeout=180)
        judge("streams", f"{name} >/dev/full", res, expect="error", codes=(1,),
              words=("cannot write to standard output",))


# ------------------------------------------------------------------------------------------------ tables
PAYLOADS = ['=HYPERLINK("http://example.invalid/x","click")', "=cmd|' /C calc'!A0", "+1+cmd|' /C calc'!A0",
            "-2+3+cmd|' /C calc'!A0", "@SUM(1+1)*cmd|' /C calc'!A0", "\t=1+1", "\r=1+1"]
_KEEP_NAMES = re.compile(r"nccl|c10d|ProfilerStep|record_param_comms|all_gather|reduce_scatter|all_reduce", re.I)


def csv_cells(folder: Path) -> list[tuple[str, str]]:
    """(file, cell) of every cell, headers included, of every CSV under ``folder``."""
    out = []
    for p in sorted(Path(folder).rglob("*.csv")):
        with open(p, newline="", encoding="utf-8", errors="replace") as fh:
            out += [(p.name, c) for row in csv.reader(fh) for c in row]
    return out


def formula_cells(folder: Path) -> list[str]:
    """The cells a spreadsheet would run as a formula: text starting with = + - @, tab or CR, not a number."""
    def number(c):
        try:
            float(c)
            return True
        except ValueError:
            return False
    return [f"{f}: {c[:40]!r}" for f, c in csv_cells(folder) if c[:1] in ("=", "+", "-", "@", "\t", "\r")
            and not number(c)]


def _neutralised(folder: Path) -> int:
    return sum(1 for _, c in csv_cells(folder) if c.startswith("'") and c[1:].startswith(tuple(PAYLOADS)))


def _plant_frames(obj, k=None):
    """Every stack frame of a snapshot (a dict with filename and name) renamed to the payloads; returns how many."""
    k = k if k is not None else [0]
    if isinstance(obj, dict):
        if isinstance(obj.get("filename"), str) and "name" in obj:
            obj["name"], obj["filename"] = PAYLOADS[k[0] % len(PAYLOADS)], PAYLOADS[(k[0] + 1) % len(PAYLOADS)]
            k[0] += 1
        for v in obj.values():
            _plant_frames(v, k)
    elif isinstance(obj, list):
        for v in obj:
            _plant_frames(v, k)
    return k[0]


def group_tables(fx: Fixtures, args) -> None:
    d = scratch(fx, "tables")
    # planted names: a trace (op and kernel names), a snapshot (frames), a run directory (unit layers.0)
    doc = json.loads(gzip.decompress((DLRM / "rank-0.json.gz").read_bytes()))
    k = 0
    for e in doc["traceEvents"]:
        if isinstance(e, dict) and e.get("cat") in ("cpu_op", "kernel") and not _KEEP_NAMES.search(str(e.get("name"))):
            e["name"] = PAYLOADS[k % len(PAYLOADS)] + f" #{k % 3}"
            k += 1
    planted_trace = d / "planted-trace" / "rank-0.json.gz"
    planted_trace.parent.mkdir()
    planted_trace.write_bytes(gzip.compress(json.dumps(doc).encode()))
    snap = _load_real_snapshot()
    frames = _plant_frames(snap)
    planted_snap = d / "planted-snapshot.pickle"
    planted_snap.write_bytes(pickle.dumps(snap, protocol=4))
    planted_run = fx.copy(fx.run1(), "tables-planted-run")
    for p in list(planted_run.glob("rank-*/trace.json.gz")) + list(planted_run.glob("rank-*/inventory.json")):
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        raw = raw.replace(b"layers.0", PAYLOADS[1].encode())
        p.write_bytes(gzip.compress(raw) if p.suffix == ".gz" else raw)
    for label, inp in ((f"a trace with {k} op/kernel names planted", planted_trace),
                       (f"a snapshot with {frames} frames planted", planted_snap),
                       ("a run directory whose unit layers.0 is named =cmd|...", planted_run)):
        out = d / f"out-{len(os.listdir(d))}"
        res = run(fsdpprof("report", inp, "-o", out / "r.html", "--tables", out / "tables"), cwd=d, timeout=300)
        n = _neutralised(out / "tables")
        judge("tables", f"report --tables of {label} ({n} cells neutralised)", res, expect="ok",
              formula=formula_cells(out / "tables"), other=[] if n else ["no planted name reached a table"])
    # ownership: an edited CSV, a copied tables.json, the index alone beside a user's file
    trace = DLRM / "rank-0.json.gz"
    base = d / "own"
    res = run(fsdpprof("report", trace, "-o", base / "r.html", "--tables", base / "t"), cwd=d, timeout=120)
    judge("tables", "report --tables into a new folder", res, expect="ok")
    listed = json.loads((base / "t" / "tables.json").read_text())["tables"][0]["csv"]
    edited = base / "t" / listed
    edited.write_text(edited.read_text() + "my,own,row\n")
    copied = d / "copied"
    shutil.copytree(base / "t", copied)
    lone = d / "lone"
    lone.mkdir()
    shutil.copy(base / "t" / "tables.json", lone / "tables.json")
    (lone / listed).write_text("my numbers\n")
    for label, folder in ((f"the user edited {listed}", base / "t"),
                          ("the folder is a copy of one fsdpprof wrote (cp -r)", copied),
                          (f"a copied tables.json beside the user's own {listed}", lone)):
        before = tree_state(folder)
        res = run(fsdpprof("report", trace, "-o", base / "r.html", "--tables", folder), cwd=d, timeout=120)
        judge("tables", f"report --tables again: {label}", res, expect="error", cmd="report", words=("--force",),
              lost=lost_files(before, tree_state(folder)))
    # a recorder's folders: refused, and the next record --force still works
    r = fx.copy(fx.run1(), "tables-into-rank")
    for sub in ("rank-0", "rank-0/tables", "launchers"):
        before = tree_state(r)
        res = run(fsdpprof("report", r, "-o", d / "rr.html", "--tables", r / sub), cwd=d, timeout=180)
        judge("tables", f"report --tables RUN/{sub}", res, expect="error", cmd="report",
              words=("fsdpprof record writes",), lost=lost_files(before, tree_state(r)),
              other=_exists(r / "rank-0" / "tables.json", r / "rank-0" / "tables"))
    res = run(fsdpprof("record", "--force", "--out", r, "--", PY, "-c", "print('job')"), cwd=fx.work, timeout=120)
    judge("tables", "record --force over that run afterwards", res, expect="job", job=(0, "job\n"))
    # NVML's "not available" (2**64 - 1) in rank.json's process memory
    r = fx.copy(fx.run1(), "tables-nvml")
    info_path = r / "rank-0" / "rank.json"
    info = json.loads(info_path.read_text())
    samples = (info.get("process_memory") or {}).get("samples") or []
    for s in samples:
        for key in ("used_bytes", "used_peak_bytes", "reserved_bytes"):
            if key in s:
                s[key] = 2**64 - 1
    info["process_memory"]["samples"] = samples
    info_path.write_text(json.dumps(info))
    res = run(fsdpprof("report", r, "-o", d / "nvml.html", "--tables", d / "nvml"), cwd=d, timeout=180)
    text = (d / "nvml.summary.json").read_text() if (d / "nvml.summary.json").exists() else ""
    index = (d / "nvml" / "tables.json").read_text() if (d / "nvml" / "tables.json").exists() else ""
    judge("tables", f"report --tables, rank.json with 2**64-1 in {len(samples)} process-memory samples", res,
          expect="ok", formula=formula_cells(d / "nvml"),
          accepted=["2**64-1 read as a number"] if "18446744073709551615" in text else [],
          other=["a Parquet overflow"] if "too large" in index else [])


# ------------------------------------------------------------------------------------------------ shell
def group_shell(fx: Fixtures, args) -> None:
    d = scratch(fx, "shell")
    trace = DLRM / "rank-0.json.gz"
    if importlib.util.find_spec("distributed") is None:
        skip("shell", "ucx:// schedulers", "dask.distributed is not installed")
    else:
        argvs = {"report": ["report", trace, "-o", d / "r.html"], "compare": ["compare", DLRM, DLRM, "-o",
                 d / "c.html"], "overlap": ["overlap", trace], "whatif": ["whatif", fx.run1()]}
        for cmd, argv in argvs.items():
            res = run(fsdpprof(*argv, "--scheduler", "ucx://127.0.0.1:9", "--connect-timeout", "1"), cwd=d,
                      timeout=60)
            judge("shell", f"{cmd} --scheduler ucx://127.0.0.1:9", res, expect="error", cmd=cmd, words=("ucx://",),
                  other=["said more after the line"] if "Exception ignored" in res.err else [])
    out = scratch(fx, "shell-missing") / "run"
    res = run(fsdpprof("record", "--out", out, "--", "no-such-program-fsdpprof"), cwd=fx.work, timeout=60)
    judge("shell", "record of a missing program", res, expect="error", cmd="record", codes=(127,),
          words=("could not start",), other=_run_json(out, 127))
    res = run(fsdpprof("overlap", trace, "--connect-timeout", "3"), cwd=d, timeout=120)
    judge("shell", "overlap --connect-timeout 3 without --scheduler", res, expect="ok",
          other=[] if "--connect-timeout 3 has no effect" in res.err else ["no warning"])
    # hand-edited merged timelines
    tl = d / "t.json.gz"
    res = run(fsdpprof("timeline", DLRM, "-o", tl), cwd=d, timeout=180)
    judge("shell", "timeline of the 8-rank trace folder", res, expect="ok")
    if not tl.exists():
        return
    doc = json.loads(gzip.decompress(tl.read_bytes()))

    def rank1(**kw):
        return lambda x: x["otherData"]["ranks"][1].update(kw)
    edits = {"duplicate pid": rank1(pid=0), "duplicate rank": rank1(rank=0), "rank as text": rank1(rank="1"),
             "negative rank": rank1(rank=-1), "pid true": rank1(pid=True), "offset_us as text": rank1(offset_us="x"),
             "trace a list": rank1(trace=[1]), "info a list": rank1(info=[1]), "label a number": rank1(label=5),
             "ranks an object": lambda x: x["otherData"].update(ranks={"a": 1}),
             "schema fsdpprof.timeline/2": lambda x: x["otherData"].update(schema="fsdpprof.timeline/2")}
    for label, edit in edits.items():
        x = json.loads(json.dumps(doc))
        edit(x)
        path = d / "edited.json.gz"
        path.write_bytes(gzip.compress(json.dumps(x).encode(), 1))
        for cmd in ("report", "overlap"):
            argv = ["report", path, "-o", d / "e.html"] if cmd == "report" else ["overlap", path]
            res = run(fsdpprof(*argv), cwd=d, timeout=120)
            word = "fsdpprof.timeline/2)" if "schema" in label else "otherData.ranks"
            judge("shell", f"{cmd} of a merged timeline: {label}", res, expect="error", cmd=cmd, words=(word,),
                  other=(["said 'a bug'"] if "bug in fsdpprof" in res.err else [])
                  + (["schema said as bytes"] if "b'" in res.err else []))

# ------------------------------------------------------------------------------------------------ damaged
def _addressed(snap: dict) -> dict:
    """A snapshot with every block's address written out (legacy blocks have none: laid out from the segment's)."""
    out = pickle.loads(pickle.dumps(snap, protocol=4))
    for seg in out["segments"]:
        at = seg["address"]
        for b in seg["blocks"]:
            b.setdefault("address", at)
            at = b["address"] + b.get("size", 0)
    return out


def _negative_bytes(obj, where="") -> list[str]:
    """Every number under a key ending in _bytes below 0 in ``obj`` (summary.json's memory), as 'where = value'."""
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in (
            [f"{where}.{k} = {v:,}"] if k.endswith("_bytes") and isinstance(v, (int, float)) and v < 0
            else _negative_bytes(v, f"{where}.{k}"))]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in _negative_bytes(v, f"{where}[{i}]")]
    return []


def _summary_memory(path: Path):
    try:
        return json.loads(path.read_text()).get("memory") or {}
    except (OSError, ValueError):
        return {}


def _damaged_snapshots(d: Path) -> None:
    """Snapshots breaking the allocator's rules: each left out, with its counted warning, no byte figure < 0."""
    real = _addressed(_load_real_snapshot())
    segs = real["segments"]

    def edit(fn):
        snap = pickle.loads(pickle.dumps(real, protocol=4))
        fn(snap)
        return snap

    def zero_all(s):
        for seg in s["segments"]:
            seg["total_size"] = 0

    def zero_some(s):
        for seg in s["segments"][::4]:
            seg["total_size"] = 0

    def outside(s):
        for seg in s["segments"]:
            for b in seg["blocks"]:
                b["address"] += 4 * seg["total_size"]

    def no_blocks(s):
        for seg in s["segments"]:
            seg["blocks"] = []

    def overlap_blocks(s):
        for seg in s["segments"]:
            if seg["blocks"]:
                seg["blocks"].insert(1, dict(seg["blocks"][0]))

    def empty_blocks(s):
        for seg in s["segments"]:
            seg["blocks"].append({"address": seg["address"], "size": 0, "state": "inactive"})

    def overlap_segments(s):
        twin = pickle.loads(pickle.dumps(s["segments"][0], protocol=4))
        half = twin["total_size"] // 2
        twin["address"] += half
        for b in twin["blocks"]:
            b["address"] += half
        s["segments"].append(twin)

    def allocated_zero(s):
        for seg in s["segments"]:
            seg["allocated_size"] = 0

    def flag(s):
        for seg in s["segments"]:
            seg["is_expandable"] = "yes please"

    def setting(s):
        s["allocator_settings"] = dict(s.get("allocator_settings") or {}, expandable_segments="yes please")

    n = len(segs)
    n_blocks = sum(len(seg["blocks"]) for seg in segs)
    cases = [("every segment of 0 bytes", zero_all, f"{n:,} segment(s) of 0 bytes", None),
             ("a quarter of the segments of 0 bytes", zero_some, f"{len(segs[::4]):,} segment(s) of 0 bytes", None),
             ("every block outside its segment", outside, f"{n_blocks:,} block(s) lying (partly) outside",
              no_blocks),
             ("each segment's first block twice", overlap_blocks,
              f"{sum(1 for seg in segs if seg['blocks']):,} block(s) overlapping another block", lambda s: None),
             ("a block of 0 bytes in each segment", empty_blocks, f"{n:,} block(s) of segments of 0 bytes",
              lambda s: None),
             ("a segment overlapping another", overlap_segments, "1 segment(s) overlapping another", lambda s: None),
             ("every segment saying 0 bytes allocated", allocated_zero,
              f"{sum(1 for seg in segs if any(b.get('state') == 'active_allocated' for b in seg['blocks'])):,} "
              f"segment(s) say fewer bytes allocated than their blocks in use", lambda s: None),
             ("is_expandable: 'yes please'", flag, f"{n:,} segment(s) whose is_expandable is not true / false", None),
             ("allocator_settings expandable_segments: 'yes please'", setting,
              "1 allocator setting(s) that must be true / false and are not (expandable_segments)", None)]
    for label, fn, words, same_as in cases:
        path = d / "damaged.pickle"
        path.write_bytes(pickle.dumps(edit(fn), protocol=4))
        for f in d.glob("b.*"):
            f.unlink()
        res = run(fsdpprof("report", path, "-o", d / "b.html"), cwd=d, timeout=180)
        acc, other = [], []
        if res.rc == 0:
            acc += _negative_bytes(_summary_memory(d / "b.summary.json"))
            acc += [] if words in res.out else [f"no warning {words!r}"]
            if same_as is not None:           # the figures of the snapshot with the damage deleted by hand
                path.write_bytes(pickle.dumps(edit(same_as), protocol=4))
                ref = run(fsdpprof("report", path, "-o", d / "ref.html"), cwd=d, timeout=180)
                pa, pb = _peak(d / "b.summary.json"), _peak(d / "ref.summary.json")
                if ref.rc != 0 or pa != pb:
                    acc.append(f"peak {pa} B, with the damaged parts deleted {pb} B (exit {ref.rc})")
        judge("damaged", f"report: snapshot, {label} ({SNAPSHOT.name})", res, expect="any", cmd="report",
              words=(words,) if res.rc == 0 else (str(path),), accepted=acc, other=other)


def _damaged_process_memory(fx: Fixtures, d: Path) -> None:
    """rank.json process memory below the allocator's: 'contradicts the allocator', never a negative figure."""
    base = fx.run1()
    rank_dir = next(p for p in sorted(base.iterdir()) if p.is_dir() and p.name.startswith("rank-"))
    gib = 1 << 30
    cuda = {"source": runfmt.PROCESS_MEMORY_NVML, "device": "cuda:0", "nccl_env": {},
            "samples": [{"step": 5, "used_bytes": 3 * gib, "reserved_bytes": 6 * gib, "max_reserved_bytes": 6 * gib,
                         "allocated_bytes": 5 * gib, "max_allocated_bytes": 5 * gib}]}
    cases = {"RSS of 4 KiB, below the allocator's peak": lambda pm: dict(pm, samples=[
                 dict(x, used_bytes=4096, used_peak_bytes=4096) for x in pm["samples"]]),
             "NVML used 3 GiB below 6 GiB reserved": lambda pm: cuda}
    for i, (label, fn) in enumerate(cases.items()):
        r = fx.copy(base, f"damaged-process-{i}")
        rj = r / rank_dir.name / runfmt.RANK_JSON
        doc = json.loads(rj.read_text())
        doc[runfmt.RANK_PROCESS_MEMORY] = fn(doc.get(runfmt.RANK_PROCESS_MEMORY) or {})
        rj.write_text(json.dumps(doc))
        res = run(fsdpprof("report", r, "-o", d / "p.html"), cwd=d, timeout=180)
        mem = _summary_memory(d / "p.summary.json")
        outside = [m.get("process", {}).get("outside_allocator_peak_bytes") for m in mem.values()
                   if isinstance(m, dict) and isinstance(m.get("process"), dict)]
        acc = _negative_bytes(mem) + [f"outside the allocator {v:,} B" for v in outside if v is not None]
        judge("damaged", f"report: process memory, {label}", res, expect="ok", words=("contradicts the allocator",),
              accepted=acc if res.rc == 0 else [])


def _damaged_timelines(fx: Fixtures, d: Path) -> None:
    """A merged timeline with one rank's events deleted by hand: that rank named missing, counted out."""
    def cut(src: Path, rank: int) -> Path:
        doc = json.loads(gzip.decompress(src.read_bytes()))
        pid = next(p["pid"] for p in doc["otherData"]["ranks"] if p["rank"] == rank)
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("pid") != pid]
        dst = src.with_name(src.name.replace(".json.gz", f"-no-rank-{rank}.json.gz"))
        dst.write_bytes(gzip.compress(json.dumps(doc).encode(), 1))
        return dst

    for name, src, rank, world in (("DLRM, 8 ranks", DLRM, 3, 8), ("the example, 2 ranks", fx.run2(), 1, 2)):
        whole = d / f"merged-{world}.json.gz"
        res = run(fsdpprof("timeline", src, "-o", whole), cwd=d, timeout=180)
        if res.rc != 0:
            judge("damaged", f"timeline: {name} (the base of the next cases)", res, expect="ok")
            continue
        part = cut(whole, rank)
        said = f"rank {rank} is missing"
        for cmd, args in (("report", ["-o", d / "t.html"]), ("overlap", []),
                          ("compare", [])):
            argv = ["compare", whole, part, "-o", d / "c.html"] if cmd == "compare" else [cmd, part, *args]
            res = run(fsdpprof(*argv), cwd=d, timeout=240)
            acc = [] if said in res.out + res.err else [f"rank {rank} not named missing"]
            m = re.search(r"ranks analysed (\d+)", res.out)
            if cmd == "report" and (not m or m.group(1) != str(world - 1)):
                acc.append(f"'ranks analysed {m.group(1) if m else '?'}' with rank {rank}'s events deleted")
            judge("damaged", f"{cmd}: merged timeline of {name}, rank {rank}'s events deleted", res, expect="ok",
                  words=(said,), accepted=acc if res.rc == 0 else [])


def group_damaged(fx: Fixtures, args) -> None:
    d = scratch(fx, "damaged")
    _damaged_snapshots(d)
    _damaged_process_memory(fx, d)
    _damaged_timelines(fx, d)


# ------------------------------------------------------------------------------------------------ fuzz
def fuzz_row(args) -> dict | None:
    if not (args.fuzz_traces or args.fuzz_snapshots):
        return None
    t0 = time.perf_counter()
    res = fuzz.run_campaign(args.fuzz_traces, args.fuzz_snapshots, seed=1, workers=args.fuzz_workers)
    counts = {c: 0 for c in COLUMNS}
    for kind, c in res["counts"].items():
        counts["ok"] += c["ok"]
        counts["clean error"] += c["user_error"]
        counts["traceback"] += c["exception"] + c["crash"]
        counts["hang"] += c["hang"]
        counts["other"] += c["internal"] + c["warning"] + c["multiline"] + c["implausible"]
    print(f"fuzz: {args.fuzz_traces} traces + {args.fuzz_snapshots} snapshots (seed 1, {args.fuzz_workers} workers) "
          f"in {time.perf_counter() - t0:.0f} s; slowest case {res['max_s']:.2f} s {res['slowest']}", flush=True)
    for f in res["failures"][:10]:
        print(f"FAIL fuzz     {f['outcome']:18s} {f['kind']}:{f['index']} {f['mutations']} "
              f"{(f['detail'] or '').strip().splitlines()[-1:]}", flush=True)
    return counts


# ------------------------------------------------------------------------------------------------ main
GROUPS = {"decode": group_decode, "record": group_record, "dask": group_dask, "force": group_force,
          "outputs": group_outputs, "rank": group_rank, "values": group_values, "snapshot": group_snapshot,
          "damaged": group_damaged, "streams": group_streams, "tables": group_tables, "shell": group_shell}


def table(fuzz_counts: dict | None) -> tuple[str, int]:
    head = f"{'group':10s} {'inputs':>7s} " + " ".join(f"{c:>{max(len(c), 6)}s}" for c in COLUMNS)
    rows, total = [head, "-" * len(head)], {c: 0 for c in COLUMNS}
    for g in GROUPS:
        mine = [c for c in CASES if c.group == g]
        if not mine:
            continue
        counts = {c: sum(1 for x in mine if x.outcome == c) for c in COLUMNS}
        for c in COLUMNS:
            total[c] += counts[c]
        rows.append(f"{g:10s} {len(mine):7d} " + " ".join(f"{counts[c]:>{max(len(c), 6)}d}" for c in COLUMNS))
    rows.append("-" * len(head))
    rows.append(f"{'campaign':10s} {sum(total.values()):7d} " + " ".join(f"{total[c]:>{max(len(c), 6)}d}"
                                                                        for c in COLUMNS))
    failures = sum(total[c] for c in FAILURES)
    if fuzz_counts is not None:
        rows.append(f"{'fuzz':10s} {sum(fuzz_counts.values()):7d} " + " ".join(
            f"{fuzz_counts[c]:>{max(len(c), 6)}d}" for c in COLUMNS))
        both = {c: total[c] + fuzz_counts[c] for c in COLUMNS}
        rows.append(f"{'all':10s} {sum(both.values()):7d} " + " ".join(f"{both[c]:>{max(len(c), 6)}d}"
                                                                       for c in COLUMNS))
        failures += sum(fuzz_counts[c] for c in FAILURES)
    return "\n".join(rows), failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="folder for the campaign's files (default: a new temporary folder, removed)")
    ap.add_argument("--only", nargs="+", choices=sorted(GROUPS), help="run only these groups")
    ap.add_argument("--big-blanks-mib", type=int, default=1024, help="the large blanks case (0: none)")
    ap.add_argument("--fuzz-traces", type=int, default=0, help="also run fuzz.py's campaign with this many traces")
    ap.add_argument("--fuzz-snapshots", type=int, default=0, help="... and this many snapshots")
    ap.add_argument("--fuzz-workers", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep --work's files")
    ap.add_argument("--log", help="write every case (outcome, command, what it said) to this JSON-lines file")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="fsdpprof-hostile-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    fx = Fixtures(work)
    t0 = time.perf_counter()
    try:
        for name, fn in GROUPS.items():
            if not args.only or name in args.only:
                fn(fx, args)
        fx.unmount_all()
        campaign_s = time.perf_counter() - t0
        fuzz_counts = fuzz_row(args)
    finally:
        fx.unmount_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.log:
        with open(args.log, "w") as fh:
            for c in CASES:
                fh.write(json.dumps(c.__dict__) + "\n")
    text, failures = table(fuzz_counts)
    print(f"\nhostile campaign: {len(CASES)} cases in {campaign_s:.0f} s, {fx.recordings} recordings; "
          f"{len(SKIPPED)} skipped" + (f"; fuzz {time.perf_counter() - t0 - campaign_s:.0f} s" if fuzz_counts else ""))
    print(text)
    for g, n, why in SKIPPED:
        print(f"skipped: {g}: {n}: {why}")
    bad = [c for c in CASES if c.outcome in FAILURES]
    if bad:
        print("\nfailing cases:")
    for c in bad:
        print(f"- [{c.group}] {c.name}: {c.outcome}\n    {'; '.join(c.details)[:600]}\n    $ {c.command[:400]}\n"
              f"    said: {c.said}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
