"""``fsdpprof report RUN --tables DIR``: every table of summary.json (a list of rows) as ``DIR/<key path>.csv``
(and ``.parquet`` with pyarrow), listed in ``DIR/tables.json``.  A row's nested values become columns (a dict:
``key.sub``; a list of plain values: joined by "; "; a list of rows: its JSON text, but rows whose only nested
values are tables become two tables, ``name`` and ``name.<key>``), whole-number columns of
counts, sizes, steps and ranks are written as integers, and the root unit ("") as model.ROOT_UNIT_TEXT.

Every CSV fsdpprof writes goes through :func:`csv_bytes`: a text cell (or header) that a spreadsheet would run as
a formula (it starts with ``= + - @``, a tab or a carriage return; OWASP's CSV-injection rule) gets a leading
``'``; numbers stay numbers, and an integer beyond 64 bits is written as its digits (text).  Parquet keeps the raw
typed values (such an integer: a string column).  ``tables.json`` records each file's size and SHA-256 and the
folder it was written in (path, device, inode): a later ``--tables`` replaces a listed file only while it is
still what fsdpprof wrote there; a copied or edited file is the user's (``--force``)."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import stat

import numpy as np
import pandas as pd

from fsdpprof import runfmt
from fsdpprof.analyze.model import ROOT_UNIT, ROOT_UNIT_TEXT
from fsdpprof.report.outputs import json_bytes, written_by_fsdpprof

TABLES_SCHEMA = "fsdpprof.tables/2"
INDEX_NAME = "tables.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")      # OWASP: what a spreadsheet reads as the start of a formula
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


# columns whose values are whole numbers by meaning (a median of them may not be: such a column stays float)
_INTEGER_COLUMNS = frozenset({"rank", "step", "seq", "count", "steps", "n_ranks", "world_size", "shard_group",
                              "replicas", "peak_rank", "last_rank", "worst_rank", "group_size", "addr", "segments",
                              "free_blocks", "numel", "calls", "ranks"})
_UNIT_COLUMNS = frozenset({"unit"})
_BYTES_DICTS = frozenset({"breakdown"})     # nested dicts of bytes per category (what-if predictions)


def _is_table(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) and r for r in value)


def _flat(row: dict, prefix: str = "") -> dict:
    """A row with its nested values as plain columns (see the module's docstring)."""
    out = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list):
            out[key] = (json.dumps(v, default=str) if any(isinstance(x, (dict, list)) for x in v)
                        else "; ".join(map(str, v)))
        else:
            out[key] = v
    return out


def _integer_column(name: str) -> bool:
    parts = name.split(".")
    base = parts[-1]
    return (base in _INTEGER_COLUMNS or base == "bytes" or base.endswith(("_bytes", "_count"))
            or (len(parts) > 1 and parts[-2] in _BYTES_DICTS))


def table_frame(rows: list[dict]) -> pd.DataFrame:
    """One summary table as written: nested values flattened, whole-number counts / sizes as (nullable)
    integers, the root unit named; a column holding an integer beyond 64 bits holds text (its digits) instead."""
    rows = [_flat(r) for r in rows]
    huge = {k for r in rows for k, v in r.items() if is_huge_int(v)}
    if huge:
        rows = [{k: str(v) if k in huge and v is not None else v for k, v in r.items()} for r in rows]
    df = pd.DataFrame.from_records(rows)
    for c in df.columns:
        col = df[c]
        if _integer_column(c) and pd.api.types.is_float_dtype(col) and not pd.api.types.is_bool_dtype(col):
            vals = col.dropna().to_numpy(dtype=float)
            if np.isfinite(vals).all() and (vals == np.round(vals)).all() and (np.abs(vals) < 2.0**63).all():
                df[c] = col.astype("Int64")
        if c.rsplit(".", 1)[-1] in _UNIT_COLUMNS and (col.dtype == object or pd.api.types.is_string_dtype(col)):
            df[c] = col.map(lambda u: ROOT_UNIT_TEXT if u == ROOT_UNIT else u)
    return df


def _is_nested_table(value) -> bool:
    """Rows whose values are plain or tables themselves, at least one a table (summary.json's
    critical_path.steps and their segments)."""
    return (_is_table(value) and all(not isinstance(v, (dict, list)) or _is_table(v) or v == []
                                     for r in value for v in r.values())
            and any(_is_table(v) for r in value for v in r.values()))


def is_formula(text: str) -> bool:
    """A text a spreadsheet would run as a formula: it starts with = + - @, tab or CR and is not a plain number."""
    return text[:1] in FORMULA_START and not _NUMBER.fullmatch(text)


def csv_cell(value):
    """``value`` as a CSV cell: a formula-like text with a leading ``'``, an integer beyond 64 bits as its digits
    (text), anything else as it is (numbers stay numbers)."""
    if isinstance(value, str):
        return "'" + value if is_formula(value) else value
    if is_huge_int(value):
        return str(value)
    return value


