"""The one model definition (runner/model.py) and the step shapes it serves: swapping a kind of
Linear shares the weights, and a request scored at k + 1 positions in one step (speculative
decoding's verification, chapter 14) gets the logits k + 1 single steps give."""

from __future__ import annotations

import pytest
import torch

from miniinfer import SamplingParams
from miniinfer.core.kv_cache import KVCacheConfig
from miniinfer.core.scheduler import Request, RequestTimeline, ScheduledBatch
from miniinfer.runner import ModelRunner
from miniinfer.runner.model import Linear, load, swap_linears

# fp32 on the tiny model: the varlen kernel (k + 1 tokens) and the decode kernel (one at a
# time) sum the same products in another order, so the logits agree to rounding, not bits.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def test_the_model_is_built_once_and_swaps_share_its_weights(tiny):
    model = load(tiny.model)
    assert load(tiny.model) is model
    assert model.layers[0].attention.qkv.weight.shape[0] == sum(
        model.layers[0].attention.qkv_sizes)

    class Doubled(Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    names = []

    def factory(name: str, linear: Linear) -> Linear:
        names.append(name)
        return Doubled(linear.weight, linear.bias)

    swapped = swap_linears(model, factory)
    assert names[:4] == ["layers.0.attention.qkv", "layers.0.attention.out",
                         "layers.0.feed_forward.gate_up", "layers.0.feed_forward.down"]
    assert names[-1] == "lm_head" and len(names) == 4 * model.num_layers + 1
    assert isinstance(swapped.lm_head, Doubled) and type(model.lm_head) is Linear
    assert swapped.lm_head.weight is model.lm_head.weight  # shared, not copied
    assert swapped.layers[1].input_norm.weight is model.layers[1].input_norm.weight
    hidden = torch.randn(3, model.embed.shape[1])
    torch.testing.assert_close(swapped.head(hidden), 2 * model.head(hidden))


def test_hf_modules_run_on_our_weights_held_once(tiny):
    model = load(tiny.model)
    hf_layer = tiny.model.model.layers[1]
    q, k, v = model.layers[1].attention.qkv.weight.split(model.layers[1].attention.qkv_sizes)
    gate, up = model.layers[1].feed_forward.gate_up.weight.chunk(2)
    for hf_weight, ours in ((hf_layer.self_attn.q_proj.weight, q),
                            (hf_layer.self_attn.k_proj.weight, k),
                            (hf_layer.self_attn.v_proj.weight, v),
                            (hf_layer.mlp.gate_proj.weight, gate), (hf_layer.mlp.up_proj.weight, up),
                            (hf_layer.self_attn.o_proj.weight, model.layers[1].attention.out.weight),
                            (tiny.model.lm_head.weight, model.lm_head.weight)):
        assert hf_weight.data_ptr() == ours.data_ptr() and hf_weight.shape == ours.shape
    # Every HF parameter's memory is one of ours: nothing HF loaded is held besides.
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert {p.untyped_storage().data_ptr() for p in tiny.model.parameters()} <= ours
    assert model.embed.data_ptr() == model.lm_head.weight.data_ptr()  # tied: one copy


@pytest.mark.parametrize("k", [1, 3])
def test_k_plus_1_positions_scored_in_one_step_equal_k_plus_1_single_steps(tiny, k):
    assert tiny.dtype == torch.float32
    prompt = [(7 * j) % 3000 + 20 for j in range(11)]
    first = len(prompt) - (k + 1)
    logits = {}
    for how in ("one step", "single steps"):
        runner = ModelRunner(tiny, KVCacheConfig(num_blocks=8, block_size=4), forward="direct")
        request = Request("r", prompt, SamplingParams(), RequestTimeline(0.0))
        manager = runner.kv_cache.block_manager
        manager.add("r", len(prompt))
        with torch.inference_mode():
            plan = ScheduledBatch([(request, first)], []).plan(manager)
            assert plan.requests[0].token_ids == prompt[:first] and plan.requests[0].start == 0
            rows, requests = runner.execute(plan)
            assert rows.shape[0] == 0 and requests == []  # a partial prompt scores nothing
            request.num_computed_tokens = first
            if how == "one step":
                batch = ScheduledBatch([(request, k + 1)], [], num_scored={"r": k + 1})
                assert batch.num_decodes == 0  # the varlen kernel, causal over the k + 1
                plan = batch.plan(manager)
                assert (plan.requests[0].start, plan.requests[0].num_scored) == (first, k + 1)
                logits[how], requests = runner.execute(plan)
                assert requests == [0] * (k + 1)  # every row is the plan's first request
            else:
                parts = []
                for _ in range(k + 1):
                    batch = ScheduledBatch([(request, 1)], [], num_scored={"r": 1})
                    parts.append(runner.execute(batch.plan(manager))[0])
                    request.num_computed_tokens += 1
                logits[how] = torch.cat(parts)
    assert logits["one step"].shape == (k + 1, tiny.config.vocab_size)
    torch.testing.assert_close(logits["one step"], logits["single steps"], **TOLERANCE)
    # And both are HF's logits at those positions.
    with torch.inference_mode():
        hf = tiny.model(input_ids=torch.tensor([prompt])).logits[0, first:]
    torch.testing.assert_close(logits["one step"], hf, rtol=1e-4, atol=1e-4)
