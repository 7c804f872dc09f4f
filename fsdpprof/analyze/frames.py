"""Masks over label columns, judged once per distinct value (the one way every analysis tests labels).

Label columns are categoricals (names interned to integer codes) or object arrays; a test runs on
the distinct values and is broadcast to the rows through the codes, so no per-row Python string work.
Missing values never match.
"""
from __future__ import annotations

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
