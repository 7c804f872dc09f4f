"""Benchmark: the trace decoder's speed on hostile layouts beside real traces, in one run.

    python benchmarks/bench_decode.py [--blanks-mib 64] [--names-mib 1 4] [--zeros-mib 256] [--repeat 3]
                                      [--timeout 300] [--before REF]

Inputs, each a gzipped trace built here (``hostile_trace``): ``{"traceEvents": [`` + 99 small duration events + ``,``
+ N MiB of blanks + one more event + ``]}`` ("blanks"); the same with one more event whose name is N MiB of ``}``
("name"); N MiB of zero bytes ("zeros", refused); an event whose name is ``},{`` repeated ("seps": a boundary at
every third byte, all inside a string); a name of ``}`` with ``{,`` every KiB ("braces": the boundary search's
worst case, every byte searched by a regular expression, none found); 8 MiB of empty events ``{}`` ("tiny"); an event whose args nest 2 MiB of
objects ("nesting", refused); and the real GPU traces of tests/data/gpu-traces.  Each goes through
``decode_trace`` (refused ones: to their one-line error); MiB/s = decompressed bytes / the fastest of ``--repeat``
calls (CPU seconds of this process, its inflating thread included: this machine is shared, and wall time
measures the neighbours; after a warm-up decode).  ``--before REF`` runs the same cases in a child process
on fsdpprof at git commit/branch REF (``git archive``), each case under ``--timeout`` seconds (a hostile case
there: one call), and prints both.
Prints figures only; tests/test_decode_speed.py holds the ratios that must hold.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "tests" / "data" / "gpu-traces"   # the licensed real traces, in the repository
MIB = 1 << 20

_EVENT = {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 0, "dur": 1, "args": {}}
KINDS = ("blanks", "name", "zeros", "seps", "braces", "tiny", "nesting")


def _event(i: int, **kw) -> bytes:
    return json.dumps({**_EVENT, "ts": 10 * i, **kw}).encode()


def hostile_middle(kind: str, nbytes: int) -> bytes:
    """About ``nbytes`` of a hostile layout (``kind`` one of KINDS), to go after an event's ``,`` and before the next
    event: blanks, an event with a long name (and its ``,``), empty events, an event with deep args, zero bytes."""
    if kind == "zeros":
        return bytes(nbytes)
    if kind == "blanks":
        return b" " * nbytes
    if kind == "name":
        return _event(99, name="}" * nbytes) + b","
    if kind == "seps":
        return _event(99, name="},{" * (nbytes // 3)) + b","
    if kind == "braces":
        return _event(99, name=("}" * 1022 + "{,") * (nbytes // 1024)) + b","
    if kind == "tiny":
        return b"{}," * (nbytes // 3)
    if kind == "nesting":
        depth = nbytes // 6
        return _event(99)[:-1] + b', "args": ' + b'{"a":' * depth + b"0" + b"}" * depth + b"},"
    raise ValueError(kind)


def hostile_json(kind: str, nbytes: int) -> bytes:
    """The JSON of a hostile trace of about ``nbytes`` bytes (decompressed): 99 small events, ``hostile_middle``,
    one more event (``zeros``: only zero bytes)."""
    if kind == "zeros":
        return bytes(nbytes)
    head = b'{"traceEvents": [' + b", ".join(_event(i) for i in range(99)) + b","
    return head + hostile_middle(kind, nbytes) + _event(100) + b"]}"


def hostile_trace(kind: str, nbytes: int, path: str | os.PathLike) -> int:
    """Write ``hostile_json(kind, nbytes)`` gzipped (level 1) to ``path``; returns its decompressed size in bytes."""
    data = hostile_json(kind, nbytes)
    with open(path, "wb") as fh:
        fh.write(gzip.compress(data, compresslevel=1, mtime=0))
    return len(data)


def real_traces() -> list[tuple[str, Path]]:
    """(name, path) of the biggest real GPU trace of each folder of tests/data/gpu-traces."""
    out = []
    for d in sorted(SHARED.glob("*")):
        files = sorted(d.glob("*.json.gz"), key=lambda p: p.stat().st_size)
        if files:
            out.append((d.name, files[-1]))
    return out


def gunzipped_size(path) -> int:
    with gzip.open(path, "rb") as fh:
        return sum(len(b) for b in iter(lambda: fh.read(8 * MIB), b""))


def time_decode(path, repeat: int) -> tuple[float, str]:
    """(fewest CPU seconds of ``repeat`` decode_trace calls, outcome: "ok" or the error's first words)."""
    from fsdpprof.analyze.trace.decode import decode_trace
    from fsdpprof.errors import UserError

    best, outcome = float("inf"), "ok"
    for _ in range(repeat):
        t0 = time.process_time()
        try:
            decode_trace(path)
        except UserError as exc:
            outcome = "refused: " + str(exc).split(" ", 2)[-1][:60]
        best = min(best, time.process_time() - t0)
    return best, outcome


def cases(args) -> list[tuple[str, str, int]]:
    """(label, kind, decompressed bytes wanted) of the hostile cases."""
    out = [(f"blanks {args.blanks_mib:g} MiB", "blanks", int(args.blanks_mib * MIB))]
    out += [(f"name {n:g} MiB", "name", int(n * MIB)) for n in args.names_mib]
    out += [(f"zeros {args.zeros_mib:g} MiB", "zeros", int(args.zeros_mib * MIB)),
            ("seps 16 MiB", "seps", 16 * MIB), ("braces 16 MiB", "braces", 16 * MIB), ("tiny 8 MiB", "tiny", 8 * MIB), ("nesting 2 MiB", "nesting", 2 * MIB)]
    return out


def measure_all(args, tmp: str) -> list[dict]:
    """Every case, measured in this process: rows of label, MiB, seconds, MiB/s, outcome."""
    from fsdpprof.analyze.trace.decode import decode_trace

    warm = real_traces()
    if warm:
        decode_trace(min((p for _, p in warm), key=lambda p: p.stat().st_size))
    rows = []
    for label, kind, nbytes in cases(args):
        path = os.path.join(tmp, f"{kind}-{nbytes}.json.gz")
        if not os.path.exists(path):
            hostile_trace(kind, nbytes, path)
        size = gunzipped_size(path)
        rows.append(_row(label, path, size, args.repeat))
    for name, path in real_traces():
        rows.append(_row(f"real: {name}", path, gunzipped_size(path), args.repeat))
    return rows


def _row(label: str, path, size: int, repeat: int) -> dict:
    s, outcome = time_decode(path, repeat)
    row = {"case": label, "mib": size / MIB, "s": s, "mib_s": size / MIB / s, "outcome": outcome}
    print(json.dumps(row), flush=True)
    return row


def before_rows(ref: str, args, tmp: str) -> dict[str, dict]:
    """The cases measured on fsdpprof at ``ref``, each in its own child process (``--timeout`` seconds)."""
    tree = os.path.join(tmp, "before")
    os.makedirs(tree, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "fsdpprof"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    out = {}
    labels = [c[0] for c in cases(args)] + [f"real: {n}" for n, _ in real_traces()]
    for label in labels:
        repeat = args.repeat if label.startswith("real:") else 1       # (a hostile case took seconds to minutes)
        argv = [sys.executable, __file__, "--child", tree, label, "--tmp", tmp, "--repeat", str(repeat),
                "--blanks-mib", str(args.blanks_mib), "--zeros-mib", str(args.zeros_mib),
                "--names-mib", *map(str, args.names_mib)]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
            rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
            out[label] = rows[-1] if rows else {"case": label, "outcome": "failed: " + res.stderr[-200:]}
        except subprocess.TimeoutExpired:
            out[label] = {"case": label, "s": args.timeout, "mib_s": None, "outcome": f"> {args.timeout:g} s"}
        print(f"before {label}: {out[label]}", flush=True)
    return out


def child(tree: str, label: str, args) -> None:
    sys.path.insert(0, tree)
    from fsdpprof.analyze.trace.decode import decode_trace

    warm = real_traces()
    if warm:
        decode_trace(min((p for _, p in warm), key=lambda p: p.stat().st_size))
    for lab, kind, nbytes in cases(args):
        if lab == label:
            path = os.path.join(args.tmp, f"{kind}-{nbytes}.json.gz")
            if not os.path.exists(path):
                hostile_trace(kind, nbytes, path)
            _row(label, path, gunzipped_size(path), args.repeat)
    for name, path in real_traces():
        if label == f"real: {name}":
            _row(label, path, gunzipped_size(path), args.repeat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blanks-mib", type=float, default=64)
    ap.add_argument("--names-mib", type=float, nargs="+", default=[1, 4])
    ap.add_argument("--zeros-mib", type=float, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per case of --before")
    ap.add_argument("--before", metavar="REF", help="also measure fsdpprof at this git commit / branch")
    ap.add_argument("--child", nargs=2, metavar=("TREE", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args)
        return
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        args.tmp = tmp
        now = measure_all(args, tmp)
        before = before_rows(args.before, args, tmp) if args.before else {}
    print()
    head = f"{'case':34} {'MiB':>8} {'CPU s':>8} {'MiB/s':>8}"
    print(head + (f" {'before s':>9} {'MiB/s':>8}" if before else "") + "  outcome")
    for r in now:
        line = f"{r['case']:34} {r['mib']:8.1f} {r['s']:8.3f} {r['mib_s']:8.1f}"
        if before:
            b = before.get(r["case"], {})
            bs = b.get("mib_s")
            line += f" {b.get('s', float('nan')):9.2f} {bs if bs is None else round(bs, 1)!s:>8}"
        print(line + "  " + r["outcome"])


if __name__ == "__main__":
    main()
