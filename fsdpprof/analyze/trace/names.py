"""What a name says, judged once: :func:`per_name` memoises a pure function of an event name per process (the
decoder, classify and labels all judge names through it: a name seen on every rank is judged once)."""
from __future__ import annotations

from itertools import repeat

_MISS = object()
NAME_MEMO: dict = {}         # fn -> {name: fn(name)}: each distinct name judged once per process
_MEMO_MAX = 200_000          # names remembered per function (then forgotten, all at once)


def per_name(fn, names: list) -> list:
    """``[fn(x) for x in names]``, each distinct name computed once per process (``fn`` must be pure)."""
    memo = NAME_MEMO.get(fn)
    if memo is None or len(memo) > _MEMO_MAX:
        memo = NAME_MEMO[fn] = {}
    out = list(map(memo.get, names, repeat(_MISS, len(names))))
    if out.count(_MISS):
        for i, v in enumerate(out):
            if v is _MISS:
                out[i] = memo[names[i]] = fn(names[i])
    return out
