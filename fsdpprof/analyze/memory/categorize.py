"""Label every allocation with a :class:`MemoryCategory` by ordered, named passes (as
torch/profiler/_memory_profiler.py), each filling only what is still unknown and naming itself in ``category_source``:
``c10 count`` (CPU runs: the bytes of threads the profiler does not record), ``inventory`` (exact, by storage address), FSDP roles from ``frames`` / ``sizes``, phase ``tags``, stack ``frames``,
``lifetime`` (stage at the allocation vs at the free), ``before_recording``, ``other``.  Labels (stage, fsdp_phase,
unit, free_stage, free_fsdp_phase) are :mod:`fsdpprof.analyze.model`'s; times in µs.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.analyze.load.frames import labels_array
from fsdpprof.analyze.model import MemoryCategory as MC

CATEGORIES = model.MEMORY_CATEGORIES
OTHER_THREADS_COLUMN = "other_threads_row"   # bool: the row carries other threads' bytes, not one allocation

ROLE_TO_CATEGORY = {runfmt.ROLE_PARAM: MC.SHARDED_PARAM.value, runfmt.ROLE_GRAD: MC.SHARDED_GRAD.value,
                    runfmt.ROLE_OPTIMIZER_STATE: MC.OPTIMIZER_STATE.value}


# --------------------------------------------------------------------------- unit scopes (CPU traces)
def unit_scopes(ann: pd.DataFrame) -> pd.DataFrame:
    """Unit scopes (ts_us, end_us, unit): each pre-forward / pre-backward of a unit to its last post hook."""
    named = ann[ann["unit"].notna()]
    rows = []
    for pre, posts in ((model.PHASE_PRE_FORWARD, model.POST_FORWARD_PHASES),
                       (model.PHASE_PRE_BACKWARD, model.POST_BACKWARD_PHASES)):
        a = named[named["fsdp_phase"] == pre]
        b = named[named["fsdp_phase"].isin(posts)]
        if not len(a) or not len(b):
            continue
        for unit, ga in a.groupby("unit", sort=False):
            gb = b[b["unit"] == unit]
            if not len(gb):
                continue
            ends, starts = gb["end_us"].to_numpy(), ga["ts_us"].to_numpy()
            for s in starts:
                nxt = starts[starts > s]
                later = ends[(ends >= s) & (ends < (nxt.min() if len(nxt) else np.inf))]
                if len(later):
                    rows.append((s, later.max(), unit))
    return pd.DataFrame(rows, columns=["ts_us", "end_us", "unit"])


def paint(ts: np.ndarray, intervals: pd.DataFrame, col: str) -> np.ndarray:
    """Label ``col`` of the innermost (latest-starting) interval containing each time; None elsewhere."""
    out = np.full(len(ts), None, dtype=object)
    if intervals is None or not len(intervals) or not len(ts):
        return out
    iv = intervals.sort_values("ts_us", kind="stable")
    bounds = np.unique(np.concatenate([iv["ts_us"].to_numpy(float), iv["end_us"].to_numpy(float)]))
    labels = np.full(len(bounds), None, dtype=object)
    lo = np.searchsorted(bounds, iv["ts_us"].to_numpy(float))
    hi = np.searchsorted(bounds, iv["end_us"].to_numpy(float))
    for a, b, lab in zip(lo, hi, iv[col].to_numpy(object)):
        labels[a:b] = lab
    pos = np.searchsorted(bounds, ts, side="right") - 1
    ok = pos >= 0
    out[ok] = labels[pos[ok]]
    return out


# --------------------------------------------------------------------------- tags and frames (snapshots)
_KV_RE = re.compile(r"(phase|unit|fsdp_phase|module|fqn)[=:]([^;,|\s]*)")


def parse_tags(meta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our ``_set_memory_metadata`` tags (JSON ``{"phase":..,"unit":..}`` or ``phase=..;unit=..``, optionally
    prefixed ``fsdpprof:``) -> (fsdp_phase, unit) object arrays, None where untagged."""
    codes, uniq = pd.factorize(meta)       # missing -> -1, read as ""
    n_u = len(uniq)
    phases = np.full(n_u + 1, None, dtype=object)   # slot n_u: missing (parsed as "")
    units = np.full(n_u + 1, None, dtype=object)
    for j, s in enumerate(list(uniq) + [""]):
        phase = unit = None
        t = str(s).strip()
        if t.startswith("fsdpprof"):
            t = t[8:].lstrip(": ")
        if t.startswith("{"):
            try:
                d = json.loads(t)
                phase = d.get("phase") or d.get("fsdp_phase")
                unit = d.get("unit", d.get("module", d.get("fqn")))
            except (ValueError, AttributeError, RecursionError):
                pass
            # tags come from the file: only strings are phases / units
            phase = phase if isinstance(phase, str) else None
            unit = unit if isinstance(unit, str) else None
        elif t:
            for k, v in _KV_RE.findall(t):
                if k in ("phase", "fsdp_phase"):
                    phase = v.strip() or None
                else:
                    unit = v.strip() or None
        phases[j], units[j] = phase, unit
    codes = np.where(codes < 0, n_u, codes)
    return phases[codes], units[codes]


