"""Chapter 13: int4 from the GGUF's own Q4_1 blocks, int8 weight-only, and the stage on them."""

from __future__ import annotations

import pytest
import torch

from miniinfer import SamplingParams, make_engine
from miniinfer.bench.quality import perplexity, top1_agreement
from miniinfer.core.errors import MiniInferError
from miniinfer.engines import resolve_engine
from miniinfer.runner.model import Linear, load
from miniinfer.runner.quantized import (
    Int4Linear,
    Int8Linear,
    int4_blocks,
    q4_1_blocks,
    q4_1_quantize,
    quantize_model,
    quantized,
    unpermute_rows,
    weight_bytes,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the river, there lived",
           "Question: what is 2 + 2? Answer:", "The three primary colours are",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def blocks(smollm2):
    return int4_blocks(smollm2)


def test_every_q4_1_tensor_reproduces_the_fp32_weights_hf_loads_bit_for_bit(smollm2, blocks):
    state = smollm2.model.state_dict()
    # 30 layers x 7 projections: every Q4_1 tensor the file has (embedding Q8_0, norms F32).
    assert len(blocks) == 30 * 7
    for name, weight in blocks.items():
        assert torch.equal(weight.dequantize(), state[f"{name}.weight"]), name


def test_the_int4_ops_weights_are_the_files_exactly_in_fp32(smollm2, blocks):
    """scale = d, zero = m + 8d: the op's (q - 8) * scale + zero is the file's d * q + m,
    bit for bit with fp32 activations (the identity matrix reads the weights back); in bf16
    the scales are rounded to bf16, within 2^-8 of each weight's block range."""
    weight = blocks["model.layers.3.self_attn.q_proj"]  # un-permuted rows
    dense = smollm2.model.state_dict()["model.layers.3.self_attn.q_proj.weight"]
    eye = torch.eye(dense.shape[1])
    assert torch.equal(Int4Linear(weight, compute_dtype=torch.float32)(eye).t(), dense)
    read_bf16 = Int4Linear(weight)(eye).t()
    block_range = (weight.d * 15).repeat_interleave(32, 1)
    assert ((read_bf16 - dense).abs() <= block_range * 2 ** -7 + 1e-6).all()


def test_q4_1_blocks_parse_gguf_bytes_and_quantize_by_its_rule():
    gguf_quants = pytest.importorskip("gguf.quants")
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    # Edge blocks: a constant one (d = 0) and one whose range is exactly 15 (d = 1).
    w[0, :32] = 0.25
    w[1, :32] = torch.linspace(-3.0, 12.0, 32)
    raw = gguf_quants.quantize(w.numpy(), gguf_quants.GGMLQuantizationType.Q4_1)
    parsed = q4_1_blocks(raw)
    ours = q4_1_quantize(w)
    assert torch.equal(parsed.q, ours.q) and torch.equal(parsed.d, ours.d)
    assert torch.equal(parsed.m, ours.m)
    assert (parsed.dequantize() - w).abs().max() <= (parsed.d.max() / 2 + 1e-6)


def test_unpermute_rows_undoes_llama_cpps_rope_permutation():
    heads, dim = 3, 4
    hf = torch.arange(heads * dim)
    # llama.cpp's convert script: reshape(heads, 2, dim/2).swapaxes(1, 2)
    gguf = hf.view(heads, 2, dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf[unpermute_rows(heads * dim, heads)], hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linears_equal_their_dequantized_dense_product(dtype):
    torch.manual_seed(0)
    w, x = torch.randn(48, 64), torch.randn(5, 64)
    q4 = q4_1_quantize(w)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.15, rtol=0.02)
    torch.testing.assert_close(Int4Linear(q4, compute_dtype=dtype)(x),
                               x @ q4.dequantize().t(), **tol)
    int8 = Int8Linear(w, compute_dtype=dtype)
    torch.testing.assert_close(int8(x), x @ int8.dequantize().t(), **tol)
    assert (int8.dequantize() - w).abs().max() <= w.abs().max() / 127
    # Each weight within half a step of its row's scale: the row's largest is code 127.
    assert ((int8.dequantize() - w).abs() <= 0.51 * int8.scales.float()[:, None]).all()
    # A bias (Qwen2's projections have one) is added after the product; the shape is the file's.
    bias = torch.randn(48)
    for linear, dense in ((Int4Linear(q4, bias, compute_dtype=dtype), q4.dequantize()),
                          (Int8Linear(w, bias, compute_dtype=dtype), int8.dequantize())):
        assert linear.out_features == 48
        torch.testing.assert_close(linear(x), x @ dense.t() + bias, **tol)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.bfloat16])
