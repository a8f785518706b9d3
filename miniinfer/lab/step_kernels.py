"""Chapter 11's step profile: where one compiled step's time goes, kernel by kernel.

The whole-workload profile (:func:`.catching.record_profiles`) shows the code inductor generated
as one entry, the GEMM templates of the decode buckets inside it. Compiled with inductor's
kernel profile (``CompileOptions.kernel_profile``), every loop and GEMM template it generates
is a profiler event of its own, so a step splits into its matmuls (the template's by
projection; oneDNN's, from 48 tokens on a CPU with AVX2 only and 16 with AVX-512, as one
part), its attention (the C++ kernel; SDPA by segment for prompt chunks where it does not
build), the
fused small ops (RMSNorm, RoPE, SiLU-times-up, the K/V writes, the residual adds), and the
rest: the graphs' Python wrappers, scheduling, sampling and the profiler's own cost, as the
step's wall time less the named parts. Each scenario profiles a few steps of one shape: decode
steps of 1, 8 and 32 requests with contexts of about 256 tokens, and a 512-token step that
mixes 16 decodes with new prompts, as chapter 08's served steps do.

vLLM's steps split the same way (:func:`profile_vllm_steps`): its driver profiles a window of
steps of the whole batch (and, in the mixed scenario, the new prompts added before each), and
its ops fall into the same kinds (its matmuls are oneDNN calls by name, its attention a kernel
of its own, its small ops inductor's code).
"""

from __future__ import annotations

import contextlib
import re
import statistics
from dataclasses import dataclass

import pandas as pd
from torch import nn

from ..bench.offline import make_prompts
from ..core.sampling import SamplingParams

# The parts of a step the table names (``_part``); ``kind_of`` orders them.
TEMPLATE_GEMM = "template GEMM"
ONEDNN = "oneDNN matmuls (every projection)"
# (Profiles recorded up to git afd74f1 name it "attention: C++ kernel (decodes)": there
# prompt chunks went through SDPA by segment.)
ATTENTION_KERNEL = "attention: C++ kernel"
ATTENTION_SEGMENTS = "attention: SDPA by segment (prompt chunks)"
FUSED = "fused small ops (norms, RoPE, SiLU-mul, K/V writes)"
REST = "the rest (graph wrappers, scheduling, sampling, Python, profiler)"
# Ops whose inclusive time is a part (their children are theirs); every other named part is a
# leaf event (a generated kernel), counted by its self time.
_OPS = {"miniinfer::onednn_linear": ONEDNN,
        "miniinfer::paged_token_attention": ATTENTION_KERNEL,
        "miniinfer::segment_attention": ATTENTION_SEGMENTS}
_GEMM_KERNEL = re.compile(r"gemm_m\d+n(\d+)k(\d+)")
_FUSED_KERNEL = re.compile(r"cpp_fused_")
# vLLM's parts, every op by its self time: its attention with the wrappers around it and its
# K/V writes (which our step counts among the fused ops), and its compiled graphs' own code
# (inductor's loops for its norms, RoPE and SiLU-mul; their calls out are the named ops).
VLLM_ATTENTION = "attention: vLLM's CPU kernel, its K/V writes and wrappers"
VLLM_GRAPHS = "compiled graphs' own code (norms, RoPE, SiLU-mul)"
_VLLM_OPS = {"_C::onednn_mm": ONEDNN, "_C::cpu_attention_with_kv_cache": VLLM_ATTENTION,
             "_C::cpu_attn_reshape_and_cache": VLLM_ATTENTION,
             "vllm::unified_attention_with_output": VLLM_ATTENTION,
             "vllm::unified_kv_cache_update": VLLM_ATTENTION}
_COMPILED_GRAPH_CALL = re.compile(r"^## Call CompiledFxGraph .* ##$")


