"""The merged timeline ``fsdpprof timeline`` writes, as an input: a gzipped chrome trace whose first key,
``otherData``, holds ``schema`` (TIMELINE_SCHEMA) and per rank its pid, time offset (µs) and trace metadata.  Each
rank is one process: its original events, and fsdpprof's tracks (category TRACK_CAT, threads from TRACK_TID_BASE
on, which the decoder skips)."""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import zlib

from fsdpprof import runfmt
from fsdpprof.errors import UserError

TIMELINE_SCHEMA = "fsdpprof.timeline/1"
META_KEY = "otherData"              # chrome-trace's own key for a trace's metadata
PARTS_KEY = "fsdpprofParts"          # after the events: per rank its threads' original process ids, process metadata
TRACK_CAT = "fsdpprof"              # the category of every event fsdpprof adds
TRACK_TID_BASE = 2_000_000_000      # the thread ids of fsdpprof's tracks (beyond any thread or stream id)
_MARK = re.compile(rb'\s*\{\s*"otherData"\s*:\s*\{\s*"schema"\s*:\s*"fsdpprof\.timeline/([0-9]+)"')
HEAD_MAX_BYTES = 64 << 20           # the metadata must end within this many bytes of JSON
# a rank's own trace metadata, kept per rank in otherData (what the rank's analysis reads of it)
TRACE_META_KEYS = ("schemaVersion", "distributedInfo", "deviceProperties", "baseTimeNanoseconds", "traceName")


@contextlib.contextmanager
def _open(path: str):
    """The file's bytes (inflated when it is gzipped), the file closed after."""
    with open(path, "rb") as fh:
        gzipped = fh.read(2) == b"\x1f\x8b"
        fh.seek(0)
        if gzipped:
            with gzip.GzipFile(fileobj=fh) as gz:
                yield gz
        else:
            yield fh


def is_timeline(head: bytes) -> bool:
    """The first bytes of a file's JSON are those of a merged timeline."""
    return bool(_MARK.match(head))


def timeline_meta(path: str) -> dict | None:
    """The ``otherData`` of a merged timeline, None when ``path`` is not one (or unreadable: the trace's parse
    says why).  UserError for a newer schema or cut metadata."""
    try:
        with _open(path) as src:
            head = src.read(4096)
            m = _MARK.match(head)
            if not m:
                return None
            if int(m.group(1)) > 1:
                raise UserError(f"{path} is a timeline of a newer fsdpprof (schema fsdpprof.timeline/"
                                f"{int(m.group(1))}); upgrade fsdpprof")
            start = head.index(b"{", head.index(b'"otherData"'))
            dec = json.JSONDecoder(parse_int=runfmt.int64_or_none)
            while True:
                try:
                    meta, _ = dec.raw_decode(head[start:].decode("utf-8", "replace"))
                    break
                except ValueError:
                    more = src.read(max(len(head), 1 << 20))
                    if not more or len(head) > HEAD_MAX_BYTES:
                        raise UserError(f"{path}: its timeline metadata is cut or not valid JSON; write it again "
                                        f"with fsdpprof timeline") from None
                    head += more
    except (OSError, EOFError, zlib.error):        # (a gzip header, then noise: the trace's own parse says why)
        return None
    return meta if isinstance(meta, dict) else None


def rank_parts(meta: dict, path: str = "the timeline") -> list[dict]:
    """The ranks of a timeline's metadata: rank, pid, label, offset_us, trace (the rank's trace metadata), info.
    UserError naming the field for what fsdpprof timeline never writes (a hand-edited file): a rank or pid that is
    not a whole number >= 0 or is another rank's, trace / info that are not objects, an offset that is not a
    number, a label that is not text."""
    ranks = meta.get("ranks")
    fix = "write it again with fsdpprof timeline"
    if ranks is None:
        return []
    if not isinstance(ranks, list):
        raise UserError(f"{path}: otherData.ranks is {type(ranks).__name__}, not a list of ranks; {fix}")
    out, ranks_seen, pids_seen = [], {}, {}
    for i, p in enumerate(ranks):
        where = f"{path}: otherData.ranks[{i}]"
        if not isinstance(p, dict):
            raise UserError(f"{where} is {type(p).__name__}, not an object; {fix}")
        for key in ("rank", "pid"):
            v = p.get(key)
            if type(v) is not int or v < 0:
                raise UserError(f"{where}.{key} is {_shown(v)}, not a whole number >= 0; {fix}")
        for key, types, what in (("trace", dict, "an object"), ("info", dict, "an object"),
                                 ("label", str, "text"), ("offset_us", (int, float), "a number")):
            v = p.get(key)
            if v is not None and (not isinstance(v, types) or isinstance(v, bool)):
                raise UserError(f"{where}.{key} is {_shown(v)}, not {what}; {fix}")
        if p["rank"] in ranks_seen:
            raise UserError(f"{where}.rank {p['rank']} is also otherData.ranks[{ranks_seen[p['rank']]}]'s: each "
                            f"rank once; {fix}")
        if p["pid"] in pids_seen:
            raise UserError(f"{where}.pid {p['pid']} is also otherData.ranks[{pids_seen[p['pid']]}]'s: each rank "
                            f"needs its own process id (its events are told apart by it); {fix}")
        ranks_seen[p["rank"]], pids_seen[p["pid"]] = i, i
        out.append(p)
    return out


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def write_rank_part(path: str, part: dict, out_path: str) -> None:
    """One rank's original events of a merged timeline as a gzipped trace of their own, on the timeline's clock,
    with its process ids and metadata back and fsdpprof's tracks left out (what HTA reads).  ``part``: an entry of
    :func:`rank_parts`."""
    import msgspec

    with _open(path) as src:
        doc = msgspec.json.decode(src.read())
    pid = part["pid"]
    events = [e for e in doc.get("traceEvents") or []
              if isinstance(e, dict) and e.get("pid") == pid and e.get("cat") != TRACK_CAT
              and not (isinstance(e.get("tid"), int) and e["tid"] >= TRACK_TID_BASE)
              and not (e.get("ph") == "M" and e.get("name") in ("process_name", "process_labels",
                                                                 "process_sort_index"))]
    # the original process ids and process metadata back (HTA tells the host from the device by them)
    kept = ((doc.get(PARTS_KEY) or {}) if isinstance(doc.get(PARTS_KEY), dict) else {}).get(str(part.get("rank")))
    if isinstance(kept, dict):
        pids = {t: p for t, p in kept.get("pids") or [] if type(t) in (int, str)}
        for e in events:
            if e.get("tid") in pids:
                e["pid"] = pids[e["tid"]]
        for k, (at, e) in enumerate(x for x in kept.get("process_events") or []
                                    if isinstance(x, list) and len(x) == 2 and type(x[0]) is int):
            events.insert(at + k, e)
    meta = part.get("trace") or {}
    head = {k: meta[k] for k in TRACE_META_KEYS if k in meta}
    tmp = out_path + ".part"
    with gzip.open(tmp, "wb", compresslevel=1) as fh:
        # the metadata as json writes it ('"rank": 3', with the blank HTA's reader looks for), then the events
        fh.write(json.dumps(head)[:-1].encode() + (b", " if head else b"") + b'"traceEvents": '
                 + msgspec.json.encode(events) + b"}")
    os.replace(tmp, out_path)
