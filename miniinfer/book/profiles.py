"""What the profiled decode steps say (chapters 05-07): the gap to hf in the mini-infer post's
arithmetic, the profiler's own cost, the host's share of a step, and the copy a CPU reference
attention makes inside the forward."""

from __future__ import annotations

import pandas as pd

# -- chapter 05: the gap to hf, the profiler's cost, the host's share ----------------------

def _top_level(phases: pd.DataFrame) -> pd.Series:
    """Phases not nested in another ("inside" empty; NaN once read back from a CSV)."""
    inside = phases.get("inside", pd.Series("", index=phases.index))
    return inside.isna() | (inside == "")


def gap_table(bench: pd.DataFrame, phases: pd.DataFrame) -> pd.DataFrame:
    """The mini-infer post's arithmetic on our numbers, per batch size: a profiled step =
    model_forward + the other labelled phases + unlabelled time; the profiler changes a step's
    length, so its split is scaled to the plain step (same shares) before it is set against
    the gap to hf. ``bench`` has ``hf``, ``paged-prealloc`` and ``paged-prealloc/ranges-off``."""
    from ..bench.profiling import PHASES

    step = bench.pivot_table(index="batch_size", columns="engine", values="step_ms")
    ph = phases.pivot_table(index="batch_size", columns="phase", values="ms_per_step")
    top = phases[_top_level(phases) & phases.phase.isin(PHASES)]
    labelled = top.groupby("batch_size").ms_per_step.sum()
    profiled = ph["decode_step"]
    non_forward = labelled - ph["model_forward"] + ph["(unlabelled)"]
    plain = step["paged-prealloc"]
    return pd.DataFrame({
        "hf step ms": step["hf"],
        "paged-prealloc step ms": plain,
        "gap to hf ms": plain - step["hf"],
        "profiled step ms": profiled,
        "profiled / plain": profiled / plain,
        "forward ms (profiled)": ph["model_forward"],
        "other labelled ms (profiled)": labelled - ph["model_forward"],
        "unlabelled ms (profiled)": ph["(unlabelled)"],
        "non-forward ms, scaled to plain": non_forward / profiled * plain,
        "ranges off / on (step)": step["paged-prealloc/ranges-off"] / plain,
    }).round(3)


def host_share(phases: pd.DataFrame) -> pd.DataFrame:
    """Per device and batch size, from profiled phases: the step, the forward, and what the
    host does outside the forward (every other outermost phase plus unlabelled time), in ms
    and as % of the step (the median repeat of each phase)."""
    rows = []
    device = phases.get("device_name", pd.Series("this machine", index=phases.index))
    for (name, b), dev in phases.assign(device_name=device).groupby(
            ["device_name", "batch_size"], sort=False):
        ms = dev[_top_level(dev)].set_index("phase").ms_per_step
        step = ms["decode_step"]
        host = step - ms["model_forward"]
        rows.append({"device_name": name, "batch_size": b, "step_ms": step,
                     "forward_ms": ms["model_forward"], "host_ms": host,
                     "host_pct": 100 * host / step})
    return pd.DataFrame(rows).set_index(["device_name", "batch_size"])


# -- chapter 06: the copy a CPU reference attention makes inside the forward ----------------

# The ops of the reference attention's block gather (core.kernels.reference.BlockGather): one
# index_select of whole blocks per layer and K/V, and the zeroing of slots past the context.
GATHER_OPS = ("aten::index_select", "aten::index_fill_", "aten::masked_fill_")


def attention_gather_ms(trace) -> float:
    """ms per measured decode step of the block gather a reference paged attention does inside
    ``model_forward`` (the :data:`GATHER_OPS` there, leaving out the embedding lookup's own
    ``index_select``). 0 where the attention reads the blocks in place (a GPU kernel)."""
    from ..bench.profiling import _STEPS_SQL, STEP

    query = _STEPS_SQL + """
        , measured AS (SELECT * FROM steps WHERE step >= 0),
        forward AS (
            SELECT f.ts, f.ts + f.dur AS te, f.tid FROM events f JOIN measured s
              ON f.tid = s.tid AND f.ts >= s.ts AND f.ts + f.dur <= s.te
            WHERE f.cat = 'user_annotation' AND f.name = 'model_forward'
        ),
        embedding AS (SELECT ts, ts + dur AS te, tid FROM events WHERE name = 'aten::embedding')
        SELECT coalesce(sum(e.dur), 0) / 1e3 / (SELECT count(*) FROM measured) AS ms
        FROM events e JOIN forward w ON e.tid = w.tid AND e.ts >= w.ts AND e.ts + e.dur <= w.te
        WHERE e.cat = 'cpu_op' AND e.name IN (SELECT unnest($ops))
          AND NOT EXISTS (SELECT 1 FROM embedding m WHERE m.tid = e.tid AND e.ts >= m.ts
                                                      AND e.ts + e.dur <= m.te)
    """
    return float(trace.sql(query, {"warmup": trace.warmup_steps, "step_name": STEP,
                                   "ops": list(GATHER_OPS)}).ms.iloc[0])
