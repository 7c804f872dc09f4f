"""Fuzz campaign: mutated real traces and CUDA snapshots through the Python API and the report path.

    python benchmarks/fuzz.py [--traces 5000] [--snapshots 2000] [--seed 1] [--workers 2]
                              [--trace PATH] [--cpu-trace PATH] [--snapshot PATH] [--snapshot-entries 600]

Each case is one mutated file: a real profiler trace (``--trace``, default the DLRM rank-0 trace of
tests/data; ``--cpu-trace`` adds a CPU recording's trace with ``[memory]`` events, every other
trace case then mutates that one) or a real CUDA snapshot (``--snapshot``, default
../shared/data's lm-step-user-metadata.pickle where present, else tests/data's flexgen-opt1.3b-legacy.pickle,
trimmed to its first ``--snapshot-entries`` trace entries and segments so that a case stays cheap).  Mutations, 1-3 per case: type swaps (str/list/dict/number/null/bool),
NaN/inf/huge integers/negative numbers, key deletion, duplication (copies and shared references),
truncation (of the JSON/pickle text or of its gzip), deep nesting, very long strings.  A share of the cases
(HOSTILE_SHARE, from a random stream of their own: the other cases stay as they were) are hostile layouts of the
trace instead (up to 16 MiB of blanks, a name of ``}``, empty events, deep nesting, zero bytes, blanks before
"traceEvents", a file of zero bytes; bench_decode.hostile_middle) or garbage snapshots (zero or random bytes, a
pickle header claiming a frame / bytes / string of up to 2**64 bytes, gzip of garbage, a real pickle's prefix
followed by garbage).

Each file goes through the Python API (``load_trace`` / ``load_snapshot``) and, when that accepts it,
through the full report path (``load_run`` + ``analyze_run`` (HTA off) + ``summary()`` as strict JSON +
``render_report``).  Outcomes: ``ok`` (analysed), ``user_error`` (a clean one-line UserError), and the
failures: ``exception`` (anything else escaped: a traceback), ``internal`` (a UserError wrapping an
unexpected exception: fsdpprof's last-resort wrapper caught a bug), ``warning`` (a Python warning, e.g. a
RuntimeWarning, would reach stderr), ``multiline`` (an error message of more than one line), ``hang``
(a case took more than ``--hang-s`` seconds).  Cases are generated from (seed, index) alone, so a
failing case is reproduced with ``--only INDEX``.  Prints the counts and the slowest case; exit code 1
when any failure was found.  ``run_campaign`` is what tests/test_fuzz.py calls.
"""
from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_decode import KINDS as HOSTILE_KINDS, hostile_middle  # noqa: E402  (the hostile layouts, defined once)
TEST_DATA = ROOT / "tests" / "data"                   # real data with a licence, in the repository
SHARED = ROOT.parent / "shared" / "data"             # the team's folder (also the snapshots without one)
DEFAULT_TRACE = TEST_DATA / "gpu-traces" / "param-dlrm-8rank-v100" / "rank-0.json.gz"
# the newest snapshot layout (5,163 trace entries) where ../shared/data is, else the licensed legacy one
DEFAULT_SNAPSHOT = next((p for p in (SHARED / "cuda-snapshots" / "lm-step-user-metadata.pickle",)
                         if p.exists()), TEST_DATA / "cuda-snapshots" / "flexgen-opt1.3b-legacy.pickle")

FAILURES = ("exception", "internal", "warning", "multiline", "implausible", "hang", "crash")
OUTCOMES = ("ok", "user_error") + FAILURES

# raw JSON tokens that a JSON library will not write: placed as marker strings, replaced in the text
_SPECIAL_JSON = {"NaN": b"NaN", "Inf": b"Infinity", "-Inf": b"-Infinity", "1e400": b"1e400", "-1e400": b"-1e400",
                 "bigint": b"123456789012345678901234567890123456789"}
_MARK = "\u0001fz:"
_KEEP_CATS = ("kernel", "gpu_memcpy", "cpu_op", "user_annotation", "cuda_runtime", "gpu_user_annotation")


