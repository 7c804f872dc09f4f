"""An out-of-memory error in a CUDA snapshot explained: the request, what was free and alive (by category and
FSDP unit), and which change would free enough with the bytes each saves (estimates from the allocations alive
at the OOM).  Changes enough on their own come first, each group by cost_rank (an allocator setting, an FSDP
setting, the batch or activation checkpointing, more devices), then the largest saving.  Sizes in bytes."""
from __future__ import annotations

import os

import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.memory.fragmentation import round_request
from fsdpprof.analyze.memory.fsdp_units import world_size_said
from fsdpprof.analyze.memory.snapshot import fmt_frames, frame_text
from fsdpprof.analyze.model import MemoryCategory as MC

# what a change costs the user, cheapest first (cost_rank: the index)
COSTS = ("an allocator setting", "an FSDP setting", "the batch or activation checkpointing", "more devices")
COST_ALLOCATOR, COST_FSDP, COST_TRAINING, COST_DEVICES = range(4)


def fmt_bytes(n) -> str:
    """Bytes as text (:func:`fsdpprof.analyze.model.fmt_bytes`), "unknown" when missing (said in sentences)."""
    return model.fmt_bytes(n, missing="unknown")


def _text(v) -> str | None:
    return None if v is None or (isinstance(v, float) and v != v) else str(v)


def explain_oom(res, oom: dict, request: dict, snap) -> dict:
    """The keys the rank's ``oom`` object gets beside requested_bytes / free_bytes / device / ts_us: the request's
    labels, allocated / reserved / short bytes, the free blocks at the OOM, what was alive, ``explanation`` (text)
    and ``suggestions`` (change, saves_bytes, enough, detail, cost_rank, cost)."""
    df = res.allocations
    seq = int(oom["seq"])
    alive = (df["alloc_seq"].to_numpy() < seq) & (df["free_seq"].to_numpy() > seq)
    a = df.loc[alive, [c for c in ("bytes", "category", "unit", "stage", "alloc_seq", "fsdp_role") if c in df]].copy()
    a["category"] = a["category"].astype(str)
    allocated = int(a["bytes"].sum())
    req = int(oom["requested_bytes"])
    free = oom.get("free_bytes")
    short = req - int(free) if free is not None else req
    reserved = snap.reserved_at(res.device, seq)
    cached_free = reserved - allocated if reserved is not None else None
    unit, stage, phase, role = (_text(request.get(k)) for k in ("unit", "stage", "fsdp_phase", "fsdp_role"))
    frames = _py_frames_text(request.get("frames")) or fmt_frames(request.get("frames"), limit=6)

    by_cat = a.groupby("category")["bytes"].sum().sort_values(ascending=False)
    by_cat = by_cat[by_cat > 0]
    by_unit = (a[a["unit"].notna()].assign(unit=lambda x: x["unit"].astype(str))
               .groupby(["unit", "category"])["bytes"].sum().reset_index()
               .sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True))
    frag = _fragmentation_at_oom(res, req, short)
    sugg = _suggestions(res, a, df, seq, req, short, unit, stage, role)
    if frag["fragmentation_decides"]:
        sugg.append(_cache_suggestion(frag, req, short, unit, stage, frames))
    sugg = sorted(sugg, key=lambda s: (not s["enough"], s["cost_rank"], -s["saves_bytes"]))

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
    if frag["fragmentation_decides"]:
        parts.append(f"Fragmentation decides: {fmt_bytes(frag['cached_unusable_bytes'])} sat free in the allocator's "
                     f"cache as {frag['free_blocks']:,} blocks, the largest "
                     f"{fmt_bytes(frag['largest_free_block_bytes'])}"
                     f" (smaller than the request), more than the {fmt_bytes(short)} short.")
    elif frag["fragmentation_decides"] is False and frag["cached_unusable_bytes"] is not None:
        parts.append(f"Fragmentation does not decide: the {fmt_bytes(frag['cached_unusable_bytes'])} free in the "
                     f"allocator's cache is less than the {fmt_bytes(short)} short.")
    elif frag["fragmentation_decides"] is False:
        parts.append(f"A free block of {fmt_bytes(frag['largest_free_block_bytes'])} in the allocator's cache could "
                     f"have held the request: the cache was not the obstacle (a block of another stream or pool?).")
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
            "short_bytes": short, **frag,
            "alive_by_category": [{"category": c, "bytes": int(b)} for c, b in by_cat.items()],
            "alive_by_unit": [{"unit": u, "category": c, "bytes": int(b)}
                              for u, c, b in by_unit[["unit", "category", "bytes"]].itertuples(index=False)],
            "explanation": " ".join(parts), "suggestions": sugg}