@dataclass(frozen=True, slots=True)
class StepScenario:
    """Profiled steps of one shape: ``decodes`` requests decoding, their prompts
    ``context`` tokens long; with ``new_prompts``, that many prompts of ``new_prompt_len``
    tokens join every profiled step (each ends with its first token)."""

    name: str
    decodes: int
    context: int
    new_prompts: int = 0
    new_prompt_len: int = 0

    @property
    def tokens(self) -> int:
        return self.decodes + self.new_prompts * self.new_prompt_len


SCENARIOS = (StepScenario("1 decode", 1, 256), StepScenario("8 decodes", 8, 256),
             StepScenario("32 decodes", 32, 256),
             StepScenario("16 decodes + 8 prompts of 62", 16, 256, 8, 62))


def projection_names(model: nn.Module) -> dict[tuple[int, int], str]:
    """The projections of the model the forward runs (:mod:`miniinfer.runner.model`, built
    from the HF ``model``) by the (output, input) sizes a GEMM kernel's name gives: the fused
    query/key/value and gate/up projections, the output and down projections, the LM head;
    the names of those sharing a shape joined."""
    from ..runner.model import Linear, load

    ours = load(model)
    named = [(name.rpartition(".")[2], m) for name, m in ours.layers[0].named_modules()
             if isinstance(m, Linear)] + [("lm_head", ours.lm_head)]
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, linear in named:
        out_features, in_features = linear.weight.shape
        by_shape.setdefault((out_features, in_features), []).append(name)
    return {shape: "/".join(names) for shape, names in by_shape.items()}


# The kinds of part, in the order a table lists them.
KINDS = ("matmuls", "attention", "fused small ops", "the rest")


def kind_of(part: str) -> int:
    """Where a part sits in :data:`KINDS` (a table's sort key)."""
    if part.startswith(TEMPLATE_GEMM) or part == ONEDNN:
        return 0
    if part.startswith("attention"):
        return 1
    return 2 if part in (FUSED, VLLM_GRAPHS) else 3


def _part(op: str, projections: dict[tuple[int, int], str]) -> str | None:
    """Which part of the step an event is (None: the rest)."""
    if op in _OPS:
        return _OPS[op]
    if gemm := _GEMM_KERNEL.search(op):
        shape = (int(gemm[1]), int(gemm[2]))
        return f"{TEMPLATE_GEMM} {projections.get(shape, f'n{shape[0]} k{shape[1]}')}"
    if _FUSED_KERNEL.search(op):
        return FUSED
    return None


def joining_prompts(lm, scenario: StepScenario, step: int) -> list[list[int]]:
    """The new prompts that join the ``step``-th (from 1) warm or profiled step of
    ``scenario``: new ones each step (a prefix cache would skip repeated ones), the same on
    every system profiled."""
    return make_prompts(lm, scenario.new_prompts, scenario.new_prompt_len, seed=step)


def profile_scenario(engine, scenario: StepScenario, steps: int, forward=None,
                     warm_steps: int = 3) -> pd.DataFrame:
    """``steps`` steps of ``scenario`` on ``engine`` (an idle continuous engine) under
    torch.profiler (:func:`_scenario_steps`) -> one row per part: ``ms_per_step`` and
    ``share_pct`` of the steps' wall time. ``forward``: the forward the warm and profiled steps
    run (default: the engine's own), over the engine's pool."""
    from torch.profiler import ProfilerActivity, profile

    projections = projection_names(engine.model)
    prof = profile(activities=[ProfilerActivity.CPU])
    wall_s = sum(_scenario_steps(engine, scenario, steps, forward, warm_steps, prof))
    parts: dict[str, float] = {}
    for event in prof.key_averages():
        part = _part(event.key, projections)
        if part is not None:
            us = event.cpu_time_total if event.key in _OPS else event.self_cpu_time_total
            parts[part] = parts.get(part, 0.0) + us / 1e3
    return _parts_table(parts, wall_s, steps, scenario, "compiled")


