"""Numbers the book computes rather than measures, checked against hand arithmetic on the tiny
model: whether a request fits the KV pool, and the decode floor's bytes and FLOPs.

tiny: 3 layers, 4 query heads sharing 2 KV heads of 16 dims (grouped-query attention),
hidden 64, MLP 128, vocabulary 49152, tied embeddings, fp32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.bench.devices import DecodeFloor, decode_floor, kv_bytes_per_token

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 3, 4, 2, 16, 64, 128, 49152
PARAMS = (VOCAB * HIDDEN  # the embedding, also the LM head
          + LAYERS * (2 * HIDDEN * HIDDEN  # q and o
                      + 2 * HIDDEN * KV_HEADS * HEAD_DIM  # k and v
                      + 3 * HIDDEN * MLP  # gate, up, down
                      + 2 * HIDDEN)  # the two norms
          + HIDDEN)  # the final norm


@pytest.mark.parametrize("stage", ["continuous", "prefix-cache"])
def test_a_request_that_fills_the_pool_exactly_is_served(stage, tiny):
    # 2 blocks of 4 tokens. 4 prompt tokens and 5 new ones: the last new token is sampled,
    # never fed, so the cache holds 8 tokens at most: the whole pool, not one more.
    engine = make_engine(stage, tiny, block_size=4, num_blocks=2)
    engine.add_request([11, 12, 13, 14], SamplingParams(max_new_tokens=5, ignore_eos=True),
                       request_id="fits")
    in_use = []
    while engine.has_unfinished_requests():
        result = engine.step()
        in_use.append(result.num_blocks_in_use)
        outputs = result.outputs
    assert outputs[0].request_id == "fits" and len(outputs[0].output_ids) == 5
    # The prefill takes one block, the fifth token the second; the last step gives both back.
    assert in_use == [1, 2, 2, 2, 0] and not engine.kv_cache.block_manager.block_tables
    engine.validate([[11] * 8], SamplingParams(max_new_tokens=1))  # the prompt alone fills it
    with pytest.raises(InvalidRequestError, match="needs 3 KV blocks, more than the whole pool "
                                                  "of 2"):
        engine.validate([[11, 12, 13, 14]], SamplingParams(max_new_tokens=6))
    with pytest.raises(InvalidRequestError, match="needs 3 KV blocks"):
        engine.add_request([11] * 9, SamplingParams(max_new_tokens=1))


def test_weight_and_kv_bytes_are_the_model_s(tiny):
    assert tiny.weight_bytes == 4 * PARAMS  # the tied LM head counted once
    # K and V, every layer, the KV heads only (not the query heads), 4 bytes each.
    assert kv_bytes_per_token(tiny) == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 == 768


@pytest.mark.parametrize("batch, context", [(1, 64), (8, 300)])
def test_decode_floor_flops_count_every_query_head(tiny, batch, context):
    floor = decode_floor(tiny, batch, context, bandwidth=2e9, peak_flops=5e10)
    # 2 FLOPs (multiply, add) per weight per token; attention: q.k over the context and the
    # weighted sum of V, each 2 FLOPs per element, for every query head (4, though only 2 KV
    # heads are stored).
    attention = 2 * 2 * context * HEAD_DIM * HEADS * LAYERS
    assert floor.flops == batch * (2 * PARAMS + attention)
    assert floor.weight_bytes == 4 * PARAMS
    assert floor.kv_bytes == batch * context * 768
    assert floor.memory_ms == pytest.approx((4 * PARAMS + batch * context * 768) / 2e9 * 1e3)
    assert floor.compute_ms == pytest.approx(floor.flops / 5e10 * 1e3)


def test_decode_floor_is_the_slower_of_its_two_roofs():
    memory_bound = DecodeFloor(weight_bytes=600, kv_bytes=400, bandwidth=1e6, flops=1e3,
                               peak_flops=1e9)
    assert memory_bound.memory_ms == pytest.approx(1.0)
    assert memory_bound.compute_ms == pytest.approx(1e-3)
    assert memory_bound.step_ms == memory_bound.memory_ms and memory_bound.bound == "memory"
    compute_bound = DecodeFloor(600, 400, 1e6, flops=3e6, peak_flops=1e9)
    assert compute_bound.step_ms == pytest.approx(3.0) and compute_bound.bound == "compute"
    # Equal roofs: memory-bound (compute must be strictly slower to be the bound).
    tie = DecodeFloor(600, 400, 1e6, flops=1e6, peak_flops=1e9)
    assert tie.bound == "memory" and tie.step_ms == pytest.approx(1.0)
    # No compute roof known (nan, or zero): the memory floor alone.
    for peak in (float("nan"), 0.0):
        unknown = DecodeFloor(600, 400, 1e6, flops=3e6, peak_flops=peak)
        assert unknown.step_ms == pytest.approx(1.0) and unknown.bound == "memory"


def test_kv_bytes_use_the_config_s_head_dim_or_derive_it():
    def model(head_dim: int | None) -> SimpleNamespace:
        config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, hidden_size=64,
                                 num_attention_heads=2, head_dim=head_dim)
        return SimpleNamespace(config=config, dtype=torch.bfloat16)

    # K and V, 2 layers, 1 KV head, 2 bytes: head_dim as given (48, not 64 / 2), or 64 / 2.
    assert kv_bytes_per_token(model(48)) == 2 * 2 * 1 * 48 * 2
    assert kv_bytes_per_token(model(None)) == 2 * 2 * 1 * 32 * 2
