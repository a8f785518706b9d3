"""Chapter 11's step profile: compiled with inductor's kernel profile, a step's time splits into
its GEMMs by projection, its attention and its fused small ops, and the parts add up to the
steps' wall time; a step of another shape than the scenario's is an error, not a row."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from miniinfer import make_engine
from miniinfer.lab import step_kernels
from miniinfer.lab.step_kernels import (
    ATTENTION_KERNEL,
    ATTENTION_SEGMENTS,
    FUSED,
    ONEDNN,
    REST,
    TEMPLATE_GEMM,
    StepScenario,
    profile_scenario,
    projection_names,
    time_scenario,
)
from miniinfer.runner.compiled import CompileOptions
from miniinfer.runner.onednn_linear import onednn_available

# Decodes of 2 requests run the autotuned template bucket of 4 tokens; the 16-token bucket
# (prompts, and the mixed step) runs oneDNN where this torch has it, and attends through the
# C++ kernel (where it does not build, by segment past its first 4 tokens).
OPTIONS = CompileOptions(token_buckets=(4, 8, 16), onednn_min_tokens=16,
                         onednn_min_tokens_avx2=16, segment_attention_min_tokens=16,
                         fused_attention_rows=4, kernel_profile=True)
DECODES = StepScenario("2 decodes", 2, 20)
MIXED = StepScenario("2 decodes + 2 prompts of 7", 2, 20, 2, 7)


def test_kernel_names_map_to_the_models_projections(tiny):
    projections = projection_names(tiny.model)
    # The forward's own model: query/key/value fused (64 + 2 x 32 rows), gate/up fused.
    assert projections == {(128, 64): "qkv", (64, 64): "out", (256, 64): "gate_up",
                           (64, 128): "down", (49152, 64): "lm_head"}
    part = step_kernels._part
    assert part("graph_1_gemm_m4n256k64_kernel", projections) == f"{TEMPLATE_GEMM} gate_up"
    assert part("graph_3_gemm_m4n7k9_kernel", projections) == f"{TEMPLATE_GEMM} n7 k9"
    assert part("graph_1_cpp_fused_add_mean_mul_pow_rsqrt_7", projections) == FUSED
    assert part("miniinfer::paged_token_attention", projections) == ATTENTION_KERNEL
    assert part("aten::argmax", projections) is None


@pytest.fixture(scope="module")
def engine(tiny):
    engine = make_engine("compiled", tiny, compile_options=OPTIONS, max_num_batched_tokens=16,
                         warm_up=False)
    yield engine
    engine.close()


def _parts(table) -> dict[str, float]:
    return dict(zip(table.part, table.ms_per_step, strict=True))


def test_a_decode_step_splits_into_template_gemms_attention_and_fused_ops(tiny, engine):
    table = profile_scenario(engine, DECODES, steps=3)
    parts = _parts(table)
    gemms = {p.removeprefix(f"{TEMPLATE_GEMM} ") for p in parts if p.startswith(TEMPLATE_GEMM)}
    # Every projection is a template kernel of its own, named for what it computes.
    assert gemms == set(projection_names(tiny.model).values())
    assert parts[FUSED] > 0 and REST in parts and ONEDNN not in parts
    if engine.runner.forward.reason_fused is None:
        assert parts[ATTENTION_KERNEL] > 0
    assert ATTENTION_SEGMENTS not in parts  # decodes only: no prompt chunk
    assert table.ms_per_step.sum() == pytest.approx(table.step_ms.iloc[0], rel=1e-6)
    assert table.share_pct.sum() == pytest.approx(100)
    kinds = list(table.part.map(step_kernels.kind_of))  # matmuls, attention, fused, the rest
    assert kinds == sorted(kinds) and table.part.iloc[-1] == REST
    assert (table.scenario == DECODES.name).all() and (table.tokens == 2).all()
    assert not engine.has_unfinished_requests()


def test_a_mixed_step_attends_its_prompt_chunks_through_the_kernel_or_by_segment(engine):
    parts = _parts(profile_scenario(engine, MIXED, steps=2))
    if engine.runner.forward.reason_fused is None:  # the C++ kernel: every token, no SDPA
        assert parts[ATTENTION_KERNEL] > 0 and ATTENTION_SEGMENTS not in parts
    else:
        assert parts[ATTENTION_SEGMENTS] > 0
    if onednn_available(engine.device):
        assert parts[ONEDNN] > 0
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("measure", [profile_scenario, time_scenario])
def test_a_step_of_another_shape_is_an_error_and_leaves_the_engine_idle(engine, measure):
    # 2 decodes and 2 prompts of 9 tokens are 20 tokens: more than the budget of 16.
    own = engine.runner.forward
    with pytest.raises(RuntimeError, match="a profiled step ran 2 decodes and 14 prompt"):
        measure(engine, StepScenario("too big", 2, 20, 2, 9), steps=2)
    assert not engine.has_unfinished_requests() and engine.runner.forward is own


def test_unprofiled_steps_run_on_the_engines_own_forward_with_no_profiler(engine, monkeypatch):
    seen = []
    own = engine.runner.forward

    def forward(*args, **kwargs):  # whether a profiler was on for each step's forward
        seen.append(torch.autograd.profiler._is_profiler_enabled)
        return own(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", forward)
    step_s = time_scenario(engine, MIXED, steps=3, warm_steps=1)
    assert len(step_s) == 3 and all(s > 0 for s in step_s)
    # The prompts' steps, the warm one and the three timed ones, none profiled.
    assert len(seen) >= 5 and not any(seen)
    assert engine.runner.forward is forward and not engine.has_unfinished_requests()
    seen.clear()  # the same steps profiled: the last two forwards under the profiler
    profile_scenario(engine, MIXED, steps=2, warm_steps=1)
    assert seen[-2:] == [True, True] and not any(seen[:-2])


class _WindowPeer:
    """A vLLM peer's profiled window, as its driver answers it (ms over 2 steps of 100 ms)."""

    def profile_steps(self, prompts, warm_steps, steps, joiners, profile=True):
        self.asked = (len(prompts), {len(p) for p in prompts}, warm_steps, steps)
        self.joiners, self.profiled = joiners, profile
        if not profile:
            return {"steps": 2, "wall_s": 0.21, "step_s": [0.1, 0.11], "ops": []}
        ops = {"_C::onednn_mm": 120.0, "_C::cpu_attention_with_kv_cache": 30.0,
               "_C::cpu_attn_reshape_and_cache": 4.0, "vllm::unified_attention_with_output": 2.0,
               "## Call CompiledFxGraph fkh3x2 ##": 6.0, "aten::view": 1.0}
        return {"steps": 2, "wall_s": 0.2,
                "ops": [{"op": op, "calls": 2, "self_ms": ms, "total_ms": ms}
                        for op, ms in ops.items()]}


