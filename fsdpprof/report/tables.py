"""``fsdpprof report RUN --tables DIR``: every table of summary.json (a list of rows) as ``DIR/<key path>.csv``
(and ``.parquet`` with pyarrow), listed in ``DIR/tables.json``.  A row's nested values become columns (a dict:
``key.sub``; a list of plain values: joined by "; "; a list of rows: its JSON text), whole-number columns of
counts, sizes, steps and ranks are written as integers, and the root unit ("") as model.ROOT_UNIT_TEXT."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re

import numpy as np
import pandas as pd

from fsdpprof.analyze.model import ROOT_UNIT, ROOT_UNIT_TEXT
from fsdpprof.report.outputs import json_bytes, written_by_fsdpprof

TABLES_SCHEMA = "fsdpprof.tables/1"
INDEX_NAME = "tables.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


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
    integers, the root unit named."""
    df = pd.DataFrame.from_records([_flat(r) for r in rows])
    for c in df.columns:
        col = df[c]
        if _integer_column(c) and pd.api.types.is_float_dtype(col) and not pd.api.types.is_bool_dtype(col):
            vals = col.dropna().to_numpy(dtype=float)
            if np.isfinite(vals).all() and (vals == np.round(vals)).all() and (np.abs(vals) < 2.0**63).all():
                df[c] = col.astype("Int64")
        if c.rsplit(".", 1)[-1] in _UNIT_COLUMNS and (col.dtype == object or pd.api.types.is_string_dtype(col)):
            df[c] = col.map(lambda u: ROOT_UNIT_TEXT if u == ROOT_UNIT else u)
    return df


def summary_tables(doc: dict, prefix: str = "") -> dict[str, list[dict]]:
    """The tables of a plain summary: file name -> rows, in the summary's order."""
    out: dict[str, list[dict]] = {}
    for key, value in doc.items():
        name = f"{prefix}{_SAFE.sub('_', str(key))}"
        if _is_table(value):
            out[name] = value
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
        df = table_frame(rows)
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