def stack_codes(frames) -> tuple[np.ndarray, list]:
    """Distinct stacks of ``frames`` (frame lists or None): (codes int32, stacks), code 0 = no frames; equal stacks
    share a code (looked up by length and a few frame ids, since snapshots share frame objects, confirmed by ==)."""
    buckets: dict[tuple, list] = {}      # cheap key -> [(stack, code), ...]
    stacks: list = [None]
    codes = np.zeros(len(frames), dtype=np.int32)
    for i, fr in enumerate(frames):
        if not fr:
            continue
        n = len(fr)
        key = (n, id(fr[0]), id(fr[n >> 2]), id(fr[n >> 1]), id(fr[(3 * n) >> 2]), id(fr[-1]))
        cands = buckets.get(key)
        c = 0
        if cands is not None:
            for stack, sc in cands:
                if stack == fr:
                    c = sc
                    break
        if not c:
            c = len(stacks)
            stacks.append(fr)
            buckets.setdefault(key, []).append((fr, c))
        codes[i] = c
    return codes, stacks


def signatures(frames, stacks: tuple[np.ndarray, list] | None = None) -> pd.Categorical:
    """Signature of each stack in ``frames`` (frame lists or None): its distinct telling frames
    (``name@package/path.py``, autograd's C++ frames) joined by ``|``; each distinct stack and frame judged once."""
    codes, distinct = stacks if stacks is not None else stack_codes(frames)
    part_by_id: dict[int, str] = {}
    sigs: list[str] = [""]
    for fr in distinct[1:]:
        ids = list(map(id, fr))
        new = set(ids).difference(part_by_id)
        if new:
            by_id = dict(zip(ids, fr))
            for k in new:
                part_by_id[k] = _frame_part(by_id[k])
        # distinct non-empty parts in stack order
        sigs.append("|".join(dict.fromkeys(filter(None, map(part_by_id.__getitem__, ids)))))
    # equal signatures from different stacks share a category
    uniq, inv = np.unique(np.array(sigs, dtype=object), return_inverse=True)
    return pd.Categorical.from_codes(inv[codes].astype(np.int32), categories=pd.Index(uniq, dtype=object))


def _frame_part(f) -> str:
    if type(f) is not dict:           # frames come from the file: anything else is an unknown frame
        return ""
    fn, name = f.get("filename") or "", f.get("name") or ""
    fn = fn[:1024] if type(fn) is str else ""           # (a long shared string is scanned once per frame)
    name = name[:1024] if type(name) is str else ""
    if fn and fn != "??" and not fn.endswith((".cpp", ".h", ".cu", ".cc", ".hpp", ".cuh")):
        path = fn.lower().replace("\\", "/")
        # keep the package-relative part (torch/optim/adam.py), enough for the rules and short to scan
        cut = path.rfind("-packages/")
        path = path[cut + 10:] if cut >= 0 else "/".join(path.rsplit("/", 3)[-3:])
        return f"{name.lower()}@{path}"
    low = name.lower()
    if "accumulategrad" in low:
        return "accumulategrad@"
    if "autograd::engine" in low or "evaluate_function" in low or "python_engine" in low:
        return "autograd::engine@"
    if "backward" in low and "autograd" in low:
        return "backward0@"
    return ""