def test_quantized_linears_take_zero_rows(dtype):
    """A step may need no logits (a long prompt's first chunk): the LM head gets no rows and
    gives none, with its own width."""
    w = torch.randn(48, 64)
    for linear in (Int4Linear(q4_1_quantize(w), compute_dtype=dtype),
                   Int8Linear(w, compute_dtype=dtype)):
        assert linear(torch.randn(0, 64)).shape == (0, 48)
        assert linear(torch.randn(2, 0, 64)).shape == (2, 0, 48)


def test_quantize_model_swaps_every_linear_and_reads_fewer_bytes(tiny):
    dense = load(tiny.model)
    for bits, body in (("int8", Int8Linear), ("int4", Int4Linear)):
        model = quantize_model(dense, bits)
        kinds = {type(m) for n, m in model.named_modules()
                 if isinstance(m, Linear) and n.startswith("layers.")}
        assert kinds == {body}
        assert isinstance(model.lm_head, Int8Linear)
        assert weight_bytes(model) < weight_bytes(dense) / 3
    with pytest.raises(ValueError, match="int3"):
        quantize_model(dense, "int3")


def test_variants_are_listed_and_resolve():
    assert resolve_engine("quantized:int4") == (resolve_engine("quantized")[0],
                                                {"weights": "int4"})
    for variant in ("int8", "int4-eager", "int8-eager"):
        resolve_engine(f"quantized:{variant}")


@pytest.mark.parametrize("variant", ["int8-eager", "int4-eager"])
def test_eager_variants_build_and_generate(tiny, variant):
    tok = tiny.tokenizer
    engine = make_engine(f"quantized:{variant}", tiny, max_num_batched_tokens=16)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    out = engine.generate([tok.encode(p) for p in PROMPTS[:3]], params)
    assert [len(ids) for ids in out.token_ids] == [5, 5, 5]
    # A prompt longer than a step's tokens, alone: its first chunks' steps need no logits.
    assert len(engine.generate([list(range(5, 45))], params).token_ids[0]) == 5


def test_int4_on_the_stage_equals_its_model_run_whole(tiny):
    """The engine (paged KV, chunked prefill) greedy-decodes what the same int4 model decodes
    run over the whole sequence each step (fp32 tiny model: exact ties aside)."""
    from miniinfer.bench.quality import greedy_continuation

    tok = tiny.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    out = make_engine("quantized:int4-eager", tiny).generate(
        prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    model = quantized(tiny, "int4")
    assert out.token_ids == [greedy_continuation(model, p, 6) for p in prompts]


def test_int8_agrees_with_fp32_on_smollm2(smollm2):
    """Teacher-forced top-1 agreement with the fp32 model over 6 prompts x 16 tokens. Per
    channel int8 moves each weight by at most half a step (1/254 of its row's largest); the
    argmax only changes at near-ties, so at least 90% of positions must agree (measured:
    see data/results/ch13/NOTES.md)."""
    tok = smollm2.tokenizer
    agree, total = top1_agreement(load(smollm2.model), quantized(smollm2, "int8"),
                                  [tok.encode(p) for p in PROMPTS], new_tokens=16)
    assert agree / total >= 0.9, (agree, total)


def test_int4_perplexity_is_near_the_files_own(smollm2):
    """fp32 here IS the file's Q4_1 weights de-quantized, so int4 with fp32 activations has the
    file's body weights exactly; what moves its perplexity is the LM head, int8 per channel
    (measured +0.8% on these 64 tokens), and bf16 activations cost little more."""
    tok = smollm2.tokenizer
    ids = tok.encode(" ".join(PROMPTS))[:64]
    fp32 = perplexity(load(smollm2.model), ids)
    exact = perplexity(quantized(smollm2, "int4", torch.float32), ids)
    assert abs(exact / fp32 - 1) < 0.02
    assert abs(perplexity(quantized(smollm2, "int4"), ids) / fp32 - 1) < 0.1


def test_int4_is_refused_off_the_cpu(tiny):
    fake = type(tiny)(tiny.name, tiny.model, tiny.tokenizer, torch.device("cuda"), tiny.dtype,
                      tiny.eos_token_id, tiny.pad_token_id)
    with pytest.raises(MiniInferError, match="CPU"):
        make_engine("quantized:int4-eager", fake)


def test_a_quantized_rows_floor_is_its_own_bytes_not_the_fp32_models(smollm2):
    """The benchmark's floor for an int4 stage is what its step reads (codes and scales): a
    fraction of the fp32 floor hf's row has in the same run."""
    from miniinfer.bench.offline import BenchConfig, run_bench

    config = BenchConfig(("hf", "quantized:int4-eager"), (1,), prompt_len=8, new_tokens=2,
                         warmup=0, repeat=1)
    rows = run_bench(smollm2, config).set_index("engine")
    int4, fp32 = rows.loc["quantized:int4-eager"], rows.loc["hf"]
    assert int4.floor_memory_ms < fp32.floor_memory_ms / 3