def test_vllms_window_splits_into_the_same_kinds(tiny):
    peer = _WindowPeer()
    table = step_kernels.profile_vllm_steps(peer, tiny, DECODES, steps=2, warm_steps=3)
    assert peer.asked == (2, {20}, 3, 2) and peer.joiners is None
    assert _parts(table) == pytest.approx({
        ONEDNN: 60.0, step_kernels.VLLM_ATTENTION: 18.0, step_kernels.VLLM_GRAPHS: 3.0,
        REST: 19.0})  # 100 ms a step less the named parts (aten::view among the rest)
    assert set(table.system) == {"vLLM"} and table.step_ms.iloc[0] == pytest.approx(100.0)
    assert [step_kernels.kind_of(p) for p in table.part] == [0, 1, 2, 3]
    assert peer.profiled


def test_vllms_steps_timed_with_no_profiler_are_the_same_window_unprofiled(tiny):
    peer = _WindowPeer()
    assert step_kernels.time_vllm_steps(peer, tiny, MIXED, steps=2, warm_steps=3) == [0.1, 0.11]
    assert peer.asked == (2, {20}, 3, 2) and peer.profiled is False
    assert peer.joiners == [step_kernels.joining_prompts(tiny, MIXED, k) for k in range(1, 6)]


def test_vllms_mixed_window_gets_new_prompts_before_every_step(tiny):
    peer = _WindowPeer()
    table = step_kernels.profile_vllm_steps(peer, tiny, MIXED, steps=2, warm_steps=3)
    assert peer.asked == (2, {20}, 3, 2)
    # Before each of the 3 warm and 2 profiled steps, 2 prompts of 7 tokens, none seen before
    # (vLLM's prefix cache would skip a repeated one's prefill).
    assert [[len(p) for p in step] for step in peer.joiners] == [[7, 7]] * 5
    assert len({tuple(p) for step in peer.joiners for p in step}) == 10
    # The prompts our own profile adds before the same steps.
    assert peer.joiners == [step_kernels.joining_prompts(tiny, MIXED, k) for k in range(1, 6)]
    assert set(table.scenario) == {MIXED.name} and set(table.tokens) == {16}