def _contains(sig, pat: str, regex: bool = True, need: tuple[str, ...] = ()) -> np.ndarray:
    """``str.contains`` once per distinct value of ``sig`` (Categorical or strings; missing never matches).
    ``need``: substrings every match holds one of (the regex is skipped without them: C++ stacks are long)."""
    cat = sig.array if isinstance(sig, pd.Series) else sig
    if not isinstance(cat, pd.Categorical):
        cat = pd.Categorical(pd.Series(np.asarray(sig, dtype=object)).fillna("").astype(object))
    cats = cat.categories
    if regex:
        rx = re.compile(pat)
        hit = np.fromiter(((not need or any(n in c for n in need)) and rx.search(c) is not None for c in cats),
                          dtype=bool, count=len(cats))
    else:
        hit = np.fromiter((pat in c for c in cats), dtype=bool, count=len(cats))
    codes = np.asarray(cat.codes)
    return np.where(codes >= 0, hit[np.maximum(codes, 0)], False) if len(hit) else np.zeros(len(cat), bool)


def _role_pattern(functions: tuple[str, ...], file: str) -> str:
    names = "|".join(re.escape(f.lower()) for f in functions)
    return rf"(?:^|\|)(?:{names})@[^|]*{re.escape(file.lower())}(?:\||$)"


_ROLE_RULES = [(role, _role_pattern(fns, file), (file.lower(),)) for role, fns, file in model.FSDP_FRAME_ROLES]


def frame_fsdp_role(sig) -> np.ndarray:
    """FSDP role of each allocation (model.FSDP_FRAME_ROLES: all-gather input / output, copy-out, reduce-scatter,
    sharded param) from the FSDP2 / FSDP1 function in its stack frames; None where no FSDP function made it."""
    if not len(sig) or not _contains(sig, r"_fsdp_|flat_param|_runtime_utils",
                                     need=("_fsdp_", "flat_param", "_runtime_utils")).any():
        return np.full(len(sig), None, dtype=object)
    return frame_rule(sig, _ROLE_RULES)


def fsdp_family_of_frames(sig) -> str | None:
    """``fsdp2`` / ``fsdp1`` when allocations were made under FSDP2 / FSDP1 source files (model.*_FRAME_FILES)."""
    for fam, files in ((model.FAMILY_FSDP2, model.FSDP2_FRAME_FILES), (model.FAMILY_FSDP1, model.FSDP1_FRAME_FILES)):
        pat = r"@[^|]*(?:" + "|".join(re.escape(f) for f in files) + r")(?:\||$)"
        if _contains(sig, pat, need=tuple(files)).any():
            return fam
    return None


def frame_rule(sig, rules) -> np.ndarray:
    """The label of the first of ``rules`` (label, pattern, need) each signature matches (model.STAGE_FRAME_RULES,
    model.FSDP_PHASE_FRAME_RULES); None where none does."""
    conds = [_contains(sig, pat, need=need) for _, pat, need in rules]
    return np.select(conds, [r[0] for r in rules], None).astype(object)


# --------------------------------------------------------------------------- the passes
# Passes take the allocations DataFrame or a dict of numpy arrays; a missing label (None or NaN) matches nothing.
def _col(df, name: str) -> np.ndarray:
    """Column ``name`` of a DataFrame or a dict of arrays, as a numpy array."""
    c = df[name]
    return c.to_numpy() if hasattr(c, "to_numpy") else np.asarray(c)