def is_huge_int(value) -> bool:
    """An integer outside 64 bits (signed): no CSV reader or Parquet column reads it as a number."""
    return isinstance(value, int) and not isinstance(value, bool) and not runfmt.INT64_MIN <= value <= runfmt.INT64_MAX


def csv_bytes(df: pd.DataFrame) -> bytes:
    """``df`` as CSV (no index, CRLF line ends), every text cell and header through :func:`csv_cell`: what every
    CSV of fsdpprof is written with."""
    cols = {}
    for i in range(df.shape[1]):
        col = df.iloc[:, i]
        if col.dtype == object or isinstance(col.dtype, pd.StringDtype):
            col = col.map(csv_cell, na_action="ignore").astype(object)
        cols[i] = col
    out = pd.DataFrame(cols, index=df.index)
    out.columns = [csv_cell(str(c)) for c in df.columns]
    # RFC 4180's CRLF: a cell holding a CR is then quoted as one holding a LF (with "\n" alone a bare CR would
    # end the row for most readers)
    return out.to_csv(index=False, lineterminator="\r\n").encode()


def _parquet_bytes(df: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _folder_id(directory: str) -> dict:
    st = os.stat(directory)
    return {"path": os.path.realpath(directory), "device": st.st_dev, "inode": st.st_ino}


def summary_tables(doc: dict, prefix: str = "") -> dict[str, list[dict]]:
    """The tables of a plain summary: file name -> rows, in the summary's order.  Rows holding tables become two:
    ``name`` (their plain values) and ``name.<key>`` (the inner rows, each led by its row's first value)."""
    out: dict[str, list[dict]] = {}
    for key, value in doc.items():
        name = f"{prefix}{_SAFE.sub('_', str(key))}"
        if _is_nested_table(value):
            out[name] = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in value]
            first = next(iter(value[0]))
            for inner in dict.fromkeys(k for r in value for k, v in r.items() if isinstance(v, list)):
                rows = [{first: r[first], **x} for r in value for x in r.get(inner) or []]
                if rows:
                    out[f"{name}.{_SAFE.sub('_', str(inner))}"] = rows
        elif _is_table(value):
            out[name] = value
        elif isinstance(value, dict):
            out.update(summary_tables(value, name + "."))
    return out


def parquet_available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def table_files(doc: dict, directory: str) -> list[tuple[str, object]]:
    """(path, bytes) of every table of ``doc`` in ``directory`` (CSV, Parquet with pyarrow) and of the index (a
    function: it names the folder as it is once made)."""
    items, index = [], []
    parquet = parquet_available()
    for name, rows in summary_tables(doc).items():
        df = table_frame(rows)
        path = os.path.join(directory, name + ".csv")
        data = csv_bytes(df)
        items.append((path, data))
        entry = {"table": name, "rows": len(df), "csv": os.path.basename(path), "csv_bytes": len(data),
                 "csv_sha256": _digest(data)}
        if parquet:
            try:
                data = _parquet_bytes(df)
            except (TypeError, ValueError, ImportError, OverflowError) as exc:   # a column of mixed types
                entry["parquet_error"] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            else:
                items.append((os.path.join(directory, name + ".parquet"), data))
                entry.update(parquet=name + ".parquet", parquet_bytes=len(data), parquet_sha256=_digest(data))
        index.append(entry)

    def write_index(fh) -> None:
        fh.write(json_bytes({"schema": TABLES_SCHEMA, "folder": _folder_id(directory), "tables": index}))
    items.append((os.path.join(directory, INDEX_NAME), write_index))
    return items


def listed_files(directory: str) -> set[str]:
    """The files in ``directory`` that fsdpprof wrote there and nobody changed since: listed in the
    ``tables.json`` fsdpprof wrote for this very folder (path, device and inode), with the size and SHA-256 it
    recorded.  Empty when there is no such index (a copied one grants nothing)."""
    index = os.path.join(directory, INDEX_NAME)
    if not written_by_fsdpprof(index):
        return set()
    try:
        with open(index, encoding="utf-8") as fh:
            doc = json.load(fh)
        here = _folder_id(directory)
    except (OSError, ValueError):
        return set()
    if not isinstance(doc, dict) or doc.get("schema") != TABLES_SCHEMA or doc.get("folder") != here:
        return set()
    out = set()
    for t in doc.get("tables") if isinstance(doc.get("tables"), list) else []:
        for k in ("csv", "parquet"):
            name = t.get(k) if isinstance(t, dict) else None
            if isinstance(name, str) and name and os.path.basename(name) == name and name not in (".", ".."):
                path = os.path.join(directory, name)
                if _unchanged(path, t.get(f"{k}_bytes"), t.get(f"{k}_sha256")):
                    out.add(path)
    return out


def _unchanged(path: str, size, sha256) -> bool:
    """``path`` is a regular file of ``size`` bytes whose SHA-256 is ``sha256``."""
    if type(size) is not int or not isinstance(sha256, str):
        return False
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest() == sha256
    except OSError:
        return False