def time_scenario(engine, scenario: StepScenario, steps: int, warm_steps: int = 3) -> list[float]:
    """The same steps as :func:`profile_scenario`, on the engine's own forward and with no
    profiler -> each step's seconds. The profiler costs a step something per op it records, and
    ours calls more ops than vLLM's (a Python custom op for each oneDNN matmul, every generated
    kernel an event with the kernel profile), so a comparison of whole steps needs these."""
    return _scenario_steps(engine, scenario, steps, None, warm_steps, contextlib.nullcontext())


def _scenario_steps(engine, scenario: StepScenario, steps: int, forward,
                    warm_steps: int, around: contextlib.AbstractContextManager) -> list[float]:
    """``scenario``'s requests' prompts, then ``warm_steps`` steps, then ``steps`` steps inside
    ``around`` -> those steps' seconds. The prompts run on the engine's own forward, so that
    their odd-sized last steps use graphs the engine has, not new ones compiled for a profile;
    the other steps on ``forward`` (default: the engine's own). Raises if a step inside is not
    the scenario's shape (the engine scheduled something else)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("a step profile needs an idle engine")
    runner = engine.runner
    own, forward = runner.forward, forward or runner.forward
    # Enough tokens for every step until the last profiled one: a request whose prompt ends
    # early decodes in each later prompt step, of which there are at most this many.
    budget = engine.scheduler.config.max_num_batched_tokens
    prompt_steps = -(-scenario.decodes * scenario.context // max(budget - scenario.decodes, 1))
    decoding = SamplingParams(max_new_tokens=prompt_steps + warm_steps + steps + 2,
                              ignore_eos=True)
    for prompt in make_prompts(engine.lm, scenario.decodes, scenario.context):
        engine.add_request(prompt, decoding)
    taken = 0  # steps taken after the prompts

    def one_step(check: bool) -> float:
        nonlocal taken
        taken += 1
        for prompt in joining_prompts(engine.lm, scenario, taken):
            engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        step = engine.step()
        shape = (step.num_decodes, step.num_prefill_tokens)
        if check and shape != (scenario.decodes, scenario.tokens - scenario.decodes):
            raise RuntimeError(f"{scenario.name}: a profiled step ran {shape[0]} decodes and "
                               f"{shape[1]} prompt tokens")
        return step.end - step.start

    try:
        while engine.step().num_prefill_tokens:
            pass  # the prompts, in chunks of the token budget
        runner.forward = forward
        for _ in range(warm_steps):
            one_step(check=False)
        with around:
            return [one_step(check=True) for _ in range(steps)]
    finally:  # the engine idle again and on its own forward, whatever happened
        runner.forward = own
        for request_id in list(engine.requests):
            engine.abort(request_id)


def profile_vllm_steps(peer, lm, scenario: StepScenario, steps: int,
                       warm_steps: int = 3) -> pd.DataFrame:
    """``steps`` steps of ``scenario`` on ``peer``, a vLLM engine built in its driver's
    process, after its prompts and ``warm_steps`` steps -> the rows of
    :func:`profile_scenario`, in vLLM's parts, with the same new prompts
    (:func:`joining_prompts`)."""
    window = _vllm_window(peer, lm, scenario, steps, warm_steps, profile=True)
    parts: dict[str, float] = {}
    for op in window["ops"]:
        part = _VLLM_OPS.get(op["op"]) or (VLLM_GRAPHS if _COMPILED_GRAPH_CALL.match(op["op"])
                                           else None)
        if part is not None:
            parts[part] = parts.get(part, 0.0) + op["self_ms"]
    return _parts_table(parts, window["wall_s"], window["steps"], scenario, "vLLM")


def time_vllm_steps(peer, lm, scenario: StepScenario, steps: int,
                    warm_steps: int = 3) -> list[float]:
    """:func:`profile_vllm_steps`'s steps with no profiler -> each step's seconds (see
    :func:`time_scenario`)."""
    return _vllm_window(peer, lm, scenario, steps, warm_steps, profile=False)["step_s"]


def _vllm_window(peer, lm, scenario: StepScenario, steps: int, warm_steps: int,
                 profile: bool) -> dict:
    joiners = [joining_prompts(lm, scenario, k) for k in range(1, warm_steps + steps + 1)] \
        if scenario.new_prompts else None
    return peer.profile_steps(make_prompts(lm, scenario.decodes, scenario.context),
                              warm_steps, steps, joiners, profile=profile)


def median_round(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Of one system's and scenario's profiles over several rounds, the one whose step time is
    the median (the lower middle of an even count), its parts as profiled (medians taken part
    by part would not add up to a step), with ``rounds`` and the range of the rounds' step
    times (``step_ms_min``, ``step_ms_max``). Where the rounds also timed their steps without
    the profiler (an ``unprofiled_step_ms`` column, each round's median step), that column
    becomes the median of the rounds', with its range (``unprofiled_ms_min``, ``_max``)."""
    step_ms = [float(t.step_ms.iloc[0]) for t in tables]
    middle = step_ms.index(statistics.median_low(step_ms))
    kept = tables[middle].assign(rounds=len(tables), step_ms_min=min(step_ms),
                                 step_ms_max=max(step_ms))
    if all("unprofiled_step_ms" in t for t in tables):
        unprofiled = [float(t.unprofiled_step_ms.iloc[0]) for t in tables]
        kept = kept.assign(unprofiled_step_ms=statistics.median_low(unprofiled),
                           unprofiled_ms_min=min(unprofiled), unprofiled_ms_max=max(unprofiled))
    return kept


