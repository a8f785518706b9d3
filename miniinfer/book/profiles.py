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


def gap_sentences(bench: pd.DataFrame, gap: pd.DataFrame) -> list[str]:
    """What :func:`gap_table` shows, per batch size, in words computed from it."""
    pct = bench.set_index(["engine", "batch_size"])
    spread = "pct_of_hf_min" in bench and bench.pct_of_hf_min.notna().all()
    lines = []
    for b, r in gap.iterrows():
        p = pct.loc[("paged-prealloc", b)]
        off = pct.loc[("paged-prealloc/ranges-off", b)]
        ranges = (f"{p.pct_of_hf:.0f}% [{p.pct_of_hf_min:.0f}-{p.pct_of_hf_max:.0f}]" if spread
                  else f"{p.pct_of_hf:.0f}%")
        lines.append(f"batch {b}: paged-prealloc at {ranges} of hf's tok/s (median of per-repeat "
                     f"ratios); its plain step is {r['gap to hf ms']:+.2f} ms against hf's. "
                     f"Everything outside the forward would take "
                     f"{r['non-forward ms, scaled to plain']:.2f} ms of a plain step.")
        if r["gap to hf ms"] > r["non-forward ms, scaled to plain"]:
            lines.append(f"  the gap exceeds all non-forward work by "
                         f"{r['gap to hf ms'] - r['non-forward ms, scaled to plain']:.2f} ms: "
                         "the rest is inside the forward (ours runs on a dense buffer padded to "
                         "the longest request, HF's on its own cache) or the run's drift.")
        else:
            lines.append("  the non-forward work covers the gap.")
        if spread:
            both = (off.pct_of_hf_min <= p.pct_of_hf_max) and (p.pct_of_hf_min <= off.pct_of_hf_max)
            lines.append(f"  ranges off: {off.pct_of_hf:.0f}% [{off.pct_of_hf_min:.0f}-"
                         f"{off.pct_of_hf_max:.0f}] of hf; " + (
                             "the two spreads overlap, so this run cannot tell the ranges' cost "
                             "from noise." if both else
                             "the spreads do not overlap: the ranges cost measurable time."))
    return lines


def profiler_cost_sentences(gap: pd.DataFrame) -> list[str]:
    """Per batch size, whether the profiled step was longer or shorter than the plain one. The
    profiler records every operator, so it should only add time; where the profiled step came
    out shorter, the machine drifted between the two runs by more than the profiler costs."""
    lines = []
    for b, ratio in gap["profiled / plain"].items():
        if ratio >= 1:
            lines.append(f"batch {b}: the profiled step took {ratio:.2f}x the plain one "
                         f"({100 * (ratio - 1):.0f}% longer under the profiler)")
        else:
            lines.append(f"batch {b}: the profiled step took {ratio:.2f}x the plain one, "
                         f"{100 * (1 - ratio):.0f}% *shorter*: a profiler cannot make a step "
                         "faster, so the machine drifted between the two runs by more than the "
                         "profiler costs; read the split as shares, not as milliseconds")
    return lines


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


def host_share_sentences(phases: pd.DataFrame) -> list[str]:
    """Chapter 05's measured host share, as chapters 06 and 07 quote it."""
    lines = []
    for name, dev in host_share(phases).groupby(level="device_name", sort=False):
        dev = dev.droplevel("device_name")
        lines.append(f"{name}: outside the model forward the host spends "
                     + ", ".join(f"{r.host_ms:.2f} ms of {r.step_ms:.1f} ({r.host_pct:.1f}%) at "
                                 f"batch {b}" for b, r in dev.iterrows())
                     + f" (chapter 05's profiled paged-prealloc): at most "
                       f"{dev.host_pct.max():.1f}% of a step is host work to win back")
    return lines


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