def _isin(values: np.ndarray, labels) -> np.ndarray:
    """``Series.isin`` for an object array (missing never matches)."""
    return _Codes(values).isin(labels)


def _eq(a: np.ndarray, b) -> np.ndarray:
    """Elementwise ``==`` of object arrays (or with a scalar) as pandas does it: missing is never equal."""
    return np.asarray(a == b, dtype=bool) & ~pd.isna(a)


class _Codes:
    """An object array of labels factorized once, so membership and missing tests are integer work."""

    def __init__(self, values: np.ndarray):
        self.codes, uniques = pd.factorize(np.asarray(values, dtype=object))   # missing -> -1
        self.uniques = list(uniques)

    def isin(self, labels) -> np.ndarray:
        """Elementwise membership in ``labels`` (missing never matches)."""
        hit = [any(u == lab for lab in labels) for u in self.uniques] + [False]
        return np.asarray(hit, dtype=bool)[self.codes]

    def eq(self, label) -> np.ndarray:
        return self.isin((label,))

    def notna(self) -> np.ndarray:
        return self.codes >= 0


class _Labels:
    """The category being decided for each allocation; ``is_open``: no pass has labelled it yet."""

    def __init__(self, n: int):
        self.cat = np.full(n, None, dtype=object)
        self.src = np.full(n, None, dtype=object)
        self.is_open = np.ones(n, dtype=bool)


def _fill(lab: _Labels, mask, category: str, source: str) -> None:
    m = np.asarray(mask, dtype=bool) & lab.is_open
    if m.any():
        lab.cat[m] = category
        lab.src[m] = source
        lab.is_open[m] = False


def pass_inventory(df, lab: _Labels, inv_tensors: pd.DataFrame | None) -> None:
    """Exact labels: ``inv_tensors`` (addr, category, ref_us, unit, name) matched to the allocation at
    that address alive at the reference time (capture time)."""
    if inv_tensors is None or not len(inv_tensors):
        return
    n = len(lab.cat)
    a = pd.DataFrame({"index": np.arange(n), "addr": _col(df, "addr"), "alloc_us": _col(df, "alloc_us"),
                      "free_us": _col(df, "free_us")})
    m = a.merge(inv_tensors, on="addr", how="inner")
    free = m["free_us"].fillna(np.inf)
    m = m[(m["alloc_us"] <= m["ref_us"]) & (m["ref_us"] < free)]
    m = m.drop_duplicates("index")
    if not len(m):
        return
    pos = m["index"].to_numpy()
    open_ = lab.is_open[pos]
    pos, m = pos[open_], m[open_]
    lab.cat[pos] = m["category"].to_numpy(object)
    lab.src[pos] = "inventory"
    lab.is_open[pos] = pd.isna(lab.cat[pos])
    has_unit = m["unit"].notna().to_numpy()
    if has_unit.any():
        unit = np.array(_col(df, "unit"), dtype=object)
        unit[pos[has_unit]] = m["unit"].to_numpy(object)[has_unit]
        df["unit"] = labels_array(unit)


