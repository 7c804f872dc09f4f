"""``fsdpprof report RUN --tables DIR``: every table of summary.json (a list of rows of plain values) as
``DIR/<key path>.csv`` (and ``.parquet`` with pyarrow), listed in ``DIR/tables.json``."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re

import pandas as pd

from fsdpprof.report.outputs import json_bytes, written_by_fsdpprof

TABLES_SCHEMA = "fsdpprof.tables/1"
INDEX_NAME = "tables.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _is_table(value) -> bool:
    return (isinstance(value, list) and bool(value) and all(isinstance(r, dict) and r for r in value)
            and all(not isinstance(v, (dict, list)) for r in value for v in r.values()))


def _is_nested_table(value) -> bool:
    """Rows whose values are plain, or tables themselves (summary.json's critical_path.steps and their segments)."""
    return (isinstance(value, list) and bool(value) and all(isinstance(r, dict) and r for r in value)
            and all(not isinstance(v, (dict, list)) or _is_table(v) or v == [] for r in value for v in r.values()))


def summary_tables(doc: dict, prefix: str = "") -> dict[str, list[dict]]:
    """The tables of a plain summary: file name -> rows, in the summary's order.  Rows holding tables become two:
    ``name`` (their plain values) and ``name.<key>`` (the inner rows, each led by its row's first value)."""
    out: dict[str, list[dict]] = {}
    for key, value in doc.items():
        name = f"{prefix}{_SAFE.sub('_', str(key))}"
        if _is_table(value):
            out[name] = value
        elif _is_nested_table(value):
            out[name] = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in value]
            first = next(iter(value[0]))
            for inner in dict.fromkeys(k for r in value for k, v in r.items() if isinstance(v, list)):
                rows = [{first: r[first], **x} for r in value for x in r.get(inner) or []]
                if rows:
                    out[f"{name}.{_SAFE.sub('_', str(inner))}"] = rows
        elif isinstance(value, dict):
            out.update(summary_tables(value, name + "."))
    return out


def parquet_available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def table_files(doc: dict, directory: str) -> list[tuple[str, bytes]]:
    """(path, bytes) of every table of ``doc`` in ``directory`` (CSV, Parquet with pyarrow) and of the index."""
    items, index = [], []
    parquet = parquet_available()
    for name, rows in summary_tables(doc).items():
        df = pd.DataFrame.from_records(rows)
        path = os.path.join(directory, name + ".csv")
        items.append((path, df.to_csv(index=False).encode()))
        entry = {"table": name, "rows": len(df), "csv": os.path.basename(path)}
        if parquet:
            buf = io.BytesIO()
            try:
                df.to_parquet(buf, index=False)
            except (TypeError, ValueError, ImportError) as exc:   # a column of mixed types
                entry["parquet_error"] = str(exc).splitlines()[0][:200]
            else:
                items.append((os.path.join(directory, name + ".parquet"), buf.getvalue()))
                entry["parquet"] = name + ".parquet"
        index.append(entry)
    items.append((os.path.join(directory, INDEX_NAME), json_bytes({"schema": TABLES_SCHEMA, "tables": index})))
    return items


def listed_files(directory: str) -> set[str]:
    """The files the ``tables.json`` that fsdpprof wrote in ``directory`` lists (empty when there is none)."""
    index = os.path.join(directory, INDEX_NAME)
    if not written_by_fsdpprof(index):
        return set()
    try:
        with open(index, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return set()
    out = set()
    for t in doc.get("tables") or []:
        for k in ("csv", "parquet"):
            if isinstance(t, dict) and isinstance(t.get(k), str) and os.path.basename(t[k]) == t[k]:
                out.add(os.path.join(directory, t[k]))
    return out
