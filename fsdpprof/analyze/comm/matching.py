"""Collective calls matched across ranks by identity, every match checked (µs, bytes).

A call (one row of :func:`fsdpprof.analyze.comm.skew.collective_records`) is identified by its process group
(``pg``), type (``collective``), size (``bytes``, NaN where the trace does not say) and dtype, and by its sequence
number where the trace has one (``by_seq``: ``key`` is that number).

- With sequence numbers: the calls of one (pg, seq) are one match; a member whose type, size or dtype differs from
  the group's most common identity is refused.
- Without: per process group each rank's calls, in time order, are aligned with the sequence of the rank that made
  the most calls (the reference), as a maximum-weight common subsequence of compatible identities (same type;
  size and dtype equal where both are known): calls missing on one side (sampled traces, window edges, ranks
  recorded at other steps) are left out, never shifted onto their neighbours.  A rank whose sequence is the
  reference's and whose calls end where the reference's do (position by position, on the clocks as recorded or
  as the caller's prior puts them) is matched position by position; the others go through the alignment (a
  table of at most ``DP_CELLS_MAX`` cells, else a band of ``BAND_HALF`` calls around the diagonal), whose pairs
  weigh more the closer their ends lie on those clocks: where a shift of a repeating sequence and a clock offset
  would explain the calls equally, the pairing closest to the clocks given is taken.
- Every match is then checked on aligned clocks, and a member is refused unless it overlaps the others in time
  within ``tolerance_us`` (a call cannot end before its peers start: so the ends lie closer than the
  collective's own duration plus the tolerance).  The clocks: as given (recorded, or fsdpprof's clock anchors)
  or aligned on the ends of the matches that pass (a rank's offset: the median of its end - the match's mean
  end, iterated from all type/size-compatible candidates), whichever passes more calls (:func:`_end_check`;
  gloo's ends on one busy host can lie milliseconds apart, so aligning on them may shift the clocks a host
  shares).
- A call whose process group the trace does not name, in a group smaller than the ranks that made such calls
  (HSDP's shard and replicate groups in a trace without group names), is refused: its peers cannot be told.
Refused and unmatched calls get ``match_id`` -1 and are never used by skew, stragglers or clock alignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

MATCH_TOLERANCE_US = 250.0   # clock error allowed when checking that a match's members overlap in time (see _end_check)
DP_CELLS_MAX = 4_000_000     # a full alignment table up to this many cells (rank calls x reference calls)
BAND_HALF = 512              # beyond it: a band of this many calls either side of the diagonal
MATCHED, REFUSED, UNMATCHED = "matched", "refused", "unmatched"
REASON_IDENTITY = "type, size or dtype differs from the other ranks' call with the same sequence number"
REASON_ENDS = ("does not overlap the other ranks' calls in time: the ends lie further apart than the collective's "
               "own duration plus the tolerance")
REASON_ALONE = "every other member of its match was refused"
REASON_GROUP = "its process group is not named and is smaller than the ranks that made such calls"
PG_UNNAMED = "default"       # skew.collective_records' pg of a call whose process group the trace does not name
MATCH_COLUMNS = ["match_id", "match_status"]
_CHECK_ROUNDS = 4


@dataclass
class MatchStats:
    """How the calls of a run matched across ranks: counts of calls (one rank's call = one), ``collectives``
    the matched collectives (distinct ``match_id``), ``reasons`` refusal reason -> calls, ``tolerance_us`` the
    end check's tolerance, ``size_checked_pct`` the share of matched calls whose size was known and checked."""

    matched: int = 0
    refused: int = 0
    unmatched: int = 0
    collectives: int = 0
    tolerance_us: float = MATCH_TOLERANCE_US
    size_checked_pct: float = float("nan")
    reasons: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"matched_calls": self.matched, "refused_calls": self.refused, "unmatched_calls": self.unmatched,
                "matched_collectives": self.collectives, "tolerance_us": self.tolerance_us,
                "size_checked_pct": None if self.size_checked_pct != self.size_checked_pct
                else round(float(self.size_checked_pct), 3),
                "refusals": dict(self.reasons)}