def pass_tags(df, lab: _Labels, have_inventory_grads: bool = False) -> None:
    """All-gather output -> unsharded param; reduce-scatter input -> unsharded grad (with the inventory's grads
    labelled, all the rest of the reduce phase; else what is freed in backward)."""
    n = len(lab.cat)
    fp_v = np.asarray(_col(df, "fsdp_phase"), dtype=object)
    fp = _Codes(fp_v)
    free_fp_v = np.asarray(_col(df, "free_fsdp_phase"), dtype=object) if "free_fsdp_phase" in df \
        else np.full(n, None, dtype=object)
    free_fp = _Codes(free_fp_v)
    same_step = _col(df, "free_step_idx") == _col(df, "step_idx")
    # scratch of the collective itself (e.g. gloo's list-based all-gather): freed before the
    # all-gather annotation ends, so it is not the output
    ag = fp.isin(model.FLAT_GATHER_PHASES)
    scratch = ag & same_step
    scratch[scratch] = _eq(free_fp_v[scratch], fp_v[scratch])
    _fill(lab, scratch, MC.TEMPORARY.value, "tags")
    _fill(lab, fp.isin(model.UNSHARDED_PARAM_PHASES), MC.UNSHARDED_PARAM.value, "tags")
    # FSDP1: allocated in an unshard hook and released by a reshard (or still held at the step's end)
    fsdp1_unshard = fp.isin(model.FSDP1_UNSHARD_PHASES) & (free_fp.isin(model.FSDP1_RESHARD_PHASES) | ~same_step)
    is_fsdp1 = _Codes(_col(df, "fsdp_family")).eq(model.FAMILY_FSDP1) if "fsdp_family" in df else np.zeros(n, bool)
    _fill(lab, fsdp1_unshard & is_fsdp1, MC.UNSHARDED_PARAM.value, "tags")
    in_reduce = fp.isin(model.UNSHARDED_GRAD_PHASES)
    freed_in_bwd = ~pd.isna(_col(df, "free_us")) & same_step & _Codes(_col(df, "free_stage")).eq(model.STAGE_BACKWARD)
    rs_in = in_reduce & (freed_in_bwd | have_inventory_grads)
    # grads produced in backward and released by the unit's post-backward reduce
    rs_in |= _Codes(_col(df, "stage")).eq(model.STAGE_BACKWARD) & free_fp.isin(model.UNSHARDED_GRAD_PHASES) & ~in_reduce
    _fill(lab, rs_in, MC.UNSHARDED_GRAD.value, "tags")


def pass_fsdp_roles(df, lab: _Labels) -> None:
    """FSDP's own buffers by ``fsdp_role`` (source frames or sizes); a reduce-scatter output freed in its
    step's backward was only the reduce dtype's copy: temporary."""
    if "fsdp_role" not in df:
        return
    role = np.asarray(_col(df, "fsdp_role"), dtype=object)
    src = np.asarray(_col(df, "fsdp_role_source"), dtype=object) if "fsdp_role_source" in df \
        else np.full(len(role), "frames", dtype=object)
    rc = _Codes(role)
    if not rc.notna().any():
        return
    rs_out = rc.eq(model.FSDP_ROLE_REDUCE_SCATTER_OUTPUT)
    short = rs_out & ~pd.isna(_col(df, "free_us")) & (_col(df, "free_step_idx") == _col(df, "step_idx")) \
        & _Codes(_col(df, "free_stage")).eq(model.STAGE_BACKWARD)
    _fill(lab, short, MC.TEMPORARY.value, "frames")
    for r, cat in model.FSDP_ROLE_CATEGORY.items():
        m = rc.eq(r)
        if m.any():
            for s in ("frames", "sizes"):
                _fill(lab, m & _eq(src, s), cat, s)


def pass_other_threads(df, lab: _Labels) -> None:
    """The rows that carry the bytes of threads the profiler does not record (cpu_events.with_other_threads)."""
    if OTHER_THREADS_COLUMN in df:
        _fill(lab, np.asarray(_col(df, OTHER_THREADS_COLUMN), dtype=bool), MC.OTHER_THREADS.value, "c10 count")


def pass_before_recording(df, lab: _Labels) -> None:
    """What was alive before the history / window began and no pass could name."""
    if "before_trace" in df:
        _fill(lab, np.asarray(_col(df, "before_trace"), dtype=bool), MC.BEFORE_RECORDING.value, MC.BEFORE_RECORDING.value)