def round_ratios(theirs: list[pd.DataFrame], ours: list[pd.DataFrame]) -> dict[str, float]:
    """Round by round, one system's unprofiled step over another's timed in the same round
    (each a table with ``unprofiled_step_ms``, the rounds in the same order) -> the ratios'
    median (the lower middle of an even count) and range, as ``unprofiled_vs_compiled``,
    ``_min`` and ``_max``. On a host whose speed drifts between rounds, the steps of one round
    ran at one speed: their ratios compare the systems where the medians of each would not."""
    ratios = [float(t.unprofiled_step_ms.iloc[0]) / float(o.unprofiled_step_ms.iloc[0])
              for t, o in zip(theirs, ours, strict=True)]
    return {"unprofiled_vs_compiled": statistics.median_low(ratios),
            "unprofiled_vs_compiled_min": min(ratios), "unprofiled_vs_compiled_max": max(ratios)}


def kept_rounds(profiles: dict[tuple[str, str], list[pd.DataFrame]]) -> pd.DataFrame:
    """Each (system, scenario)'s rounds of profiles -> its :func:`median_round`, and for a
    system other than ``compiled`` its steps against ours of the same rounds
    (:func:`round_ratios`), as one table."""
    kept = []
    for (system, name), tables in profiles.items():
        table = median_round(tables)
        if system != "compiled" and ("compiled", name) in profiles:
            table = table.assign(**round_ratios(tables, profiles["compiled", name]))
        kept.append(table)
    return pd.concat(kept, ignore_index=True)


def _parts_table(parts: dict[str, float], wall_s: float, steps: int, scenario: StepScenario,
                 system: str) -> pd.DataFrame:
    """Named parts' ms over ``steps`` steps of ``wall_s`` -> one row per part, the rest (the
    wall time less the named parts) included, in :data:`KINDS` order."""
    parts = {**parts, REST: max(wall_s * 1e3 - sum(parts.values()), 0.0)}
    table = pd.DataFrame({"part": list(parts), "ms": list(parts.values())})
    table = table.assign(ms_per_step=table.ms / steps,
                         share_pct=100 * table.ms / table.ms.sum()).drop(columns="ms")
    table = table.sort_values("ms_per_step", ascending=False, ignore_index=True)
    table = table.sort_values("part", key=lambda parts: parts.map(kind_of), kind="stable",
                              ignore_index=True)
    return table.assign(system=system, scenario=scenario.name, tokens=scenario.tokens,
                        steps=steps, step_ms=wall_s * 1e3 / steps)