# ----------------------------------------------------------------------------------------- values
def _random_value(rng: random.Random, depth: int = 0):
    """A value of a random JSON-ish type."""
    k = rng.randrange(13)
    if k == 0:
        return None
    if k == 1:
        return rng.choice([True, False])
    if k == 2:
        return rng.choice([0, 1, -1, 7, 2**31, 2**63 - 1, -(2**63), 2**64 + 5, 10**30])
    if k == 3:
        return rng.choice([0.5, -0.5, 1e-300, 1e300, -1e300, 3.7])
    if k == 4:
        return rng.choice(["", "x", "nccl:all_gather", "ProfilerStep#x", "kernel", "cpu_op", "[memory]",
                           "FSDP::all_gather (layers.0)", "<script>alert(1)</script>", "é☃\u2028"])
    if k == 5:
        return "A" * rng.choice([1025, 5000, 70000])
    if k == 6:
        return [] if depth > 1 else [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    if k == 7:
        return {} if depth > 1 else {rng.choice(["a", "name", "ts", "1"]): _random_value(rng, depth + 1)}
    if k == 8:
        return _MARK + rng.choice(list(_SPECIAL_JSON))
    if k == 9:
        return _nested(rng.choice([20, 200, 3000]), rng.random() < 0.5)
    if k == 10:
        return [[1, 2], [3]]
    if k == 11:
        return rng.choice([float("nan"), float("inf"), -float("inf")])   # python floats (pickles keep them)
    return rng.choice([-5, -1e9, -0.001])


def _nested(depth: int, as_dict: bool):
    """A value nested ``depth`` levels deep. Up to 200 levels a real object; deeper, a marker that the
    writer turns into the nested text (JSON) or opcodes (pickle) without recursing."""
    if depth > 200:
        return f"{_MARK}nest:{depth}:{'d' if as_dict else 'l'}"
    v: object = 1
    for _ in range(depth):
        v = {"a": v} if as_dict else [v]
    return v


_NEST_RE = re.compile(rb'"\\u0001fz:nest:(\d+):([dl])"')
_NEST_PICKLE_RE = re.compile(rb"\x8c.\x01fz:nest:(\d+):([dl])", re.S)


def _nest_json(m) -> bytes:
    depth = int(m.group(1))
    if m.group(2) == b"d":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b"[" * depth + b"1" + b"]" * depth


def _nest_pickle(m) -> bytes:
    """Opcodes that build the nested value on the unpickler's stack (protocol 4)."""
    depth = int(m.group(1))
    if m.group(2) == b"d":     # EMPTY_DICT, SHORT_BINUNICODE 'a', ... BININT1 1, SETITEM per level
        return (b"}\x8c\x01a" * depth) + b"K\x01" + b"s" * depth
    return b"]" * depth + b"K\x01" + b"a" * depth

def _special_number(rng: random.Random, json_text: bool):
    """NaN / inf / huge / negative: as raw JSON tokens (json_text) or as python values (pickles)."""
    if json_text and rng.random() < 0.5:
        return _MARK + rng.choice(list(_SPECIAL_JSON))
    return rng.choice([float("nan"), float("inf"), -float("inf"), 10**30, 2**63, 2**64, -(2**63) - 1, -1, -1000.5,
                       1e300, -1e300, 0, 2**62])


# ----------------------------------------------------------------------------------------- traces
def load_trace_doc(path, events: int | None = None) -> dict:
    """The trace as a parsed document; with ``events``, trimmed to the time window of its first ``events``
    duration events (every event in that window kept: [memory] events, flows, ..., and the metadata)."""
    import orjson
    raw = Path(path).read_bytes()
    doc = orjson.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    ev = doc["traceEvents"]
    times = sorted(e["ts"] for e in ev if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)))
    if events and len(times) > events:
        end = times[events - 1]
        doc["traceEvents"] = [e for e in ev if not isinstance(e.get("ts"), (int, float)) or e["ts"] <= end]
    return doc


