"""Parts of the step by collective and stage, by FSDP unit and by idle cause, each by the headline's one rule
(:func:`headline.share_of_step`): per rank and step the sum (0 in a step without any), each rank's mean over its
steps, the median over ranks; the share of the median step; the worst rank by its own share.  The page, the
findings and summary.json all read these tables, so "exposed all-gather in backward" is one number everywhere.
µs per step, %."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model

SHARE_COLUMNS = ["us", "pct", "worst_rank", "worst_pct", "worst_us", "ranks"]
STAGE_KEYS = ["collective", "stage"]
UNIT_KEYS = ["unit", "collective", "stage"]
IDLE_CAUSE_COLUMNS = ["idle_host_wait_us", "idle_kernel_wait_us", "idle_other_us"]   # breakdown.device_idle_by_cause


def _shares(table: pd.DataFrame, keys: list[str], col: str, steps: pd.DataFrame) -> pd.DataFrame:
    """Per group of ``keys``: SHARE_COLUMNS of ``col`` (the sums in each rank's steps; steps without any count 0)."""
    st = steps[["rank", "step", "step_us"]].dropna(subset=["step"]).astype({"step": float})
    n_steps = st.groupby("rank")["step"].nunique()
    step_mean = st.groupby("rank")["step_us"].mean()
    t = table[table["step"].notna()].astype({"step": float})
    t = t.merge(st[["rank", "step"]], on=["rank", "step"])          # the steps the headline counts
    if t.empty:
        return pd.DataFrame(columns=keys + SHARE_COLUMNS)
    per_rank = (t.groupby(keys + ["rank"], observed=True, dropna=False)[col].sum().unstack("rank")
                .reindex(columns=n_steps.index).fillna(0.0) / n_steps)            # each rank's mean per step
    med_step = float(step_mean.median())
    share = 100.0 * per_rank / step_mean.where(step_mean > 0)
    worst = share.fillna(-1.0).to_numpy().argmax(axis=1)
    ranks = per_rank.columns.to_numpy()
    out = per_rank.index.to_frame(index=False)
    out["us"] = per_rank.median(axis=1).to_numpy()
    out["pct"] = 100.0 * out["us"] / med_step if med_step > 0 else np.nan
    out["worst_rank"] = ranks[worst].astype(int)
    out["worst_pct"] = share.to_numpy()[np.arange(len(share)), worst]
    out["worst_us"] = per_rank.to_numpy()[np.arange(len(per_rank)), worst]
    out["ranks"] = int(len(ranks))
    return out.sort_values("us", ascending=False, kind="stable").reset_index(drop=True)


def exposed_by_stage(comm_unit_step: pd.DataFrame | None, steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per collective and stage (communication launched inside a step): exposed communication per step,
    ``us`` / ``pct`` / worst rank (SHARE_COLUMNS), beside ``overlapped_us`` (hidden behind compute, per step,
    the same rule)."""
    cu = comm_unit_step
    if cu is None or cu.empty or steps is None or steps.empty or "step_us" not in steps \
            or "exposed_comm_us" not in cu or "step" not in cu:
        return None
    c = cu.assign(collective=cu["collective"].astype(object).fillna(model.UNKNOWN_COLLECTIVE).astype(str),
                  stage=cu["stage"].astype(object).fillna(model.STAGE_UNKNOWN).astype(str) if "stage" in cu
                  else "all")
    out = _shares(c, STAGE_KEYS, "exposed_comm_us", steps)
    if "overlapped_comm_us" in c and len(out):
        hid = _shares(c, STAGE_KEYS, "overlapped_comm_us", steps)[STAGE_KEYS + ["us"]]
        out = out.merge(hid.rename(columns={"us": "overlapped_us"}), on=STAGE_KEYS, how="left")
    return out


def exposed_by_unit(comm_unit_step: pd.DataFrame | None, steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per FSDP unit, collective and stage: exposed communication per step (SHARE_COLUMNS), units with a name
    only (``""`` the root)."""
    cu = comm_unit_step
    if cu is None or cu.empty or "unit" not in cu or not cu["unit"].notna().any() or steps is None \
            or steps.empty or "step_us" not in steps:
        return None
    c = cu[cu["unit"].notna()]
    c = c.assign(unit=c["unit"].astype(str), collective=c["collective"].astype(object)
                 .fillna(model.UNKNOWN_COLLECTIVE).astype(str), stage=c["stage"].astype(object).astype(str))
    return _shares(c, UNIT_KEYS, "exposed_comm_us", steps)


def idle_by_cause(steps: pd.DataFrame | None, stalls: pd.DataFrame | None) -> pd.DataFrame | None:
    """The device's idle time per step by cause (IDLE_CAUSE_COLUMNS of step_stalls, in ``cause``): SHARE_COLUMNS,
    and ``pct_of_idle`` (its share of the causes' sum).  The headline's scope: each rank's steps, not the window's
    streams summed."""
    if steps is None or steps.empty or "step_us" not in steps or stalls is None or stalls.empty \
            or not all(c in stalls for c in IDLE_CAUSE_COLUMNS):
        return None
    long = stalls.melt(id_vars=["rank", "step"], value_vars=IDLE_CAUSE_COLUMNS, var_name="cause", value_name="us_")
    out = _shares(long, ["cause"], "us_", steps)
    if out.empty:
        return None
    out = out.set_index("cause").reindex(IDLE_CAUSE_COLUMNS).reset_index()
    out["us"] = out["us"].fillna(0.0)
    total = float(out["us"].sum())
    out["pct_of_idle"] = 100.0 * out["us"] / total if total > 0 else np.nan
    return out
