"""One rank's out-of-memory error explained, with the changes that would free enough (:func:`render_oom`), and
FSDP's memory by unit and role (:func:`render_fsdp_memory`), as HTML fragments."""
from __future__ import annotations

import pandas as pd

from fsdpprof.analyze.memory.fsdp_units import world_size_said
from fsdpprof.analyze.model import ROOT_UNIT, ROOT_UNIT_TEXT, unit_order
from fsdpprof.report.page import MISSING, NO_UNIT_TEXT, esc, fmt_bytes, kv_table, table, value_label


def render_oom(m) -> str:
    """The OOM section of one rank (``m``: MemoryResult); "" when the rank did not run out of memory."""
    o = getattr(m, "oom", None)
    if not o:
        return ""
    out = ['<div class="banner oom">',
           f'<b>Out of memory</b> on cuda:{esc(o.get("device"))}: requested {esc(fmt_bytes(o.get("requested_bytes")))}'
           f' with {esc(fmt_bytes(o.get("free_bytes")))} free'
           + (f', {esc(fmt_bytes(o.get("short_bytes")))} short' if o.get("short_bytes") is not None else "") + ".",
           f'<p>{esc(o.get("explanation") or "")}</p>']
    where = [("stage", value_label("stage", o.get("stage"))), ("unit", o.get("unit")),
             ("FSDP phase", value_label("fsdp_phase", o.get("fsdp_phase"))),
             ("FSDP buffer", value_label("fsdp_role", o.get("fsdp_role"))), ("allocated then", fmt_bytes(o.get("allocated_bytes"))),
             ("reserved then", fmt_bytes(o.get("reserved_bytes"))),
             ("cached but free then", fmt_bytes(o.get("cached_free_bytes"))),
             ("largest free block then", fmt_bytes(o.get("largest_free_block_bytes"))),
             ("free blocks then", None if o.get("free_blocks") is None else f"{o['free_blocks']:,}"),
             ("expandable segments", None if o.get("expandable_segments") is None
              else "yes" if o["expandable_segments"] else "no"),
             ("requested at", o.get("frames"))]
    shown = [(k, v) for k, v in where if v not in (None, "", "-", MISSING)]
    if shown:
        out.append(kv_table(shown))
    sugg = o.get("suggestions") or []
    if sugg:
        out.append("<h3>What would free enough</h3>")
        out.append('<p class="note">changes that are enough on their own first, then the others; each in the order of '
                   'what it costs: an allocator setting, an FSDP setting, the batch or activation checkpointing, '
                   'more devices</p>')
        out.append(table(pd.DataFrame([{"change": s.get("change"), "saves_bytes": s.get("saves_bytes"),
                                        "enough": "yes" if s.get("enough") else "no", "cost": s.get("cost"),
                                        "detail": s.get("detail")}
                                       for s in sugg]), left=("change", "enough", "cost", "detail"),
                         labels={"saves_bytes": "saves", "enough": "enough on its own", "cost": "what it costs"}))
    cats = o.get("alive_by_category") or []
    if cats:
        out.append("<h3>Alive at the OOM, by category</h3>")
        out.append(table(pd.DataFrame(cats), left=("category",)))
    units = o.get("alive_by_unit") or []
    if units:
        out.append("<h3>Alive at the OOM, by FSDP unit</h3>")
        out.append(table(pd.DataFrame(units), left=("unit", "category"), max_rows=60))
    out.append("</div>")
    return "".join(out)


def _in_model_order(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """A per-unit table with its units in the model's order (the root first, named "(root)")."""
    if df is None or df.empty or "unit" not in df:
        return df
    df = df.copy()
    df["unit"] = df["unit"].astype(str).replace({ROOT_UNIT: ROOT_UNIT_TEXT, "None": NO_UNIT_TEXT, "nan": NO_UNIT_TEXT})
    rank = {u: i for i, u in enumerate(unit_order(df["unit"]))}
    return df.sort_values("unit", key=lambda s: s.map(rank), kind="stable").reset_index(drop=True)


def render_fsdp_memory(m) -> str:
    """FSDP's units, buffers by role, activations per unit and the blocks from before recording ("" for none)."""
    out = []
    fam = getattr(m, "fsdp_family", None)
    units = getattr(m, "fsdp_units", None) or []
    if fam:
        ws = getattr(m, "world_size", None)
        out.append(f'<p>The snapshot\'s stack frames show {esc(fam.upper())}: {len(units)} unit(s) recovered from '
                   f'the order of the all-gathers (forward order: {esc(", ".join(units[:12]))}'
                   f'{esc(" ...") if len(units) > 12 else ""})'
                   + (f", shard group of {esc(ws)} ranks "
                      f"({esc(world_size_said(ws, getattr(m, 'world_size_source', None)))})" if ws else "") + ".</p>")
    roles = _in_model_order(getattr(m, "by_role_at_peak", None))
    if roles is not None and not roles.empty:
        out.append("<h3>FSDP's buffers at the peak, by what made them</h3>")
        out.append(table(roles, left=("unit", "fsdp_role"), max_rows=60))
    act = _in_model_order(getattr(m, "activation_by_unit", None))
    if act is not None and not act.empty:
        out.append("<h3>Activations each unit keeps for its backward (A_l)</h3>")
        out.append(table(act, left=("unit",), max_rows=80))
    sizes = getattr(m, "before_recording_sizes", None)
    if sizes is not None and not sizes.empty:
        out.append("<h3>Allocated before recording, by size</h3><p class=\"note\">blocks alive before the "
                   "allocation history began, that nothing (frames, sizes of the shards) names</p>")
        out.append(table(sizes, max_rows=30))
    return "".join(out)