# --------------------------------------------------------------------------- identities
def _identity(r: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(collective code, bytes (NaN unknown), dtype code (-1 unknown), exact token code) per row."""
    coll = pd.factorize(r["collective"].astype(str).to_numpy())[0]
    size = pd.to_numeric(r["bytes"], errors="coerce").to_numpy(np.float64) if "bytes" in r \
        else np.full(len(r), np.nan)
    if "dtype" in r:
        d = r["dtype"].astype(object).to_numpy()
        d = np.where(pd.isna(d), None, d)
        dt = pd.factorize(d, use_na_sentinel=True)[0]
    else:
        dt = np.full(len(r), -1, dtype=np.int64)
    tok = pd.MultiIndex.from_arrays([coll, np.nan_to_num(size, nan=-1.0), dt]).factorize()[0] if len(r) \
        else np.zeros(0, dtype=np.int64)
    return coll, size, dt, tok


def _compatible(ci, si, di, cj, sj, dj) -> np.ndarray:
    """Same type; size and dtype equal where both are known (broadcasting)."""
    return (ci == cj) & (np.isnan(si) | np.isnan(sj) | (si == sj)) & ((di < 0) | (dj < 0) | (di == dj))


# --------------------------------------------------------------------------- alignment (bounded DP)
def _band(n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row i (0..n) of the table, the columns [lo, hi] it covers (inclusive, 0..m)."""
    if n * m <= DP_CELLS_MAX:
        return np.zeros(n + 1, dtype=np.int64), np.full(n + 1, m, dtype=np.int64)
    centre = np.arange(n + 1) * (m / max(n, 1))
    lo = np.maximum(np.floor(centre).astype(np.int64) - BAND_HALF, 0)
    hi = np.minimum(np.ceil(centre).astype(np.int64) + BAND_HALF, m)
    return np.maximum.accumulate(lo), np.maximum.accumulate(hi)


def align(score_row, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight common subsequence of two sequences of n and m calls: (i, j) index pairs, increasing.
    ``score_row(i, cols)``: the weights of pairing call i with calls ``cols`` of the other (> 0; -inf: not
    compatible).  Each row is one vectorised step (a cumulative max), bounded by :func:`_band`."""
    if n == 0 or m == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo, hi = _band(n, m)
    rows = [np.zeros(hi[0] - lo[0] + 1)]
    for i in range(1, n + 1):
        prev, plo, phi = rows[-1], lo[i - 1], hi[i - 1]
        j = np.arange(lo[i], hi[i] + 1)
        up = prev[np.minimum(j, phi) - plo]                       # from the row above (gaps are free)
        diag = np.full(j.size, -np.inf)
        ok = (j >= 1) & (j - 1 >= plo)
        if ok.any():
            jj = j[ok]
            diag[ok] = prev[np.minimum(jj - 1, phi) - plo] + score_row(i - 1, jj - 1)
        rows.append(np.maximum.accumulate(np.maximum(up, diag)))
    pi, pj = [], []
    i, j = n, int(hi[n])
    j = min(j, m)
    while i > 0 and j > lo[i] - 1:
        row, rlo = rows[i], lo[i]
        v = row[j - rlo]
        if j > rlo and row[j - 1 - rlo] == v:
            j -= 1
            continue
        plo, phi = lo[i - 1], hi[i - 1]
        if rows[i - 1][min(j, phi) - plo] == v:
            i, j = i - 1, min(j, phi)
            continue
        if j == 0:
            break
        pi.append(i - 1)
        pj.append(j - 1)
        i, j = i - 1, min(j - 1, phi)
    return np.asarray(pi[::-1], dtype=np.int64), np.asarray(pj[::-1], dtype=np.int64)


def _pair_rank(a: np.ndarray, b: np.ndarray, coll, size, dt, end, dur, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows a (one rank's calls, time order) paired with rows b (the reference's): (a rows, b rows) paired.
    ``end``: on the clocks as given (the prior); a first alignment weighs compatible pairs by how close their ends
    lie on those clocks, a second (only where the first left pairs further apart than their duration) on the
    offset the first one's pairs agree on."""
    ca, sa, da, ea, ua = coll[a], size[a], dt[a], end[a], dur[a]
    cb, sb, db, eb, ub = coll[b], size[b], dt[b], end[b], dur[b]

    def timed(off: float):
        def score(i, cols):     # compatible calls weigh 0.5 .. 1, the closer their ends (less ``off``) the more
            ok = _compatible(ca[i], sa[i], da[i], cb[cols], sb[cols], db[cols])
            miss = np.abs(ea[i] - eb[cols] - off) / (np.maximum(ua[i], ub[cols]) + tol)
            return np.where(ok, 1.0 - 0.5 * np.minimum(miss, 1.0), -np.inf)
        return score

    i, j = align(timed(0.0), a.size, b.size)
    if not i.size:
        return a[i], b[j]
    delta = ea[i] - eb[j]
    off = float(np.median(delta))
    if (np.abs(delta - off) <= np.maximum(ua[i], ub[j]) + tol).all():
        return a[i], b[j]
    i, j = align(timed(off), a.size, b.size)
    return a[i], b[j]


def _sequence_ids(r: pd.DataFrame, rows: np.ndarray, coll, size, dt, tok, end, dur, tol: float,
                  first_id: int) -> tuple[np.ndarray, int]:
    """Tentative match ids (-1: none) for ``rows`` (calls without a sequence number), per process group.  A rank
    whose sequence of identities is the reference's, with the ends of its calls position by position no further
    from the reference's than their duration plus ``tol`` (each from the median distance, and that median on the
    clocks given), is matched by position;
    the others are aligned (:func:`_pair_rank`)."""
    mid = np.full(len(r), -1, dtype=np.int64)
    if not rows.size:
        return mid, first_id
    sub = pd.DataFrame({"row": rows, "pg": r["pg"].to_numpy()[rows], "rank": r["rank"].to_numpy()[rows],
                        "ts": r["ts_us"].to_numpy()[rows], "tok": tok[rows]})
    sub = sub.sort_values(["pg", "rank", "ts"], kind="mergesort")
    sub["pos"] = sub.groupby(["pg", "rank"], sort=False).cumcount().to_numpy()
    next_id = first_id
    for _, g in sub.groupby("pg", sort=False):
        counts = g.groupby("rank", sort=True).size()
        ref = int(counts.idxmax())                      # the most calls (lowest rank on ties)
        seqs = g.groupby("rank", sort=True)["tok"].agg(tuple)
        same = seqs.index[seqs.map(lambda s, r0=seqs[ref]: s == r0).to_numpy()]
        b = g.loc[g["rank"] == ref, "row"].to_numpy()
        cand = g[g["rank"].isin(same)]
        rb = b[cand["pos"].to_numpy()]
        ra = cand["row"].to_numpy()
        t = pd.DataFrame({"rank": cand["rank"].to_numpy(), "d": end[ra] - end[rb],
                          "bound": np.maximum(dur[ra], dur[rb]) + tol})
        med = t.groupby("rank")["d"].transform("median").to_numpy()
        t["near"] = (np.abs(t["d"].to_numpy()) <= t["bound"].to_numpy() + np.abs(med)) & \
            (np.abs(t["d"].to_numpy() - med) <= t["bound"].to_numpy())
        per = t.groupby("rank").agg(near=("near", "all"), d=("d", "median"), bound=("bound", "median"))
        in_time = per.index[(per["near"] & (per["d"].abs() <= per["bound"])).to_numpy()]
        pos_match = cand[cand["rank"].isin(in_time)]
        mid[pos_match["row"].to_numpy()] = next_id + pos_match["pos"].to_numpy()
        g_rank, g_row = g["rank"].to_numpy(), g["row"].to_numpy()        # sorted by rank: one slice per rank
        ranks, first = np.unique(g_rank, return_index=True)
        bounds = dict(zip(ranks.tolist(), zip(first.tolist(), np.r_[first[1:], g_rank.size].tolist())))
        for rank in seqs.index.difference(in_time).tolist():
            lo, hi = bounds[rank]
            pa, pb = _pair_rank(g_row[lo:hi], b, coll, size, dt, end, dur, tol)
            mid[pa] = mid[pb]
        next_id += len(b)
    return mid, next_id


# --------------------------------------------------------------------------- the check on aligned clocks
def _offsets(rank: np.ndarray, mid: np.ndarray, end: np.ndarray, use: np.ndarray) -> pd.Series:
    """Per rank: the median of (its end - the match's mean end) over the ``use`` rows of matches kept by >= 2."""
    d = pd.DataFrame({"rank": rank[use], "mid": mid[use], "end": end[use]})
    n = d.groupby("mid")["rank"].transform("size").to_numpy()
    d = d[n > 1]
    if not len(d):
        return pd.Series(dtype=float)
    dev = d["end"] - d.groupby("mid")["end"].transform("mean")
    return dev.groupby(d["rank"]).median()


def _others_extreme(mid: np.ndarray, x: np.ndarray, largest: bool) -> np.ndarray:
    """Per row: the largest (``largest``) or smallest ``x`` among the other rows of its ``mid`` (±inf: none)."""
    sign = 1.0 if largest else -1.0
    v = sign * x
    order = np.lexsort((-v, mid))
    m, vs = mid[order], v[order]
    first = np.r_[True, m[1:] != m[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(m.size), 0))
    top = vs[start]
    second = np.where(start + 1 < m.size, vs[np.minimum(start + 1, m.size - 1)], -np.inf)
    second = np.where((start + 1 < m.size) & (m[np.minimum(start + 1, m.size - 1)] == m), second, -np.inf)
    out_sorted = np.where(np.arange(m.size) == start, second, top)
    out = np.empty_like(out_sorted)
    out[order] = out_sorted
    return sign * out


def _overlapping(mid: np.ndarray, s: np.ndarray, e: np.ndarray, tol: float) -> np.ndarray:
    """Per row (one member of match ``mid``, start ``s`` and end ``e`` on one clock): True where it overlaps the
    others within ``tol``: with one other member, it ends no earlier than the other starts and starts no later
    than the other ends; with more, the same against the members' median start and median end (one member far
    off does not fail the others)."""
    t = pd.DataFrame({"m": mid, "s": s, "e": e})
    g = t.groupby("m")
    n = g["s"].transform("size").to_numpy()
    pair = (e >= _others_extreme(mid, s, True) - tol) & (s <= _others_extreme(mid, e, False) + tol)
    many = (e >= g["s"].transform("median").to_numpy() - tol) & (s <= g["e"].transform("median").to_numpy() + tol)
    return np.where(n == 2, pair, many)


def _end_check(rank, mid, ts, end, tol: float, tentative: np.ndarray, prior) -> np.ndarray:
    """Per row: True where the call overlaps its match's other members in time within ``tol``
    (:func:`_overlapping`: so the ends lie closer than the collective's own duration plus ``tol``) on aligned
    clocks: the clocks as given (``prior``: per row the µs to subtract, fsdpprof's clock anchors or 0) or aligned on
    the ends of the passing matches (iterated from all candidates), whichever passes more calls."""
    idx = np.flatnonzero(tentative)
    m = mid[idx]
    given = np.zeros(len(rank), dtype=bool)
    p = (prior[idx] if np.ndim(prior) else np.full(idx.size, float(prior)))
    given[idx[_overlapping(m, ts[idx] - p, end[idx] - p, tol)]] = True
    ok = tentative.copy()
    for _ in range(_CHECK_ROUNDS):
        off = _offsets(rank, mid, end, ok)
        o = pd.Series(rank[idx]).map(off).fillna(0.0).to_numpy()
        new = np.zeros_like(ok)
        new[idx[_overlapping(m, ts[idx] - o, end[idx] - o, tol)]] = True
        if (new == ok).all():
            break
        ok = new
    return given if given.sum() >= ok.sum() else ok


def clock_prior(anchors_us: dict | None) -> pd.Series | None:
    """The ``clock_prior_us`` of :func:`match_collectives` from fsdpprof's clock anchors (rank -> µs to add to its
    trace times for Unix time), when every rank has one; else None (the clocks as recorded)."""
    if not anchors_us or any(a is None or not np.isfinite(a) for a in anchors_us.values()):
        return None
    return pd.Series({int(r): -float(a) for r, a in anchors_us.items()})


# --------------------------------------------------------------------------- entry point
def match_collectives(records: pd.DataFrame, tolerance_us: float = MATCH_TOLERANCE_US,
                      clock_prior_us: pd.Series | None = None) -> tuple[pd.DataFrame, MatchStats]:
    """``records`` (skew.collective_records: rank, pg, collective, key, by_seq, ts_us, end_us; bytes and dtype
    where known) plus ``match_id`` (int64; the same id = the same collective call on several ranks; -1: unmatched
    or refused) and ``match_status`` (MATCHED / REFUSED / UNMATCHED), and the counts (:class:`MatchStats`).
    ``clock_prior_us``: rank -> µs to subtract from its times to put the ranks on one clock as far as known
    (fsdpprof's clock anchors); none: the clocks as recorded.  Where a shift of a repeating sequence and a clock
    offset would explain the calls equally, the pairing closest to these clocks is taken."""
    r = records.reset_index(drop=True)
    n = len(r)
    stats = MatchStats(tolerance_us=float(tolerance_us))
    if n == 0:
        return r.assign(match_id=np.zeros(0, dtype=np.int64), match_status=np.zeros(0, dtype=object)), stats
    coll, size, dt, tok = _identity(r)
    rank = r["rank"].to_numpy().astype(np.int64)
    ts, end = r["ts_us"].to_numpy(np.float64), r["end_us"].to_numpy(np.float64)
    dur = np.maximum(end - ts, 0.0)
    by_seq = r["by_seq"].to_numpy().astype(bool) if "by_seq" in r else np.zeros(n, dtype=bool)
    status = np.full(n, UNMATCHED, dtype=object)
    reason = np.full(n, None, dtype=object)
    pg = r["pg"].astype(str).to_numpy()
    if "group_size" in r:        # unnamed groups smaller than the ranks calling in them: peers unknown
        gs = pd.to_numeric(r["group_size"], errors="coerce").to_numpy(np.float64)
        ranks_in = pd.Series(rank).groupby(pg).transform("nunique").to_numpy()
        unknown = (pg == PG_UNNAMED) & (gs < ranks_in)
        status[unknown], reason[unknown] = REFUSED, REASON_GROUP
    else:
        unknown = np.zeros(n, dtype=bool)

    # with sequence numbers: (pg, seq); the group's most common identity decides
    mid = np.full(n, -1, dtype=np.int64)
    next_id = 0
    s = np.flatnonzero(by_seq & ~unknown)
    if s.size:
        gid = pd.MultiIndex.from_arrays([r["pg"].to_numpy()[s], r["key"].to_numpy()[s]]).factorize()[0]
        t = pd.DataFrame({"gid": gid, "tok": tok[s]})
        modal_tok = t.groupby(["gid", "tok"]).size().reset_index(name="n").sort_values(
            ["gid", "n"], ascending=[True, False], kind="mergesort").drop_duplicates("gid").set_index("gid")["tok"]
        first_of_tok = pd.Series(np.arange(n)[s]).groupby(tok[s]).first()
        m = first_of_tok.reindex(modal_tok.reindex(gid).to_numpy()).to_numpy()
        agree = _compatible(coll[s], size[s], dt[s], coll[m], size[m], dt[m])
        bad = s[~agree]
        status[bad], reason[bad] = REFUSED, REASON_IDENTITY
        mid[s[agree]] = gid[agree]
        next_id = int(gid.max()) + 1 if gid.size else 0
    # without: aligned as sequences per process group
    prior = pd.Series(rank).map(clock_prior_us).fillna(0.0).to_numpy(np.float64) if clock_prior_us is not None \
        else 0.0
    seq_mid, next_id = _sequence_ids(r, np.flatnonzero(~by_seq & ~unknown), coll, size, dt, tok, end - prior, dur,
                                     float(tolerance_us), next_id)
    mid = np.where(by_seq, mid, seq_mid)

    # only ids held by >= 2 ranks are candidates; then every member's end is checked on aligned clocks
    held = pd.Series(mid).groupby(mid).transform("size").to_numpy()
    tentative = (mid >= 0) & (held > 1)
    passed = _end_check(rank, mid, ts, end, float(tolerance_us), tentative, prior)
    refused_ends = tentative & ~passed
    status[refused_ends], reason[refused_ends] = REFUSED, REASON_ENDS
    keep = np.where(passed, mid, -1)
    left = pd.Series(keep).groupby(keep).transform("size").to_numpy()
    alone = passed & (left < 2)
    status[alone], reason[alone] = REFUSED, REASON_ALONE
    ok = passed & ~alone
    status[ok] = MATCHED
    final = np.where(ok, mid, -1).astype(np.int64)

    out = r.assign(match_id=final, match_status=status)
    stats.matched, stats.refused = int(ok.sum()), int((status == REFUSED).sum())
    stats.unmatched = n - stats.matched - stats.refused
    stats.collectives = int(np.unique(final[ok]).size)
    if stats.matched:
        stats.size_checked_pct = 100.0 * float((~np.isnan(size[ok])).mean())
    if stats.refused:
        stats.reasons = {str(k): int(v) for k, v in pd.Series(reason[status == REFUSED]).value_counts().items()}
    return out, stats
