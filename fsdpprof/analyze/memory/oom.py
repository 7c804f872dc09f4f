"""An out-of-memory error in a CUDA snapshot, explained: what was being allocated, how much was free,
what was alive then (by category and FSDP unit), and which change would free enough, with the bytes
each would save.  Sizes in bytes (requested sizes, as the snapshot's trace records them).

The savings are estimates from the snapshot's own allocations at the moment of the OOM:
- activation checkpointing of a unit frees what its finished forward keeps for backward, less the
  unit's input that checkpointing keeps (taken as the unit's first activation of that forward);
- a smaller micro-batch shrinks the activations alive then (and the request, when it is one) in
  proportion;
- reshard after forward frees the unsharded parameters of units that are neither running nor
  prefetched;
- twice the shards halve the sharded parameters, gradients and optimizer state.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.model import MemoryCategory as MC

def fmt_bytes(n) -> str:
    """Bytes as text (:func:`fsdpprof.analyze.model.fmt_bytes`), "unknown" when missing (said in sentences)."""
    return model.fmt_bytes(n, missing="unknown")


def _text(v) -> str | None:
    return None if v is None or (isinstance(v, float) and v != v) else str(v)


def explain_oom(res, oom: dict, request: dict, snap) -> dict:
    """The keys the rank's ``oom`` object gets beside requested_bytes / free_bytes / device / ts_us:
    stage, fsdp_phase, fsdp_role, unit and frames of the request; allocated / reserved / cached-free and
    short (deficit) bytes; alive_by_category and alive_by_unit at the OOM; ``explanation`` (text) and
    ``suggestions`` (change, saves_bytes, enough, detail), largest saving first."""
    from fsdpprof.analyze.memory.attribution import _fmt_frames

    df = res.allocations
    seq = int(oom["seq"])
    alive = (df["alloc_seq"].to_numpy() < seq) & (df["free_seq"].to_numpy() > seq)
    a = df.loc[alive, ["bytes", "category", "unit", "stage", "alloc_seq", "fsdp_role"]
               if "fsdp_role" in df else ["bytes", "category", "unit", "stage", "alloc_seq"]].copy()
    a["category"] = a["category"].astype(str)
    allocated = int(a["bytes"].sum())
    req = int(oom["requested_bytes"])
    free = oom.get("free_bytes")
    short = req - int(free) if free is not None else req
    reserved = _reserved_at(snap, res.device, seq)
    cached_free = reserved - allocated if reserved is not None else None
    unit = _text(request.get("unit"))
    stage = _text(request.get("stage"))
    phase = _text(request.get("fsdp_phase"))
    role = _text(request.get("fsdp_role"))
    frames = _py_frames_text(request.get("frames")) or _fmt_frames(request.get("frames"), limit=6)

    by_cat = a.groupby("category")["bytes"].sum().sort_values(ascending=False)
    by_cat = by_cat[by_cat > 0]
    by_unit = (a[a["unit"].notna()].assign(unit=lambda x: x["unit"].astype(str))
               .groupby(["unit", "category"])["bytes"].sum().reset_index()
               .sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True))
    sugg = _suggestions(res, a, df, seq, req, short, unit, stage, role)

    what = ("FSDP's " + role.replace("_", " ")) if role else ("an activation" if stage == model.STAGE_FORWARD else "a tensor")
    where = (f", in the {stage} of {unit}" if unit and stage else f", in {unit}" if unit
             else f", in the {stage}" if stage else "")
    if phase:
        where += f", FSDP phase {phase}"
    cats = ", ".join(f"{c} {fmt_bytes(b)} ({100 * b / allocated:.0f} %)" for c, b in by_cat.items()) if allocated else ""
    act_units = by_unit[by_unit["category"] == MC.ACTIVATION.value].head(4)
    act_txt = ("; activations by unit: " + ", ".join(f"{u} {fmt_bytes(b)}" for u, b in
                                                     zip(act_units["unit"], act_units["bytes"]))) if len(act_units) else ""
    parts = [f"cuda:{res.device} ran out of memory allocating {fmt_bytes(req)} ({what}{where})"
             + (f" with {fmt_bytes(free)} free on the device: {fmt_bytes(short)} short." if free is not None else "."),
             f"At that moment {fmt_bytes(allocated)} was allocated"
             + (f" and {fmt_bytes(reserved)} reserved ({fmt_bytes(cached_free)} of it cached by the allocator but "
                f"not in blocks large enough)" if reserved is not None else "")
             + (f": {cats}{act_txt}." if cats else ".")]
    enough = [s for s in sugg if s["enough"]]
    if enough:
        parts.append("Enough on its own: " + "; ".join(f"{s['change']} (saves {fmt_bytes(s['saves_bytes'])})"
                                                       for s in enough) + ".")
    elif sugg:
        parts.append("No single change frees enough; together they save "
                     f"{fmt_bytes(sum(s['saves_bytes'] for s in sugg))}.")
    if frames:
        parts.append(f"Requested at: {frames}.")
    return {"stage": stage, "fsdp_phase": phase, "fsdp_role": role, "unit": unit, "frames": frames,
            "allocated_bytes": allocated, "reserved_bytes": reserved, "cached_free_bytes": cached_free,
            "short_bytes": short,
            "alive_by_category": [{"category": c, "bytes": int(b)} for c, b in by_cat.items()],
            "alive_by_unit": [{"unit": u, "category": c, "bytes": int(b)}
                              for u, c, b in by_unit[["unit", "category", "bytes"]].itertuples(index=False)],
            "explanation": " ".join(parts), "suggestions": sugg}


def _py_frames_text(fr, limit: int = 6) -> str:
    """The innermost ``limit`` Python frames of a stack as one line (``name (file.py:line) < ...``)."""
    import os

    from fsdpprof.analyze.memory.attribution import _frame_text
    out = []
    for f in fr if type(fr) is list else []:
        if type(f) is dict and type(f.get("filename")) is str and f["filename"].endswith(".py"):
            out.append(f"{_frame_text(f.get('name'))[:200]} "
                       f"({os.path.basename(_frame_text(f['filename']).replace(chr(92), '/'))}:"
                       f"{_frame_text(f.get('line'))[:20]})")
            if len(out) == limit:
                break
    return " < ".join(out)


def _reserved_at(snap, device, seq: int) -> int | None:
    seg = snap.segments
    m = seg["device"].to_numpy() == device
    if not m.any():
        return None
    se = snap.segment_events
    after = se[(se["device"].to_numpy() == device) & (se["seq"].to_numpy() > seq)]["delta_bytes"].sum()
    return int(seg["total_bytes"].to_numpy()[m].sum() - after)


def _suggestions(res, a: pd.DataFrame, df: pd.DataFrame, seq: int, req: int, short: int, unit, stage, role) -> list[dict]:
    out = []
    act = a[a["category"] == MC.ACTIVATION.value]
    # activation checkpointing of the units whose forward finished, most activations first
    if len(act) and act["unit"].notna().any():
        done = act[act["unit"].notna() & (act["unit"].astype(str) != (unit or ""))]
        per = done.groupby(done["unit"].astype(str))["bytes"].sum().sort_values(ascending=False, kind="stable")
        kept = _unit_inputs(df, seq, per.index)
        saves, chosen = 0, []
        for u, b in per.items():
            s = max(0, int(b) - kept.get(u, 0))
            if s <= 0:
                continue
            chosen.append(u)
            saves += s
            if saves >= short:
                break
        if chosen:
            out.append({"change": f"activation checkpointing of {_list(chosen)}", "saves_bytes": int(saves),
                        "enough": saves >= short,
                        "detail": f"those units hold {fmt_bytes(int(per[chosen].sum()))} of activations at the OOM; "
                                  f"checkpointing keeps each unit's input ({fmt_bytes(sum(kept.get(u, 0) for u in chosen))}"
                                  f" in all) and recomputes the rest in backward"})
    # a smaller micro-batch: activations (and an activation request) shrink in proportion
    a_bytes = int(act["bytes"].sum())
    req_act = req if (stage == model.STAGE_FORWARD and not role) else 0
    scalable = a_bytes + req_act
    if scalable > 0:
        half = scalable // 2
        need = short / scalable
        detail = (f"{fmt_bytes(a_bytes)} of activations are alive at the OOM"
                  + (" and the request is one" if req_act else "")
                  + (f"; a micro-batch at most {100 * (1 - need):.0f} % of the current one would fit"
                     if need < 1 else "; even a micro-batch of one sample may not fit"))
        out.append({"change": "half the micro-batch (gradient accumulation keeps the global batch)",
                    "saves_bytes": int(half), "enough": half >= short, "detail": detail})
    # reshard after forward: unsharded parameters of units neither running nor prefetched
    up = a[(a["category"] == MC.UNSHARDED_PARAM.value) & a["unit"].notna()]
    if len(up):
        busy = {unit} if unit else set()
        ag = df[(df["fsdp_role"] == model.FSDP_ROLE_ALL_GATHER_OUTPUT).to_numpy() & (df["alloc_seq"] < seq).to_numpy()] \
            if "fsdp_role" in df else df.iloc[:0]
        if len(ag):
            busy.add(str(ag.sort_values("alloc_seq")["unit"].iloc[-1]))
        idle = up[~up["unit"].astype(str).isin(busy)]
        b = int(idle["bytes"].sum())
        if b > 0:
            units = sorted(idle["unit"].astype(str).unique())
            out.append({"change": "reshard after forward (reshard_after_forward=True) for " + _list(units),
                        "saves_bytes": b, "enough": b >= short,
                        "detail": f"{fmt_bytes(b)} of unsharded parameters of units that are neither running nor "
                                  f"prefetched are alive at the OOM"})
    # more shards: sharded model states halve with twice the ranks
    if res.fsdp_family or res.world_size:
        ms = a[a["category"].isin([MC.SHARDED_PARAM.value, MC.SHARDED_GRAD.value, MC.OPTIMIZER_STATE.value])]
        b = int(ms["bytes"].sum()) // 2
        if b > 0:
            w = res.world_size
            out.append({"change": f"twice the shards ({w} -> {2 * w} ranks)" if w else "twice the shards",
                        "saves_bytes": b, "enough": b >= short,
                        "detail": f"sharded parameters, gradients and optimizer state hold {fmt_bytes(2 * b)} at the OOM"})
    return sorted(out, key=lambda s: -s["saves_bytes"])


def _unit_inputs(df: pd.DataFrame, seq: int, units) -> dict:
    """Per unit: the first activation of its latest forward before ``seq`` (about the unit's input, which
    activation checkpointing keeps)."""
    act = df[(df["category"] == MC.ACTIVATION.value) & df["unit"].notna() & (df["alloc_seq"] < seq)
             & (df["free_seq"] > seq)]
    out = {}
    for u, g in act.groupby(act["unit"].astype(str)):
        if u in set(units):
            out[u] = int(g.sort_values("alloc_seq")["bytes"].iloc[0])
    return out


def _list(names: list[str], n: int = 6) -> str:
    names = [str(x) for x in names]
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