def _py_frames_text(fr, limit: int = 6) -> str:
    """The innermost ``limit`` Python frames of a stack as one line (``name (file.py:line) < ...``)."""
    out = []
    for f in fr if type(fr) is list else []:
        if type(f) is dict and type(f.get("filename")) is str and f["filename"].endswith(".py"):
            out.append(f"{frame_text(f.get('name'))[:200]} "
                       f"({os.path.basename(frame_text(f['filename']).replace(chr(92), '/'))}:"
                       f"{frame_text(f.get('line'))[:20]})")
            if len(out) == limit:
                break
    return " < ".join(out)


def _suggestions(res, a: pd.DataFrame, df: pd.DataFrame, seq: int, req: int, short: int, unit, stage, role) -> list[dict]:
    out = []
    act = a[a["category"] == MC.ACTIVATION.value]
    # activation checkpointing of the units whose forward finished, most bytes freed first: it frees what a
    # unit's forward saved for backward, never the unit's output (the next unit's input, or what the loss holds)
    if len(act) and act["unit"].notna().any():
        done = act[act["unit"].notna() & (act["unit"].astype(str) != (unit or ""))]
        per = done.groupby(done["unit"].astype(str))["bytes"].sum()
        kept = _unit_outputs(df, seq, per.index)
        frees = pd.Series({u: max(0, int(b) - kept.get(u, 0)) for u, b in per.items()}, dtype="int64")
        frees = frees[frees > 0].sort_values(ascending=False, kind="stable")
        saves, chosen = 0, []
        for u, s in frees.items():
            chosen.append(u)
            saves += int(s)
            if saves >= short:
                break
        if chosen:
            out.append(_change(f"activation checkpointing of {_list(chosen)}", saves, short, COST_TRAINING,
                               f"those units hold {fmt_bytes(int(per[chosen].sum()))} of activations at the OOM; "
                               f"checkpointing frees what their forwards saved for backward and keeps each unit's "
                               f"output, the next unit's input or what the loss holds "
                               f"({fmt_bytes(sum(kept.get(u, 0) for u in chosen))} in all), recomputing the rest "
                               f"in backward"))
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
        out.append(_change("half the micro-batch (gradient accumulation keeps the global batch)", half, short,
                           COST_TRAINING, detail))
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
            out.append(_change("reshard after forward (reshard_after_forward=True) for " + _list(units), b, short,
                               COST_FSDP, f"{fmt_bytes(b)} of unsharded parameters of units that are neither running "
                                          f"nor prefetched are alive at the OOM"))
    # more shards: sharded model states halve with twice the ranks
    if res.fsdp_family or res.world_size:
        ms = a[a["category"].isin([MC.SHARDED_PARAM.value, MC.SHARDED_GRAD.value, MC.OPTIMIZER_STATE.value])]
        b = int(ms["bytes"].sum()) // 2
        if b > 0:
            w = res.world_size
            said = world_size_said(w, getattr(res, "world_size_source", None)) or (
                "the world size is unknown: no all-gather input, reduce-scatter or run information in the snapshot "
                "says it")
            out.append(_change(f"twice the shards ({w} -> {2 * w} ranks)" if w else "twice the shards", b, short,
                               COST_DEVICES, f"sharded parameters, gradients and optimizer state hold "
                                             f"{fmt_bytes(2 * b)} at the OOM" + (f"; {said}" if said else "")))
    return out