def pass_frames(df, lab: _Labels) -> None:
    sig = df["frame_sig"]
    if not _contains(sig, ".").any():
        return
    never_freed = pd.isna(_col(df, "free_us"))
    # blocks alive before the history began that torch recorded frames for (the entry left the ring buffer)
    before = np.asarray(_col(df, "before_trace"), dtype=bool) if "before_trace" in df else np.zeros(len(lab.cat), bool)
    if before.any():
        _fill(lab, before & never_freed & _contains(sig, r"torch/optim/", need=("torch/optim/",)),
              MC.OPTIMIZER_STATE.value, "frames")
    _fill(lab, _contains(sig, "accumulategrad|accumulate_grad", need=("accumulategrad", "accumulate_grad")),
          MC.SHARDED_GRAD.value, "frames")
    _fill(lab, _Codes(_col(df, "stage")).eq(model.STAGE_OPTIMIZER) & never_freed,
          MC.OPTIMIZER_STATE.value, "frames")
    _fill(lab, _contains(sig, r"torch/utils/data|collate|pin_memory", need=("torch/utils/data", "collate", "pin_memory")),
          MC.INPUT.value, "frames")
    param_init = _contains(sig, r"(?:^|\|)(?:convert|_apply|reset_parameters|load_state_dict|_load_from_state_dict)@"
                                r"[^|]*module", need=("module",))
    _fill(lab, param_init & never_freed, MC.SHARDED_PARAM.value, "frames")


def pass_lifetime(df, lab: _Labels) -> None:
    ph_v = np.asarray(_col(df, "stage"), dtype=object)
    ph, fph = _Codes(ph_v), _Codes(_col(df, "free_stage"))
    same_step = _col(df, "free_step_idx") == _col(df, "step_idx")
    freed = ~pd.isna(_col(df, "free_us"))
    never = ~freed
    later = (~same_step) | never
    has_ph = ph.notna()
    fwd, bwd, opt, post, data = (model.STAGE_FORWARD, model.STAGE_BACKWARD, model.STAGE_OPTIMIZER,
                                 model.STAGE_POST_STEP, model.STAGE_DATA)
    _fill(lab, ph.eq(fwd) & ((fph.isin([bwd, opt, post]) & same_step) | later), MC.ACTIVATION.value, "lifetime")
    _fill(lab, ph.eq(data) & (~fph.eq(data) | later), MC.INPUT.value, "lifetime")
    _fill(lab, ph.eq(opt) & (~fph.eq(opt) | later), MC.OPTIMIZER_STATE.value, "lifetime")
    _fill(lab, ph.eq(bwd) & ((fph.isin([opt, post]) & same_step) | later),
          MC.SHARDED_GRAD.value, "lifetime")
    same_phase = freed & same_step & has_ph
    same_phase[same_phase] = _eq(ph_v[same_phase], np.asarray(_col(df, "free_stage"), dtype=object)[same_phase])
    _fill(lab, same_phase, MC.TEMPORARY.value, "lifetime")
    # anything else freed within the same step: short-lived working memory
    _fill(lab, freed & same_step & has_ph, MC.TEMPORARY.value, "lifetime")


def label_columns(cols, *, inv_tensors: pd.DataFrame | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(category, category_source) object arrays of ``cols`` (DataFrame or dict of arrays) by the passes in order;
    the inventory pass may replace ``cols["unit"]``."""
    lab = _Labels(len(cols["addr"]))
    pass_other_threads(cols, lab)
    pass_inventory(cols, lab, inv_tensors)
    have_grads = inv_tensors is not None and len(inv_tensors) and (inv_tensors["category"] == MC.SHARDED_GRAD.value).any()
    pass_fsdp_roles(cols, lab)
    pass_tags(cols, lab, bool(have_grads))
    pass_frames(cols, lab)
    pass_lifetime(cols, lab)
    pass_before_recording(cols, lab)
    _fill(lab, np.ones(len(lab.cat), bool), MC.OTHER.value, MC.OTHER.value)
    return lab.cat, lab.src


def categorize(allocs: pd.DataFrame, *, inv_tensors: pd.DataFrame | None = None) -> pd.DataFrame:
    """A copy of the labelled ``allocs`` with ``category`` and ``category_source``."""
    df = allocs.copy()
    cat, src = label_columns(df, inv_tensors=inv_tensors)
    df["category"] = pd.Categorical(cat, categories=CATEGORIES)
    df["category_source"] = labels_array(src)
    return df
