"""Masks over label columns (categoricals or object arrays), judged once per distinct value and broadcast to the
rows through the codes: the one way every analysis tests labels.  Missing values never match.  Frames held
compressed (:class:`PackedFrame`).  Frames and values as JSON values (:func:`records`, :func:`json_safe`: NaN and
infinities as None), the one way summary.json, compare.json and ``to_dict`` write them."""
from __future__ import annotations

import math
import pickle
import zlib
from dataclasses import dataclass

import numpy as np
import pandas as pd


def codes_of(col) -> tuple[np.ndarray, list]:
    """(codes, distinct values) of a Series (categorical or not) or array; code -1 = missing."""
    if isinstance(getattr(col, "dtype", None), pd.CategoricalDtype):
        cat = col.cat if isinstance(col, pd.Series) else pd.Series(col).cat
        return np.asarray(cat.codes), list(cat.categories)
    codes, uniques = pd.factorize(np.asarray(col, dtype=object), use_na_sentinel=True)
    return codes, list(uniques)


def where_values(col, test) -> np.ndarray:
    """Rows whose value passes ``test(value) -> bool`` (called once per distinct value)."""
    codes, values = codes_of(col)
    hit = np.fromiter((bool(test(v)) for v in values), dtype=bool, count=len(values))
    return np.append(hit, False)[codes]


LABELS_DTYPE = pd.StringDtype("python", na_value=np.nan)   # pandas' str dtype, kept as references to the strings


def labels_array(values, n: int | None = None):
    """A column of labels (strings; None or NaN: missing) that keeps the strings it is given, to assign to a frame:
    pandas' str dtype in its Python storage, one reference a row.  (The default storage under pandas 3 copies every
    string into Arrow, whose pool keeps the memory: a recorded CPU run's 0.47 M allocations took 49 MiB for their
    labels.)  ``values``: an array, or one label repeated ``n`` times."""
    if n is not None:
        values = np.full(n, values, dtype=object)
    return pd.array(np.asarray(values, dtype=object), dtype=LABELS_DTYPE)


def distinct_ranks(rank: np.ndarray) -> np.ndarray:
    """The ranks of a rank column, sorted (one rank, the usual case: no sort of every row)."""
    if len(rank) and rank.min() == rank.max():
        return rank[:1].copy()
    return np.unique(rank)


def isin(col, labels) -> np.ndarray:
    """Rows whose value is one of ``labels``."""
    wanted = set(labels)
    return where_values(col, lambda v: v in wanted)


def startswith(col, prefixes) -> np.ndarray:
    """Rows whose value, as text, starts with one of ``prefixes``."""
    prefixes = tuple(prefixes)
    return where_values(col, lambda v: str(v).startswith(prefixes))


def on_device(lane) -> np.ndarray:
    """Rows on a device stream (``stream:N`` lanes), as opposed to CPU threads."""
    return startswith(lane, ("stream:",))


_COLUMN_INDEX: dict = {}        # tuple of column names -> its pd.Index (immutable: shared by the frames built)


def frame_of(columns: dict, order: list) -> pd.DataFrame:
    """``pd.DataFrame(columns, columns=order, copy=False)``, built without pandas' per-column checks when every
    column is a 1-D non-object numpy array or Categorical of one length (0.12 vs 0.8 ms for an events frame)."""
    arrays = [columns[c] for c in order]
    n = len(arrays[0]) if arrays else 0
    plain = all(type(a) is np.ndarray and a.ndim == 1 and a.dtype != object or isinstance(a, pd.Categorical)
                for a in arrays) and all(len(a) == n for a in arrays)
    if plain:
        try:
            from pandas.core.internals.construction import arrays_to_mgr
            key = tuple(order)
            index = _COLUMN_INDEX.get(key)
            if index is None:
                index = _COLUMN_INDEX[key] = pd.Index(list(order))
            mgr = arrays_to_mgr(arrays, index, pd.RangeIndex(n), verify_integrity=False, consolidate=False)
            return pd.DataFrame._from_mgr(mgr, axes=mgr.axes)
        except (ImportError, AttributeError, TypeError, ValueError):     # pragma: no cover - another pandas
            pass
    return pd.DataFrame(columns, columns=order, copy=False)


def column_arrays(df: pd.DataFrame) -> list:
    """``[df[c].array for c in df.columns]`` (no copies) without building a Series per column."""
    it = getattr(df, "_iter_column_arrays", None)
    if it is not None:
        try:
            out = list(it())
            if len(out) == df.shape[1]:
                return out
        except (TypeError, ValueError, AttributeError):     # pragma: no cover - another pandas
            pass
    return [df.iloc[:, i].array for i in range(df.shape[1])]


@dataclass(frozen=True)
class PackedFrame:
    """A frame held compressed (zlib of its pickle, ~5x smaller for a rank's chain or operator table): a per-rank
    table that only the reduce reads travels from its worker and waits in the parent this way.  Lossless:
    :func:`unpacked` gives the frame back exactly (dtypes, float64 times, categories, index).  Only fsdpprof's own
    workers' results are unpacked."""

    rows: int
    data: bytes

    def __len__(self) -> int:
        return self.rows


def packed(df: pd.DataFrame | None) -> PackedFrame | None:
    """``df`` as a :class:`PackedFrame` (None as None)."""
    return None if df is None else PackedFrame(len(df), zlib.compress(pickle.dumps(df, protocol=5), 6))


def unpacked(x) -> pd.DataFrame | None:
    """The frame of a :class:`PackedFrame` (a frame or None as it is)."""
    return pickle.loads(zlib.decompress(x.data)) if isinstance(x, PackedFrame) else x


# --------------------------------------------------------------------------- frames as JSON values
def _scalar(x):
    """One value made JSON-safe (numpy scalars -> python, NaN/inf -> None)."""
    if x is None or x is pd.NA or x is pd.NaT:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, (int, str)):
        return x
    if isinstance(x, pd.Timestamp):
        return x.isoformat()
    return str(x)


def _column_values(col) -> list:
    """One column's values, JSON-safe (numpy numbers at once by ``tolist``, NaN and infinities as None)."""
    dt = col.dtype
    if isinstance(dt, np.dtype) and dt.kind in "fiub":
        a = np.asarray(col)
        values = a.tolist()
        if dt.kind == "f":
            finite = np.isfinite(a)
            if not finite.all():
                values = [v if ok else None for v, ok in zip(values, finite.tolist())]
        return values
    return [json_safe(v) for v in col.tolist()]


def records(df: pd.DataFrame | None) -> list[dict] | None:
    """A DataFrame as a list of JSON-safe row dicts (None stays None)."""
    if df is None:
        return None
    cols = [str(c) for c in df.columns]
    if not cols:
        return [{} for _ in range(len(df))]
    columns = [_column_values(a) for a in column_arrays(df)]
    return [dict(zip(cols, row)) for row in zip(*columns)]


def json_safe(x):
    """Any nesting of dicts, lists, DataFrames and numpy/pandas scalars as plain JSON values (NaN, inf -> None)."""
    t = type(x)                        # (the plain values first: most of a summary's million values are)
    if t is str or t is int or t is bool or x is None:
        return x
    if t is float:
        return x if math.isfinite(x) else None
    if t is dict:
        return {k if type(k) is str else str(k): json_safe(v) for k, v in x.items()}
    if t is list:
        return [json_safe(v) for v in x]
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, pd.DataFrame):
        return records(x)
    return _scalar(x)