def _change(change: str, saves: int, short: int, cost: int, detail: str) -> dict:
    """One suggestion: saves ``saves`` bytes, enough when that covers the ``short`` bytes."""
    return {"change": change, "saves_bytes": int(saves), "enough": saves >= short, "detail": detail,
            "cost_rank": cost, "cost": COSTS[cost]}


def _fragmentation_at_oom(res, req: int, short: int) -> dict:
    """The free blocks at the OOM and whether they decide: the cached free bytes, when no free block could hold the
    request, exceed the shortfall.  All None where the fragmentation at the OOM is unknown."""
    f = getattr(res, "fragmentation", None)
    e = f.at("oom") if f is not None else None
    if e is None:
        return {"largest_free_block_bytes": None, "free_blocks": None, "expandable_segments": None,
                "cached_unusable_bytes": None, "fragmentation_decides": None}
    fits = e.largest_free_block_bytes >= round_request(req)
    unusable = None if fits else int(e.free_bytes)
    return {"largest_free_block_bytes": int(e.largest_free_block_bytes), "free_blocks": int(e.free_blocks),
            "expandable_segments": bool(e.expandable_segments), "cached_unusable_bytes": unusable,
            "fragmentation_decides": unusable is not None and unusable > short}


def _cache_suggestion(frag: dict, req: int, short: int, unit, stage, frames) -> dict:
    """Expandable segments, or (already expandable) emptying the cache before the failing stage."""
    cached, largest, n = frag["cached_unusable_bytes"], frag["largest_free_block_bytes"], frag["free_blocks"]
    figures = (f"{fmt_bytes(cached)} sat free in the allocator's cache at the OOM as {n:,} blocks inside segments "
               f"still in use, the largest {fmt_bytes(largest)}, smaller than the {fmt_bytes(req)} request: more than "
               f"the {fmt_bytes(short)} short")
    if not frag["expandable_segments"]:
        return _change("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", cached, short, COST_ALLOCATOR,
                       f"{figures}. Expandable segments grow a segment by mapping pages at its end instead of "
                       f"reserving a new one, and give whole free pages back to the device, so the request would "
                       f"very likely have fitted with no change to the model or the batch")
    point = (f"before the {stage} of {unit}" if unit and stage else f"before {unit}" if unit
             else f"before the {stage}" if stage else f"before the allocation at {frames.split(' < ')[0]}" if frames
             else "before the step")
    return _change(f"torch.cuda.empty_cache() {point}", cached, short, COST_ALLOCATOR,
                   f"{figures}. The segments are already expandable: emptying the cache at that point gives the "
                   f"free pages back to the device, so that what follows is laid out again instead of into "
                   f"the holes (pieces smaller than a page stay cached)")


def _unit_outputs(df: pd.DataFrame, seq: int, units) -> dict:
    """Per unit: the bytes of its output alive at ``seq``, the last activation its forward allocated (what the
    next unit takes as input, or the loss holds: checkpointing the unit keeps it)."""
    act = df[(df["category"] == MC.ACTIVATION.value) & df["unit"].notna() & (df["alloc_seq"] < seq)
             & (df["free_seq"] > seq)]
    if "stage" in act:
        act = act[act["stage"].astype(object).isin([model.STAGE_FORWARD, None]) | act["stage"].isna()]
    wanted = set(units)
    out = {}
    for u, g in act.groupby(act["unit"].astype(str)):
        if u in wanted:
            out[u] = int(g.sort_values("alloc_seq")["bytes"].iloc[-1])
    return out


def _list(names: list[str], n: int = 6) -> str:
    names = [str(x) for x in names]
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