def test_the_median_round_is_kept_whole_with_the_rounds_range():
    def profile(step_ms, matmul_ms):
        return pd.DataFrame({"part": [ONEDNN, REST], "ms_per_step": [matmul_ms,
                                                                     step_ms - matmul_ms],
                             "step_ms": step_ms})

    rounds = [profile(110.0, 80.0), profile(95.0, 70.0), profile(100.0, 60.0)]
    kept = step_kernels.median_round(rounds)
    # The 100-ms round's parts as they were (not 70 ms of matmuls, the parts' own median).
    assert _parts(kept) == {ONEDNN: 60.0, REST: 40.0}
    assert set(kept.rounds) == {3} and set(kept.step_ms_min) == {95.0}
    assert set(kept.step_ms_max) == {110.0}
    # Of two, the faster: the lower middle.
    assert set(step_kernels.median_round(rounds[:2]).step_ms) == {95.0}
    assert "unprofiled_step_ms" not in kept


def test_the_unprofiled_step_is_the_median_of_the_rounds_own():
    rounds = [pd.DataFrame({"part": [REST], "ms_per_step": [step], "step_ms": step,
                            "unprofiled_step_ms": unprofiled})
              for step, unprofiled in ((110.0, 90.0), (95.0, 99.0), (100.0, 80.0))]
    kept = step_kernels.median_round(rounds)
    # The profiled parts are the 100-ms round's; the unprofiled step is the rounds' median,
    # 90 ms (not the kept round's 80), with the rounds' range.
    assert set(kept.step_ms) == {100.0} and set(kept.unprofiled_step_ms) == {90.0}
    assert set(kept.unprofiled_ms_min) == {80.0} and set(kept.unprofiled_ms_max) == {99.0}


def test_round_ratios_pair_each_round_with_its_own():
    def rounds(*ms):
        return [pd.DataFrame({"part": [REST], "unprofiled_step_ms": m}) for m in ms]

    # The host ran twice as fast in the second round and half as fast in the third: the
    # rounds' ratios are 0.8, 0.9 and 0.95, their median 0.9, where the systems' own medians
    # (80 against 100 ms) would say 0.8.
    ours, theirs = rounds(100.0, 50.0, 200.0), rounds(80.0, 45.0, 190.0)
    ratios = step_kernels.round_ratios(theirs, ours)
    assert ratios == {"unprofiled_vs_compiled": 0.9, "unprofiled_vs_compiled_min": 0.8,
                      "unprofiled_vs_compiled_max": 0.95}
    with pytest.raises(ValueError):  # rounds must pair up
        step_kernels.round_ratios(theirs[:2], ours)


def test_kept_rounds_give_vllms_rows_its_steps_against_ours():
    def rounds(*ms):
        return [pd.DataFrame({"part": [REST], "ms_per_step": m, "step_ms": m,
                              "unprofiled_step_ms": m}) for m in ms]

    table = step_kernels.kept_rounds({("compiled", "8 decodes"): rounds(100.0, 50.0, 200.0),
                                      ("vLLM", "8 decodes"): rounds(80.0, 45.0, 190.0)})
    ours, theirs = table.iloc[0], table.iloc[1]
    assert ours.unprofiled_step_ms == 100.0 and pd.isna(ours.unprofiled_vs_compiled)
    assert theirs.unprofiled_step_ms == 80.0 and theirs.unprofiled_vs_compiled == 0.9
