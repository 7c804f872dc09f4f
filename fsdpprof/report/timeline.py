"""``fsdpprof timeline``'s file (:mod:`fsdpprof.analyze.trace.timeline_file`): every rank of a run as one process
of one chrome trace (gzip) on one clock, its events as its profiler wrote them but for the process id and the time
(less the rank's offset, a whole number of µs), beside fsdpprof's tracks (category TRACK_CAT)."""
from __future__ import annotations

import gzip
import math

import msgspec

from fsdpprof.version import __version__
from fsdpprof.analyze.load.files import SOURCE_RUN_DIR, with_inventory
from fsdpprof.analyze.trace.timeline_file import (META_KEY, PARTS_KEY, TIMELINE_SCHEMA, TRACE_META_KEYS,
                                                  TRACK_CAT, TRACK_TID_BASE)
from fsdpprof.errors import UserError

WARN_BYTES = 10**9              # a timeline bigger than this (JSON) is slow in Perfetto (its limit is about 2 GB)
BATCH_EVENTS = 20_000           # events encoded at a time
_PROCESS_META = frozenset({"process_name", "process_labels", "process_sort_index"})
# fsdpprof's tracks, in the order they are shown above the rank's own threads
TRACK_STEP, TRACK_STAGE, TRACK_PHASE, TRACK_UNIT, TRACK_EXPOSED, TRACK_CRITICAL, TRACK_MEMORY, TRACK_FINDINGS = (
    "step", "stage", "FSDP phase", "FSDP unit", "exposed communication", "critical path", "memory allocated (bytes)",
    "findings")
_ENC = msgspec.json.Encoder()


def _shift(ts, off: float):
    """``ts`` - ``off`` (a whole number of µs): an int stays an int."""
    if type(ts) is int:
        return ts - int(off)
    return ts - off


def _shifted_meta(meta: dict, off: float) -> dict:
    """A rank's trace metadata on the timeline's clock (baseTimeNanoseconds moved by the offset)."""
    out = {k: meta[k] for k in TRACE_META_KEYS if k in meta}
    base = out.get("baseTimeNanoseconds")
    if isinstance(base, int) and not isinstance(base, bool):
        out["baseTimeNanoseconds"] = base + int(off) * 1000
    return out


def _shifted_info(info: dict, off: float) -> dict:
    """rank.json on the timeline's clock (its clock anchor moved by the offset)."""
    out = dict(info or {})
    a = out.get("clock_anchor")
    if isinstance(a, dict):
        a = dict(a)
        if isinstance(a.get("base_time_ns"), (int, float)):
            a["base_time_ns"] = a["base_time_ns"] + int(off) * 1000
        if isinstance(a.get("profiler_us"), (int, float)):
            a["profiler_us"] = a["profiler_us"] - off
        out["clock_anchor"] = a
    return out


def _keep(e: dict, window) -> bool:
    if window is None or e.get("ph") == "M":
        return True
    ts = e.get("ts")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return True
    dur = e.get("dur") if isinstance(e.get("dur"), (int, float)) else 0
    return ts <= window[1] and ts + dur >= window[0]


def rank_events(path: str, pid: int, off: float, window=None, part_pid: int | None = None, kept: dict | None = None):
    """The events of one rank's trace in ``window`` (µs on its own clock; None: all) with process id ``pid`` and
    times less ``off``, but its process metadata. ``part_pid``: ``path`` is a timeline, the rank its process
    ``part_pid``. ``kept`` gets what the rank's own file needs again: ``pids`` (thread id -> original process id)
    and ``process_events`` ([position among the events kept, event])."""
    kept = {} if kept is None else kept
    pids, process_events = kept.setdefault("pids", {}), kept.setdefault("process_events", [])
    n_kept = 0
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise UserError(f"trace {path} is not valid JSON ({exc}); re-export or re-copy it") from None
    del raw
    for e in (doc.get("traceEvents") or []) if isinstance(doc, dict) else []:
        if not isinstance(e, dict):
            continue
        if part_pid is not None and (e.get("pid") != part_pid or e.get("cat") == TRACK_CAT or (
                type(e.get("tid")) is int and e["tid"] >= TRACK_TID_BASE)):
            continue
        if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
            if part_pid is None:            # (where it was among the events kept: readers care about the order)
                process_events.append([n_kept, e])
            continue
        if part_pid is None and type(e.get("tid")) in (int, str):
            pids.setdefault(e["tid"], e.get("pid"))
        if not _keep(e, window):
            continue
        e["pid"] = pid
        ts = e.get("ts")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool):
            e["ts"] = _shift(ts, off)
        n_kept += 1
        yield e