def _json_safe(o, depth: int = 0):
    """``o`` as a JSON library writes it: NaN / inf floats as null (the raw NaN / Infinity tokens come from
    explicit markers), integers beyond 64 bits as a marker that :func:`_dumps_json` writes as the digits;
    applied to each mutated value."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, int) and not isinstance(o, bool) and not -(2**63) <= o < 2**64:
        return _MARK + "bigint"
    if depth < 250 and isinstance(o, dict):
        return {k: _json_safe(v, depth + 1) for k, v in o.items()}
    if depth < 250 and isinstance(o, list):
        return [_json_safe(v, depth + 1) for v in o]
    return o


def _dumps_json(doc) -> bytes:
    """JSON text of ``doc``; marker strings become raw tokens (NaN, 1e400, huge ints) and python floats
    nan/inf become NaN/Infinity, as a careless writer would put them."""
    def fix(o):
        if isinstance(o, float) and not math.isfinite(o):
            return _MARK + ("NaN" if o != o else ("Inf" if o > 0 else "-Inf"))
        if isinstance(o, int) and not isinstance(o, bool) and not -(2**63) <= o < 2**64:
            return _MARK + "bigint"
        return o

    def walk(o, depth=0):
        if depth > 40:                         # deep nesting: the JSON encoder writes it as it is
            return o
        if isinstance(o, dict):
            return {k: walk(v, depth + 1) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v, depth + 1) for v in o]
        return fix(o)

    import orjson
    try:
        text = orjson.dumps(doc)
    except (orjson.JSONEncodeError, TypeError):
        text = json.dumps(walk(doc)).encode()
    if b"\\u0001fz:" not in text:
        return text
    for name, tok in _SPECIAL_JSON.items():
        text = text.replace(json.dumps(_MARK + name).encode(), tok)
    return _NEST_RE.sub(_nest_json, text)


def _pick_event(rng: random.Random, events: list) -> int:
    if not events:
        return -1
    if rng.random() < 0.7:
        for _ in range(20):
            i = rng.randrange(len(events))
            e = events[i]
            if isinstance(e, dict) and (e.get("cat") in _KEEP_CATS or e.get("name") == "[memory]"):
                return i
    return rng.randrange(len(events))


_EVENT_KEYS = ["ph", "name", "cat", "pid", "tid", "ts", "dur", "args", "id", "s"]
_ARG_KEYS = ["stream", "correlation", "External id", "Collective name", "In msg nelems", "Out msg nelems",
             "Group size", "dtype", "Process Group Name", "Seq", "Input Dims", "Input type", "Addr", "Bytes",
             "Total Allocated", "Total Reserved", "Device Type", "Device Id", "name"]
_META_KEYS = ["distributedInfo", "deviceProperties", "schemaVersion", "baseTimeNanoseconds", "traceName"]


def mutate_trace(doc: dict, rng: random.Random) -> tuple[bytes, str, list[str]]:
    """(file bytes, file suffix, what was done) of one mutated copy of ``doc`` (left unchanged)."""
    d = dict(doc)
    events = list(d.get("traceEvents") or [])
    d["traceEvents"] = events
    done = []
    truncate = None
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.choice(["swap", "swap", "swap", "arg", "arg", "number", "number", "delete", "dup", "dup",
                         "nest", "meta", "phase", "long", "mem", "truncate"])
        i = _pick_event(rng, events)
        if i < 0:
            op = "meta"
        if op in ("swap", "number", "delete", "nest", "phase", "long"):
            e = copy.deepcopy(events[i]) if isinstance(events[i], dict) else {}
            key = rng.choice(_EVENT_KEYS)
            if op == "swap":
                e[key] = _random_value(rng)
            elif op == "number":
                e[rng.choice(["ts", "dur", "ts", "dur", "pid", "tid"])] = _special_number(rng, True)
            elif op == "delete":
                e.pop(key, None)
            elif op == "nest":
                e[key] = _nested(rng.choice([30, 300, 2000, 20000]), rng.random() < 0.5)
            elif op == "phase":
                e["ph"] = rng.choice(["i", "I", "M", "B", "E", "Z", "", 5, None, "X"])
            else:
                e[rng.choice(["name", "name", "tid", "cat"])] = "N" * rng.choice([1025, 4000, 100_000])
            events[i] = _json_safe(e)
            done.append(f"{op}:{key}@{i}")
        elif op == "arg":
            e = copy.deepcopy(events[i]) if isinstance(events[i], dict) else {}
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            key = rng.choice(_ARG_KEYS)
            r = rng.random()
            if r < 0.4:
                args[key] = _random_value(rng)
            elif r < 0.7:
                args[key] = _special_number(rng, True)
            elif r < 0.85:
                args.pop(key, None)
            else:
                args[key] = _nested(rng.choice([50, 2000]), rng.random() < 0.5)
            e["args"] = args
            events[i] = _json_safe(e)
            done.append(f"arg:{key}@{i}")
        elif op == "dup":
            r = rng.random()
            if r < 0.2:
                events.extend(events[: len(events)])           # the whole trace twice
                done.append("dup:all")
            elif r < 0.6:
                events[i + 1: i + 1] = [events[i]] * rng.choice([1, 2, 50])
                done.append(f"dup:{i}")
            else:
                a = rng.randrange(len(events))
                b = min(len(events), a + rng.randrange(1, 200))
                events[b:b] = events[a:b]
                done.append(f"dup:{a}-{b}")
        elif op == "meta":
            key = rng.choice(_META_KEYS + ["traceEvents"])
            r = rng.random()
            if key == "traceEvents" and r < 0.3:
                d[key] = _random_value(rng)
                events = []
            elif key == "distributedInfo" and r < 0.7:
                dist = dict(d.get("distributedInfo") or {}) if isinstance(d.get("distributedInfo"), dict) else {}
                dist[rng.choice(["rank", "world_size", "backend", "pg_config", "pg_count"])] = _random_value(rng)
                d[key] = dist
            elif r < 0.5:
                d.pop(key, None)
                if key == "traceEvents":
                    events = []
            else:
                d[key] = _random_value(rng)
            if key in d:
                d[key] = _json_safe(d[key])
            done.append(f"meta:{key}")
        elif op == "mem":
            # a [memory] instant event (alloc or free) with one corrupted value
            ts = next((x.get("ts") for x in events[i:] if isinstance(x, dict) and isinstance(x.get("ts"), (int, float))), 0)
            args = {"Addr": rng.choice([4096, 8192, 123456]), "Bytes": rng.choice([512, -512, 1 << 20]),
                    "Total Allocated": 1 << 20, "Total Reserved": 2 << 20, "Device Type": 0, "Device Id": -1}
            bad = rng.choice(list(args) + ["ts", None])
            ev = {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
                  "args": args}
            if bad == "ts":
                ev["ts"] = _special_number(rng, True)
            elif bad is not None:
                args[bad] = rng.choice([_random_value(rng), _special_number(rng, True)])
            events[i: i] = [_json_safe(ev)] * rng.choice([1, 1, 3])
            done.append(f"mem:{bad}")
        else:
            truncate = rng.random()
            done.append(f"truncate:{truncate:.3f}")
    text = _dumps_json(d)
    gz = rng.random() < 0.3
    if truncate is not None and not gz:
        text = text[: int(len(text) * truncate)]
    if gz:
        text = gzip.compress(text, compresslevel=1)
        if truncate is not None:
            text = text[: int(len(text) * truncate)]
    return text, (".json.gz" if gz else ".json"), done


# ----------------------------------------------------------------------------------------- snapshots
def load_snapshot_obj(path, entries: int | None):
    """The snapshot as plain Python objects (restricted unpickler), trimmed to ``entries`` trace entries
    per device and as many segments."""
    from fsdpprof.analyze.memory import safe_pickle
    snap = safe_pickle.load(path)
    if entries is not None and isinstance(snap, dict):
        snap = dict(snap)
        snap["device_traces"] = [list(t)[:entries] for t in snap.get("device_traces") or []]
        snap["segments"] = list(snap.get("segments") or [])[:max(1, entries // 10)]
    return snap


def _pick(rng: random.Random, seq):
    return rng.randrange(len(seq)) if seq else -1


def mutate_snapshot(snap, rng: random.Random) -> tuple[bytes, str, list[str]]:
    """(file bytes, suffix, what was done) of one mutated copy of ``snap`` (left unchanged)."""
    s = dict(snap) if isinstance(snap, dict) else {"segments": list(snap)}
    traces = [list(t) if isinstance(t, list) else t for t in (s.get("device_traces") or [])]
    s["device_traces"] = traces
    segs = list(s.get("segments") or [])
    s["segments"] = segs
    done = []
    truncate = None
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.choice(["entry", "entry", "entry", "number", "number", "segment", "block", "frame", "delete",
                         "dup", "share", "nest", "top", "truncate", "long"])
        t = traces[0] if traces and isinstance(traces[0], list) else None
        if op in ("entry", "number", "frame", "long", "delete") and t:
            i = _pick(rng, t)
            e = dict(t[i]) if isinstance(t[i], dict) else {}
            key = rng.choice(["action", "addr", "size", "time_us", "stream", "frames", "user_metadata",
                              "device_free", "compile_context"])
            if op == "entry":
                e[key] = _random_value(rng)
            elif op == "number":
                e[rng.choice(["addr", "size", "time_us", "stream", "device_free"])] = _special_number(rng, False)
            elif op == "frame":
                fr = list(e.get("frames") or []) if isinstance(e.get("frames"), list) else []
                if fr:
                    j = rng.randrange(len(fr))
                    f = dict(fr[j]) if isinstance(fr[j], dict) else {}
                    f[rng.choice(["name", "filename", "line"])] = _random_value(rng)
                    fr[j] = f if rng.random() < 0.8 else _random_value(rng)
                e["frames"] = fr if rng.random() < 0.9 else _random_value(rng)
            elif op == "long":
                e[rng.choice(["user_metadata", "action"])] = "M" * rng.choice([1025, 100_000])
            else:
                e.pop(key, None)
            t[i] = e
            done.append(f"{op}:{key}@{i}")
        elif op in ("segment", "block") and segs:
            i = _pick(rng, segs)
            sg = dict(segs[i]) if isinstance(segs[i], dict) else {}
            if op == "segment":
                key = rng.choice(["device", "address", "total_size", "allocated_size", "active_size", "stream",
                                  "is_expandable", "blocks"])
                sg[key] = _random_value(rng) if rng.random() < 0.5 else _special_number(rng, False)
            else:
                blocks = list(sg.get("blocks") or []) if isinstance(sg.get("blocks"), list) else []
                key = rng.choice(["state", "address", "size", "frames"])
                if blocks:
                    j = rng.randrange(len(blocks))
                    b = dict(blocks[j]) if isinstance(blocks[j], dict) else {}
                    b[key] = _random_value(rng) if rng.random() < 0.5 else _special_number(rng, False)
                    blocks[j] = b if rng.random() < 0.9 else _random_value(rng)
                sg["blocks"] = blocks
            segs[i] = sg if rng.random() < 0.95 else _random_value(rng)
            done.append(f"{op}:{key}@{i}")
        elif op == "dup" and t:
            a = _pick(rng, t)
            b = min(len(t), a + rng.randrange(1, 100))
            t[b:b] = t[a:b] if rng.random() < 0.5 else copy.deepcopy(t[a:b])
            done.append(f"dup:{a}-{b}")
        elif op == "share" and t:
            # the same dict (and the same frames list) reached many times through pickle's memo
            i = _pick(rng, t)
            e = dict(t[i]) if isinstance(t[i], dict) else {}
            k = rng.choice([100, 2000, 20000])
            fr = e.get("frames") if isinstance(e.get("frames"), list) and e.get("frames") else [{"name": "f", "filename": "a.py", "line": 1}]
            e["frames"] = [fr[0]] * k
            t[i:i + 1] = [e] * k
            done.append(f"share:{k}")
        elif op == "nest":
            key = rng.choice(["frames", "user_metadata", "segments", "device_traces"])
            v = _nested(rng.choice([50, 2000, 100_000]), rng.random() < 0.5)
            if key in ("segments", "device_traces"):
                s[key] = v
            elif t:
                i = _pick(rng, t)
                e = dict(t[i]) if isinstance(t[i], dict) else {}
                e[key] = v
                t[i] = e
            done.append(f"nest:{key}")
        elif op == "top":
            key = rng.choice(["segments", "device_traces", "external_annotations", "allocator_settings", None])
            if key is None:
                s = _random_value(rng)
                done.append("top:replaced")
                break
            r = rng.random()
            if r < 0.3:
                s.pop(key, None)
            elif key == "external_annotations" and r < 0.8:
                s[key] = [{"stage": rng.choice(["START", "END", 5]), "name": _random_value(rng),
                           "device": rng.choice([0, "x", None, 10**30]), "time_us": _special_number(rng, False)}
                          for _ in range(rng.randrange(1, 4))]
            else:
                s[key] = _random_value(rng)
            done.append(f"top:{key}")
        else:
            truncate = rng.random()
            done.append(f"truncate:{truncate:.3f}")
    data = _NEST_PICKLE_RE.sub(_nest_pickle, pickle.dumps(s, protocol=4))
    gz = rng.random() < 0.2
    if truncate is not None and not gz:
        data = data[: int(len(data) * truncate)]
    if gz:
        data = gzip.compress(data, compresslevel=1)
        if truncate is not None:
            data = data[: int(len(data) * truncate)]
    return data, ".pickle", done


# ----------------------------------------------------------------------------------------- hostile layouts
HOSTILE_SHARE = 0.04        # of the cases of each kind


def hostile_trace_layout(doc: dict, rng: random.Random) -> tuple[bytes, str, list[str]]:
    """(file bytes, suffix, what was done) of ``doc``'s JSON with a hostile layout of 256 KiB - 16 MiB put in
    (bench_decode.hostile_middle: blanks, a name of ``}`` / ``},{`` / ``}...{,``, empty events, deep nesting, zero
    bytes) after a random event's ``,``, or blanks before the "traceEvents" key, or the whole file zero bytes."""
    text = _dumps_json(doc)
    kind = rng.choice(HOSTILE_KINDS + ("header",))
    nbytes = rng.choice([256 << 10, 1 << 20, 4 << 20, 16 << 20])
    if kind == "zeros" and rng.random() < 0.5:
        text, where = bytes(nbytes), "all"
    elif kind == "header":
        text, where = b"{" + b" \n" * (nbytes // 2) + text[1:], "header"
    else:
        if kind in ("tiny", "nesting", "seps", "braces"):
            nbytes = min(nbytes, 4 << 20)       # (a case stays under the hang bound on a slow machine)
        cuts = [m.end() - 1 for m in re.finditer(rb"\},\s*\{", text)]     # (an event's first byte)
        at = cuts[rng.randrange(len(cuts))] if cuts else len(text)
        text, where = text[:at] + hostile_middle(kind, nbytes) + text[at:], str(at)
    gz = rng.random() < 0.7
    if gz:
        text = gzip.compress(text, compresslevel=1)
    return text, (".json.gz" if gz else ".json"), [f"hostile:{kind}:{nbytes}@{where}"]


def garbage_snapshot(snap, rng: random.Random) -> tuple[bytes, str, list[str]]:
    """(file bytes, suffix, what was done) of a garbage snapshot of up to 4 MiB: zero bytes, random bytes, a pickle
    header claiming a frame / bytes / string of up to 2**62 bytes, gzip of garbage, a real snapshot's pickle with
    garbage after a prefix of it."""
    n = rng.choice([1, 100, 64 << 10, 1 << 20, 4 << 20])
    kind = rng.choice(["zeros", "random", "frame", "binbytes8", "binunicode8", "gzip", "prefix"])
    if kind == "zeros":
        data = bytes(n)
    elif kind == "random":
        data = rng.randbytes(n)
    elif kind in ("frame", "binbytes8", "binunicode8"):
        op = {"frame": b"\x95", "binbytes8": b"\x8e", "binunicode8": b"\x8d"}[kind]
        claim = rng.choice([n, 2 * n, 3 << 30, 1 << 62, (1 << 64) - 1])
        data = b"\x80" + bytes([rng.choice([4, 5])]) + op + claim.to_bytes(8, "little") + rng.randbytes(n)
    elif kind == "gzip":
        data = gzip.compress(rng.choice([bytes(n), rng.randbytes(n), b"\x80\x04\x95" + bytes(n)]), compresslevel=1)
    else:
        real = pickle.dumps(snap, protocol=4)
        data = real[: rng.randrange(len(real))] + rng.choice([bytes(n), rng.randbytes(n)])
    return data, ".pickle", [f"garbage:{kind}:{n}"]


# ----------------------------------------------------------------------------------------- running
class _Hang(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Hang()


def _internal(exc: BaseException) -> bool:
    """A UserError that stands for an unexpected exception (fsdpprof's last-resort wrapper caught a bug)."""
    from fsdpprof import errors
    from fsdpprof.errors import UserError
    cause = exc.__cause__
    BUG_MARK = getattr(errors, "BUG_MARK", "this is a bug in fsdpprof")     # (older versions: the same text)
    return (cause is not None and not isinstance(cause, UserError)) or BUG_MARK in str(exc)


def run_case(kind: str, data: bytes, suffix: str, workdir: str, hang_s: float, full: bool,
             render_cache: set) -> tuple[str, float, str]:
    """Write one case and run it through the API and (``full``) the report path: (outcome, seconds, detail)."""
    from fsdpprof.errors import UserError

    path = os.path.join(workdir, ("rank-0" if kind == "trace" else "snapshot") + suffix)
    for old in os.listdir(workdir):
        os.unlink(os.path.join(workdir, old))
    with open(path, "wb") as fh:
        fh.write(data)
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, hang_s * 3)      # a hang is cut off (and counted) at 3x the bound
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome, detail = _run_paths(kind, path, full, render_cache)
        if outcome == "implausible":
            pass
        elif outcome == "ok" and caught:
            w = caught[0]
            outcome, detail = "warning", f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)}:{w.lineno})"
    except _Hang:
        outcome, detail = "hang", f"still running after {hang_s * 3:.0f} s"
    except UserError as exc:
        msg = str(exc)
        if _internal(exc):
            cause = exc.__cause__
            outcome, detail = "internal", msg + ("\n" + "".join(traceback.format_exception(cause))[-3000:]
                                                 if cause is not None else "")
        elif "\n" in msg or not msg:
            outcome, detail = "multiline", msg
        else:
            outcome, detail = "user_error", msg
    except BaseException as exc:  # noqa: BLE001 - every escape is what the campaign is looking for
        if isinstance(exc, KeyboardInterrupt):
            raise
        outcome, detail = "exception", "".join(traceback.format_exception(exc))[-3000:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    dt = time.perf_counter() - t0
    if dt > hang_s and outcome != "hang":
        outcome, detail = "hang", f"took {dt:.1f} s ({outcome}: {detail[:200]})"
    return outcome, dt, detail


# numbers of summary.json that cannot be negative (times, sizes) or beyond 100 (shares)
_NONNEGATIVE = {"comm_us", "compute_us", "exposed_comm_us", "overlapped_comm_us", "step_us", "step_time_us",
                "total_us", "max_us", "peak_allocated_bytes", "wire_bytes", "payload_bytes", "total_bytes",
                "bytes", "count", "reserved_bytes"}
_PERCENT = {"overlap_pct", "coverage_pct", "comp_comm_overlap_pct", "fragmentation_pct", "pct"}


def implausible(summary) -> str | None:
    """The first number in ``summary`` (summary.json) that no real run can give, or None."""
    stack = [("", summary)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack += list(v.items())
        elif isinstance(v, list):
            stack += [(key, x) for x in v]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if key in _NONNEGATIVE and v < 0:
                return f"{key} = {v}"
            if key in _PERCENT and not -1e-6 <= v <= 100 + 1e-6:
                return f"{key} = {v}"
    return None


def _run_paths(kind: str, path: str, full: bool, render_cache: set) -> tuple[str, str]:
    """The API, then (``full``) the report path: load_run, analyze_run, summary.json (strict JSON), the
    terminal summary and the HTML page. Raises what they raise."""
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.analyze.memory.snapshot import load_snapshot
    from fsdpprof.analyze.trace import load_trace
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.summary import summary as summary_of
    from fsdpprof.report.text import summary_text

    if kind == "trace":
        load_trace(path)
    else:
        load_snapshot(path)
    if not full:
        return "ok", ""
    a = analyze_run(load_run(path, workers=1), hta=False)
    summary = summary_of(a)
    text = json.dumps(summary, allow_nan=False)
    bad = implausible(summary)
    if bad is not None:
        return "implausible", f"summary.json has {bad}"
    summary_text(a)
    # render_report is a pure function of the Analysis: an analysis already rendered in this process
    # is not rendered again (its digest is the summary plus the tables the page shows beyond it)
    key = hashlib.sha1(text.encode() + pickle.dumps((a.lanes, a.memory_peaks, a.warnings, a.notes,
                                                     {r: (m.timeline, m.peak_allocated_bytes) for r, m in a.memory.items()}))).digest()
    if key not in render_cache:
        render_report(a)
        render_cache.add(key)
    return "ok", ""


# per worker process: the sources, parsed once
_STATE: dict = {}


def _init_worker(trace: str, cpu_trace: str | None, snapshot: str, entries: int | None,
                 trace_events: int | None, base_dir: str) -> None:
    import fsdpprof.analyze.pipeline  # noqa: F401 - imports before the clock of the first case
    import fsdpprof.report.run_page  # noqa: F401
    _STATE["trace"] = load_trace_doc(trace, trace_events)
    _STATE["cpu_trace"] = load_trace_doc(cpu_trace, trace_events) if cpu_trace else None
    _STATE["snapshot"] = load_snapshot_obj(snapshot, entries)
    _STATE["workdir"] = tempfile.mkdtemp(prefix="w-", dir=base_dir)
    _STATE["render_cache"] = set()


def case_input(kind: str, index: int, seed: int) -> tuple[bytes, str, list[str]]:
    """One case's file: a mutated copy of the source, or (HOSTILE_SHARE of the cases, drawn from their own random
    stream, so that the other cases stay what they were) a hostile layout of it / a garbage snapshot."""
    rng = random.Random(f"{seed}:{kind}:{index}")
    hostile = random.Random(f"{seed}:{kind}:{index}:hostile")
    if kind == "trace":
        src = _STATE["cpu_trace"] if _STATE["cpu_trace"] is not None and index % 2 else _STATE["trace"]
        if hostile.random() < HOSTILE_SHARE:
            return hostile_trace_layout(src, hostile)
        return mutate_trace(src, rng)
    if hostile.random() < HOSTILE_SHARE:
        return garbage_snapshot(_STATE["snapshot"], hostile)
    return mutate_snapshot(_STATE["snapshot"], rng)


def _work(job: tuple) -> tuple[str, int, str, float, str, list[str]]:
    kind, index, seed, hang_s, full_every = job
    data, suffix, done = case_input(kind, index, seed)
    outcome, dt, detail = run_case(kind, data, suffix, _STATE["workdir"], hang_s, index % full_every == 0,
                                   _STATE["render_cache"])
    return kind, index, outcome, dt, detail, done


def run_campaign(n_traces: int, n_snapshots: int, seed: int = 1, workers: int = 2, *, trace=DEFAULT_TRACE,
                 cpu_trace=None, snapshot=DEFAULT_SNAPSHOT, snapshot_entries: int | None = 600,
                 hang_s: float = 10.0, only: list[tuple[str, int]] | None = None, full_every: int | dict = 1,
                 trace_events: int | None = None) -> dict:
    """Run the campaign; returns {"counts": {kind: {outcome: n}}, "max_s", "slowest", "failures": [...],
    "errors": {message: n}, "full": cases that went through the report path}.  Every case goes through
    the API; every ``full_every``-th (by index; an int, or per kind {"trace": n, "snapshot": m}) also
    through the report path."""
    every = full_every if isinstance(full_every, dict) else {"trace": full_every, "snapshot": full_every}
    jobs = only if only is not None else [("trace", i) for i in range(n_traces)] + \
        [("snapshot", i) for i in range(n_snapshots)]
    jobs = [(k, i, seed, hang_s, every[k]) for k, i in jobs]
    base_dir = tempfile.mkdtemp(prefix="fsdpprof-fuzz-")      # the cases' files; removed at the end
    init = (str(trace), str(cpu_trace) if cpu_trace else None, str(snapshot), snapshot_entries, trace_events, base_dir)
    counts = {k: dict.fromkeys(OUTCOMES, 0) for k in ("trace", "snapshot")}
    failures, max_s, slowest = [], 0.0, None
    errors: dict = {}

    def record(kind, index, outcome, dt, detail, done):
        nonlocal max_s, slowest
        counts[kind][outcome] += 1
        if dt > max_s:
            max_s, slowest = dt, (kind, index, outcome, done)
        if outcome == "user_error":          # grouped by message, the file and the numbers taken out
            key = re.sub(r"\d[\d,.]*", "N", re.sub(r"\S*fsdpprof-fuzz-[^/\s]+/w-[^/\s]+/", "", detail))[:160]
            errors[key] = errors.get(key, 0) + 1
        if outcome in FAILURES:
            failures.append({"kind": kind, "index": index, "outcome": outcome, "seconds": round(dt, 2),
                             "mutations": done, "detail": detail})

    try:
        if workers <= 1:
            _init_worker(*init)
            for r in _work_many(jobs):
                record(*r)
        else:
            _run_pool(jobs, workers, init, record)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    full = {k: sum(1 for j in jobs if j[0] == k and j[1] % every[k] == 0) for k in ("trace", "snapshot")}
    return {"counts": counts, "max_s": max_s, "slowest": slowest, "failures": failures, "errors": errors,
            "full": full}


def _work_many(jobs: list) -> list:
    return [_work(j) for j in jobs]


def _run_pool(jobs: list, workers: int, init: tuple, record) -> None:
    """Jobs in batches over a process pool. A worker that dies (a crash in C) breaks the pool: the
    unfinished batches are then run one at a time in a one-worker pool, a breaking batch is split into
    single jobs, and a single job that breaks the pool is recorded as ``crash``."""
    import concurrent.futures as cf
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("fork")
    batches = [jobs[i:i + 8] for i in range(0, len(jobs), 8)]
    pool = cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init)
    futs, left = {}, []
    for b in batches:
        try:
            futs[pool.submit(_work_many, b)] = b
        except BrokenProcessPool:                 # a worker already died: this batch waits for the one-by-one pass
            left.append(b)
    for fut in cf.as_completed(futs):
        try:
            for r in fut.result():
                record(*r)
        except BrokenProcessPool:
            left.append(futs[fut])
    pool.shutdown(wait=True)
    while left:                                   # only after a crash: find it, one batch at a time
        b = left.pop(0)
        pool = cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker, initargs=init)
        try:
            for r in pool.submit(_work_many, b).result():
                record(*r)
        except BrokenProcessPool:
            if len(b) == 1:
                record(b[0][0], b[0][1], "crash", 0.0, "the worker process died (a crash in C code?)", [])
            else:
                left[:0] = [[j] for j in b]
        pool.shutdown(wait=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=2000)
    ap.add_argument("--snapshots", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cpu-trace", default=None, help="a CPU recording's trace ([memory] events): half the trace cases")
    ap.add_argument("--trace-events", type=int, default=0, help="trim the traces to their first N events (0: all)")
    ap.add_argument("--snapshot", default=str(DEFAULT_SNAPSHOT))
    ap.add_argument("--snapshot-entries", type=int, default=600, help="trim the snapshot to this many entries (0: all)")
    ap.add_argument("--hang-s", type=float, default=10.0)
    ap.add_argument("--full-every", type=int, default=1,
                    help="every case goes through the API; every N-th also through the report path (default: all)")
    ap.add_argument("--only", nargs="+", default=None, metavar="KIND:INDEX", help="rerun these cases, e.g. trace:17")
    ap.add_argument("--show", type=int, default=5, help="failures printed in full")
    ap.add_argument("--errors", type=int, default=0, help="print the N most frequent clean error messages")
    args = ap.parse_args()
    only = [(x.split(":")[0], int(x.split(":")[1])) for x in args.only] if args.only else None
    t0 = time.perf_counter()
    res = run_campaign(args.traces, args.snapshots, args.seed, args.workers, trace=args.trace, cpu_trace=args.cpu_trace,
                       snapshot=args.snapshot, snapshot_entries=args.snapshot_entries or None, hang_s=args.hang_s,
                       only=only, full_every=args.full_every, trace_events=args.trace_events or None)
    wall = time.perf_counter() - t0
    print(f"fuzz campaign: seed {args.seed}, {wall:.1f} s wall, {args.workers} worker(s)")
    for kind, c in res["counts"].items():
        n = sum(c.values())
        if not n:
            continue
        print(f"  {kind:9s} cases {n:6d}  clean UserErrors {c['user_error']:6d}  successes {c['ok']:6d}  "
              f"other exceptions {c['exception']:4d}  internal {c['internal']:4d}  warnings {c['warning']:4d}  "
              f"multi-line {c['multiline']:4d}  implausible {c['implausible']:4d}  hangs (>{args.hang_s:.0f} s) {c['hang']:4d}  "
              f"crashes {c['crash']:3d}  (report path: {res['full'][kind]})")
    print(f"  max seconds per case {res['max_s']:.2f} ({res['slowest']})")
    by = {}
    for f in res["failures"]:
        by.setdefault((f["outcome"], f["detail"].strip().splitlines()[-1][:160] if f["detail"] else ""), []).append(f)
    for (outcome, last), fs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(fs):5d} x {outcome}: {last}  e.g. {fs[0]['kind']}:{fs[0]['index']} {fs[0]['mutations']}")
    for msg, n in sorted(res["errors"].items(), key=lambda kv: -kv[1])[: args.errors]:
        print(f"  {n:5d} x clean error: {msg}")
    for f in res["failures"][: args.show]:
        print(f"--- {f['kind']}:{f['index']} {f['outcome']} {f['mutations']}\n{f['detail']}")
    sys.exit(1 if res["failures"] else 0)


if __name__ == "__main__":
    main()
