"""Where a steady decode step's time goes (issue 92's waterfall): ``bench --breakdown``.

One request decodes alone (batch 1, or ``batch`` requests in lockstep) past its prompt. First
the steps are timed with nothing watching them: that wall time is the step. Then as many more
steps run under ``torch.profiler``, whose self times of the kernels are what the kernels cost
(the profiler's own overhead lands on the host side, not inside a kernel). So:

- **weight-reading kernels**: the quantized linears (chapter 13's ops) and, on an eager dense
  model, ATen's matmuls;
- **other kernels**: our C++ attention and the compiled graphs' own loops (norms, RoPE, SiLU,
  and on a compiled dense model its GEMMs, which run inside the graph);
- **host**: the unwatched step minus those kernels, split as the profile saw it between the
  ATen ops the forward and the sampler call one at a time (*ATen ops*: at a decode step's sizes
  their dispatch costs more than their arithmetic), dynamo's guards and the forward's own Python
  (*guards and dispatch*), and everything else outside the forward (*engine Python*: schedule,
  plan, sample, commit, stop checks).
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
from torch.profiler import ProfilerActivity, profile

from ..core.sampling import SamplingParams
from .offline import make_prompts

WEIGHT_OPS = ("miniinfer::q4_1_linear", "miniinfer::int8_linear", "aten::mm", "aten::addmm",
              "aten::linear", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")
# Time the profiler books to torch.compile's machinery, not to a kernel.
DISPATCH_EVENTS = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "AOTDispatcher",
                   "Pregraph bytecode", "CompiledFunction")
GRAPH_EVENT = "## Call CompiledFxGraph"
CATEGORIES = ("weight-reading kernels", "other kernels", "ATen ops", "guards and dispatch",
              "engine Python")


def _is_kernel(name: str) -> bool:
    return name.startswith(("miniinfer::", GRAPH_EVENT)) or "cpp_fused" in name


def step_breakdown(engine, batch: int = 1, prompt_len: int = 64, steps: int = 40,
                   warmup: int = 8) -> pd.DataFrame:
    """ms per steady decode step in each of :data:`CATEGORIES` (and the step itself)."""
    lm = engine.lm
    params = SamplingParams(max_new_tokens=2 * (warmup + steps) + 8, ignore_eos=True)
    prompts = make_prompts(lm, batch, prompt_len)
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # compile
    ids = [engine.add_request(p, params) for p in prompts]
    try:
        while any(not r.output_ids for r in engine.requests.values()):
            engine.step()  # the prefill
        for _ in range(warmup):
            engine.step()
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
    finally:
        for rid in ids:
            engine.abort(rid)
    step_ms = statistics.median(walls) * 1e3
    weights = other = aten = dispatch = 0.0
    events = prof.key_averages()
    for event in events:
        self_ms = event.self_cpu_time_total / 1e3 / steps
        if event.key in WEIGHT_OPS:
            weights += self_ms
        elif _is_kernel(event.key):
            other += self_ms
        elif event.key.startswith("aten::"):
            aten += self_ms
        elif event.key.startswith(DISPATCH_EVENTS) or event.key == "model_forward":
            dispatch += self_ms
    profiled_step = events.self_cpu_time_total / 1e3 / steps
    host = max(0.0, step_ms - weights - other)
    # The host's split, as the profile saw it (the profiler's own overhead shared in proportion).
    profiled_host = {"ATen ops": aten, "guards and dispatch": dispatch,
                     "engine Python": max(0.0, profiled_step - weights - other - aten - dispatch)}
    total = max(sum(profiled_host.values()), 1e-9)
    split = {"weight-reading kernels": weights, "other kernels": other,
             **{name: host * ms / total for name, ms in profiled_host.items()}}
    return pd.DataFrame([{"category": c, "ms": split[c]} for c in CATEGORIES]
                        + [{"category": "step", "ms": step_ms}])