def _num(x):
    """A number as JSON takes it (NaN / inf: None; numpy: plain)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(f):
        return None
    return int(f) if f.is_integer() and abs(f) < 2 ** 53 else f


def track_events(t, pid: int, findings: list, places) -> list[dict]:
    """fsdpprof's tracks of one rank (:class:`fsdpprof.analyze.timeline.RankTracks`) as chrome-trace events on the
    timeline's clock: thread names, spans (X), counters (C) and instants (i)."""
    off, win = t.offset_us, t.window
    tids: dict[str, int] = {}
    out: list[dict] = []

    def tid(name: str) -> int:
        if name not in tids:
            tids[name] = TRACK_TID_BASE + len(tids)
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[name],
                        "args": {"name": f"fsdpprof: {name}"}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tids[name],
                        "args": {"sort_index": -1000 + len(tids)}})
        return tids[name]

    def inside(s, e) -> bool:
        return win is None or (s <= win[1] and e >= win[0])

    def span(track: str, name: str, s: float, e: float, args: dict) -> None:
        if inside(s, e):
            out.append({"ph": "X", "cat": TRACK_CAT, "name": name, "pid": pid, "tid": tid(track),
                        "ts": s - off, "dur": max(e - s, 0.0), "args": args})

    for r in t.steps.itertuples(index=False):
        span(TRACK_STEP, f"step {_num(r.step)}", r.start_us, r.end_us, {"step": _num(r.step)})
    for r in t.stages.itertuples(index=False):
        span(TRACK_STAGE, str(r.stage), r.start_us, r.end_us, {"step": _num(r.step), "stage": str(r.stage)})
    several = t.fsdp["lane"].nunique() > 1 if len(t.fsdp) else False
    for r in t.fsdp.itertuples(index=False):
        track = f"{TRACK_PHASE} ({r.lane})" if several else TRACK_PHASE
        span(track, str(r.fsdp_phase), r.start_us, r.end_us, {"fsdp_phase": str(r.fsdp_phase), "unit": r.unit})
    several = t.units["lane"].nunique() > 1 if len(t.units) else False
    for r in t.units.itertuples(index=False):
        track = f"{TRACK_UNIT} ({r.lane})" if several else TRACK_UNIT
        span(track, r.unit or "(root)", r.start_us, r.end_us, {"unit": r.unit})
    for r in t.exposed.itertuples(index=False):
        span(f"{TRACK_EXPOSED}: {r.collective}", str(r.collective), r.start_us, r.end_us,
             {"collective": str(r.collective), "exposed_us": _num(r.end_us - r.start_us)})
    for r in t.critical.itertuples(index=False) if t.critical is not None else []:
        what = r.what if isinstance(r.what, str) and r.what else None
        span(TRACK_CRITICAL, f"{r.kind}: {what}" if what else str(r.kind), r.start_us, r.end_us,
             {"step": _num(r.step), "kind": str(r.kind), "what": what,
              "unit": r.unit if isinstance(r.unit, str) else None,
              "stage": r.stage if isinstance(r.stage, str) else None, "dur_us": _num(r.end_us - r.start_us)})
    if t.memory is not None and len(t.memory):
        m = t.memory
        cats = [c for c in m.columns if c != "ts_us" and (m[c] != 0).any()]
        ts = m["ts_us"].to_numpy()
        for i in range(len(m)):
            if inside(ts[i], ts[i]):
                out.append({"ph": "C", "cat": TRACK_CAT, "name": TRACK_MEMORY, "pid": pid, "tid": tid(TRACK_MEMORY),
                            "ts": float(ts[i]) - off, "args": {c: int(m[c].iat[i]) for c in cats}})
    for p in places.itertuples(index=False) if places is not None and len(places) else []:
        if int(p.rank) != t.rank or not inside(p.start_us, p.end_us):
            continue
        f = findings[int(p.number) - 1]
        out.append({"ph": "i", "s": "p", "cat": TRACK_CAT, "name": f"finding {int(p.number)}: {f.title}", "pid": pid,
                    "tid": tid(TRACK_FINDINGS), "ts": float(p.start_us) - off,
                    "args": {"number": int(p.number), "summary_key": f"findings[{int(p.number) - 1}]", "id": f.id,
                             "severity": f.severity, "metric": f.metric, "value": _num(f.value), "unit": f.unit,
                             "suggestion": f.suggestion, "start_us": _num(p.start_us - off),
                             "end_us": _num(p.end_us - off)}})
    return out


def timeline_meta(run, tl, wanted_steps) -> dict:
    """The timeline's ``otherData``: schema, input, clock alignment, each rank's process, offset and trace metadata."""
    al = tl.alignment.set_index("rank")
    ranks = []
    for r, t in sorted(tl.ranks.items()):
        rd = run.ranks[r]
        part = {"rank": r, "pid": int(r), "label": rd.label, "offset_us": _num(t.offset_us),
                "residual_us": _num(t.residual_us), "trace": _shifted_meta(rd.trace_meta or {}, t.offset_us)}
        if run.source == SOURCE_RUN_DIR:
            part["info"] = _shifted_info(rd.info, t.offset_us)
            with_inv, _ = with_inventory(rd)
            if with_inv.inventory is not None:   # what the rank held before the window (the memory's baseline)
                part["inventory"] = with_inv.inventory
        ranks.append(part)
    method = str(al["method"].iat[0]) if len(al) else None
    return {"schema": TIMELINE_SCHEMA, "generator": f"fsdpprof {__version__}", "input": str(run.path),
            "clock": {"method": method, "notes": list(tl.notes)}, "steps": wanted_steps, "ranks": ranks,
            "tracks": {"category": TRACK_CAT, "first_tid": TRACK_TID_BASE,
                       "names": [TRACK_STEP, TRACK_STAGE, TRACK_PHASE, TRACK_UNIT, TRACK_EXPOSED, TRACK_CRITICAL,
                                 TRACK_MEMORY, TRACK_FINDINGS]},
            "findings_key": "findings"}


def timeline_writer(run, tl, wanted_steps=None, sizes: dict | None = None):
    """A function writing the timeline (gzip) into a binary file, for outputs.write_files; ``sizes`` gets
    ``json_bytes``, the JSON's size."""
    sizes = {} if sizes is None else sizes

    def write(fh) -> None:
        n = 0
        kept: dict = {}
        with gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=3, mtime=0) as gz:
            def put(b: bytes) -> None:
                nonlocal n
                gz.write(b)
                n += len(b)

            put(b'{"' + META_KEY.encode() + b'":' + _ENC.encode(timeline_meta(run, tl, wanted_steps))
                + b',"displayTimeUnit":"ms","traceEvents":[')
            first = True

            def batch(events: list) -> None:
                nonlocal first
                if events:
                    body = _ENC.encode(events)[1:-1]
                    put(body if first else b"," + body)
                    first = False

            for r, t in sorted(tl.ranks.items()):
                pid = int(r)
                host = (run.ranks[r].info or {}).get("host")
                head = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {r}"}},
                        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": r}}]
                if host:
                    head.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                                 "args": {"labels": str(host)}})
                batch(head + track_events(t, pid, tl.findings, tl.places))
                buf: list = []
                rd = run.ranks[r]
                kept[r] = {}
                for e in rank_events(rd.trace_path, pid, t.offset_us, t.window, rd.trace_pid, kept[r]):
                    buf.append(e)
                    if len(buf) >= BATCH_EVENTS:
                        batch(buf)
                        buf = []
                batch(buf)
            # per rank what its own file needs again (timeline_file.write_rank_part)
            put(b'],"' + PARTS_KEY.encode() + b'":' + _ENC.encode(
                {str(r): {"pids": [[t, p] for t, p in k.get("pids", {}).items()],
                          "process_events": k.get("process_events", [])} for r, k in kept.items()}) + b"}\n")
        sizes["json_bytes"] = n

    return write
