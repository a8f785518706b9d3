"""Chapter 13's kernel: Q4_1 and int8 linears with integer dot products (issue 80).

The kernel is held to its specification in PyTorch (the activations quantized per block of 32
exactly as the kernel does, the sums taken in float64) up to fp32 rounding, on every
instruction path this CPU has, over the row counts a step feeds it (1-16 and past a tile) and
ragged output widths; and to the de-quantize-then-matmul product within the error that
quantizing the activations costs. Where the kernel cannot run, it says why."""

from __future__ import annotations

import re

import pytest
import torch

from miniinfer.core.kernels import cpu_quantized
from miniinfer.runner.quantized import (
    Int4Linear,
    Int8Linear,
    q4_1_blocks,
    q4_1_quantize,
)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


# What this CPU should run, read from its flags, not from the kernel (whose loading is under
# test): on an x86-64 CPU with AVX2, FMA and F16C the kernel must build and run.
FLAGS = _cpu_flags()
EXPECTED_PATHS = (["avx2"] if {"avx2", "fma", "f16c"} <= FLAGS else []) + (
    ["avx512-vnni"] if {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                        "avx512_vnni"} <= FLAGS else [])
pytestmark = pytest.mark.skipif(not EXPECTED_PATHS,
                                reason="not an x86-64 CPU with AVX2, FMA and F16C (per "
                                       "/proc/cpuinfo): the kernel is not for it")
PATHS = ["avx2", "avx512-vnni"]


def test_the_kernel_builds_on_this_cpu_and_offers_the_paths_its_flags_name():
    assert cpu_quantized.load() is None
    assert cpu_quantized.instruction_sets() == EXPECTED_PATHS


def test_another_architecture_is_told_the_kernel_is_for_x86(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    reason = cpu_quantized.load.__wrapped__()  # not the cached answer of this machine
    assert reason == "the quantized kernel is written for x86-64 CPUs; this is aarch64"


def _path(isa: str) -> str:
    if isa not in cpu_quantized.instruction_sets():
        pytest.skip(f"this CPU has no {isa} (it has {cpu_quantized.instruction_sets()})")
    return isa


def _bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a sum of products: a few ulps of the sum of the terms' magnitudes."""
    return 1e-5 * (x.abs() @ dense.abs().t()) + 1e-6


def _rounding_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What quantizing the activations may cost against the float product: each code is
    within half a step of its value (a step is its block's scale, largest / 127)."""
    _, scales = cpu_quantized.quantize_activations(x)
    half_step = (scales / 2).repeat_interleave(cpu_quantized.BLOCK, 1)
    return 1.001 * half_step @ dense.abs().t() + _bound(x, dense)


SHAPES = [(1, 32, 1), (1, 576, 40), (2, 96, 3), (3, 64, 17), (4, 1536, 8), (5, 64, 5),
          (9, 160, 33), (16, 576, 24), (17, 64, 3)]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
def test_q4_1_kernel_equals_its_specification(isa, rows, in_features, out_features):
    torch.manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features) * torch.rand(rows, 1) * 4
    x[0, :32] = 0  # an all-zero activation block: scale 0, codes 0
    weight = q4_1_quantize(torch.randn(out_features, in_features))
    got = cpu_quantized.q4_1_linear(x, cpu_quantized.pack_q4_1(weight.file_blocks()),
                                    out_features, _path(isa))
    spec = cpu_quantized.reference_q4_1_linear(x, weight.d, weight.m, weight.q)
    dense = weight.dequantize()
    assert ((got - spec).abs() <= _bound(x, dense)).all()
    # Against the float product: within what the activations' rounding costs.
    assert ((got - x @ dense.t()).abs() <= _rounding_bound(x, dense)).all()


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
def test_int8_kernel_equals_its_specification(isa, rows, in_features, out_features):
    torch.manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features)
    codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    codes[0, :7] = torch.tensor([-127, 127, 0, -1, 1, -127, 127], dtype=torch.int8)
    scales = torch.rand(out_features) + 0.01
    got = cpu_quantized.int8_linear(x, cpu_quantized.pack_int8(codes), scales, _path(isa))
    spec = cpu_quantized.reference_int8_linear(x, codes, scales)
    dense = codes.float() * scales[:, None]
    assert ((got - spec).abs() <= _bound(x, dense)).all()
    assert ((got - x @ dense.t()).abs() <= _rounding_bound(x, dense)).all()


def test_activation_codes_round_to_nearest_and_keep_the_largest_at_127():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0 / 254] + [0.0] * 28])
    codes, scales = cpu_quantized.quantize_activations(x)
    assert scales.tolist() == [[pytest.approx(2.0 / 127)]]
    assert codes[0, :4].tolist() == [64, -127, 32, 32]  # 63.5 and 31.75 round up; the max is 127


def test_the_files_blocks_round_trip():
    weight = q4_1_quantize(torch.randn(6, 96))
    raw = weight.file_blocks()
    assert raw.shape == (6, 3 * 20) and raw.dtype == torch.uint8
    back = q4_1_blocks(raw.numpy())
    assert torch.equal(back.q, weight.q) and torch.equal(back.d, weight.d)
    assert torch.equal(back.m, weight.m)


def test_packing_interleaves_eight_rows_four_bytes_at_a_time_and_round_trips():
    """A group of 8 rows, block by block: the 8 d, the 8 m (fp16 bytes as in the file), then
    each 4 code bytes of rows 0..7 in turn; a ragged last group is padded with zero rows."""
    weight = q4_1_quantize(torch.randn(11, 64))
    raw = weight.file_blocks().view(11, 2, 20)
    packed = cpu_quantized.pack_q4_1(weight.file_blocks())
    assert packed.shape == (2, 2, 160) and packed.dtype == torch.uint8
    for row in (0, 5, 10):
        group, r = divmod(row, 8)
        for block in (0, 1):
            got = packed[group, block]
            assert torch.equal(got[2 * r:2 * r + 2], raw[row, block, 0:2])  # d
            assert torch.equal(got[16 + 2 * r:16 + 2 * r + 2], raw[row, block, 2:4])  # m
            for p in range(4):
                start = 32 + 32 * p + 4 * r
                assert torch.equal(got[start:start + 4], raw[row, block, 4 + 4 * p:8 + 4 * p])
    assert not packed[1, :, 32:].view(2, 4, 8, 4)[:, :, 3:].any()  # rows 11-15: padding
    codes = torch.randint(-127, 128, (13, 96), dtype=torch.int8)
    groups = cpu_quantized.pack_int8(codes)
    assert groups.shape == (2, 3, 256)
    assert torch.equal(groups[1, 2, 32 * 5 + 4 * 3:32 * 5 + 4 * 3 + 4], codes[11, 64 + 20:64 + 24])
    assert torch.equal(cpu_quantized.unpack_int8(groups, 13), codes)


@pytest.mark.parametrize("isa", PATHS)
def test_many_rows_of_x_read_each_group_once_and_agree_with_one_row_at_a_time(isa):
    """The rows of a verification or a batch go through the kernel together (four at a time
    per group): each row's output is what it gets alone, bit for bit."""
    torch.manual_seed(3)
    x = torch.randn(8, 576)
    weight = q4_1_quantize(torch.randn(40, 576))
    packed = cpu_quantized.pack_q4_1(weight.file_blocks())
    codes = torch.randint(-127, 128, (40, 576), dtype=torch.int8)
    groups, scales = cpu_quantized.pack_int8(codes), torch.rand(40)
    together = (cpu_quantized.q4_1_linear(x, packed, 40, _path(isa)),
                cpu_quantized.int8_linear(x, groups, scales, isa))
    for i in range(8):
        alone = (cpu_quantized.q4_1_linear(x[i:i + 1], packed, 40, isa),
                 cpu_quantized.int8_linear(x[i:i + 1], groups, scales, isa))
        assert torch.equal(together[0][i], alone[0][0]) and torch.equal(together[1][i], alone[1][0])


def test_the_linears_run_on_the_kernel_by_default_with_a_bias():
    torch.manual_seed(0)
    w, x, bias = torch.randn(24, 64), torch.randn(3, 2, 64), torch.randn(24)
    int4 = Int4Linear(q4_1_quantize(w), bias)
    int8 = Int8Linear(w, bias)
    assert int4.compute_dtype == int8.compute_dtype == torch.int8
    assert int4.out_features == int8.out_features == 24
    assert not hasattr(int4, "packed") and int4.blocks.dtype == torch.uint8
    assert not hasattr(int8, "codes") and int8.groups.shape == (3, 2, 256)  # packed only
    for linear, dense in ((int4, q4_1_quantize(w).dequantize()), (int8, int8.dequantize())):
        y = linear(x)
        assert y.shape == (3, 2, 24) and y.dtype == torch.float32
        flat = x.reshape(6, 64)
        assert ((y.reshape(6, 24) - (flat @ dense.t() + bias)).abs()
                <= _rounding_bound(flat, dense)).all()


@pytest.mark.parametrize(("call", "words"), [
    (lambda: cpu_quantized.q4_1_linear(torch.randn(2, 64), torch.zeros(1, 2, 20, dtype=torch.uint8),
                                       3), "packed Q4_1 weights must be contiguous"),
    (lambda: cpu_quantized.q4_1_linear(torch.randn(2, 32), torch.zeros(1, 2, 160, dtype=torch.uint8),
                                       3), "x has 32 features; the weight takes 64"),
    (lambda: cpu_quantized.q4_1_linear(torch.randn(2, 64), torch.zeros(1, 2, 160, dtype=torch.uint8),
                                       9), "out_features 9 does not fill 1 groups of 8 rows"),
    (lambda: cpu_quantized.int8_linear(torch.randn(2, 48), torch.zeros(1, 1, 256, dtype=torch.int8),
                                       torch.ones(3)), "x has 48 features; the weight takes 32"),
    (lambda: cpu_quantized.int8_linear(torch.randn(2, 64).double(),
                                       torch.zeros(1, 2, 256, dtype=torch.int8), torch.ones(3)),
     "fp32"),
    (lambda: cpu_quantized.int8_linear(torch.randn(2, 64), torch.zeros(1, 2, 256, dtype=torch.int8),
                                       torch.ones(3, 1)), "scales must be fp32 [out_features]"),
    (lambda: cpu_quantized.pack_int8(torch.zeros(3, 48, dtype=torch.int8)),
     "multiple of 32, got 48"),
])
def test_bad_shapes_and_dtypes_are_refused_by_name(call, words):
    with pytest.raises((RuntimeError, ValueError), match=re.escape(words)):
        call()


def test_a_path_the_cpu_lacks_is_refused_naming_it():
    if "avx512-vnni" in cpu_quantized.instruction_sets():
        pytest.skip("this CPU has AVX-512 VNNI")
    with pytest.raises(RuntimeError, match="AVX-512 VNNI was asked for; this CPU lacks it"):
        cpu_quantized.q4_1_linear(torch.randn(1, 32), torch.zeros(1, 1, 160, dtype=torch.uint8),
                                  1, "avx512-vnni")


def test_a_row_that_is_not_whole_blocks_is_refused_before_the_kernel_sees_it():
    from miniinfer.runner import quantized

    with pytest.raises(ValueError, match="in_features 48 is not a whole number of 32-weight"):
        Int8Linear(torch.randn(4, 48), compute_dtype=torch.int8)
    assert Int8Linear(torch.randn(4, 48)).compute_dtype == torch.bfloat16  # the default's choice
    assert quantized.default_compute_dtype(64) == torch.int8


def test_without_the_kernel_int8_compute_is_refused_and_the_default_falls_back(monkeypatch):
    from miniinfer.runner import quantized

    monkeypatch.setattr(cpu_quantized, "load", lambda: "this CPU lacks AVX2")
    with pytest.raises(ValueError, match="needs chapter 13's kernel: this CPU lacks AVX2"):
        Int8Linear(torch.randn(4, 64), compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="needs chapter 13's kernel: this CPU lacks AVX2"):
        Int4Linear(q4_1_quantize(torch.randn(16, 64)), compute_dtype=torch.int8)
    assert quantized.default_compute_dtype() == torch.bfloat16
    assert Int4Linear(q4_1_quantize(torch.randn(16, 64))).compute_dtype == torch.bfloat16


def test_the_ops_trace_as_one_node_each_with_their_fakes():
    """``torch.library.opcheck``: schema, fake (meta) and real agree; and a compiled function
    calls each op as itself (no graph break)."""
    weight = q4_1_quantize(torch.randn(8, 64))
    x = torch.randn(3, 64)
    codes, scales = torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.rand(8)
    packed = cpu_quantized.pack_q4_1(weight.file_blocks())
    for op, args in ((torch.ops.miniinfer.q4_1_linear, (x, packed, 8, 0)),
                     (torch.ops.miniinfer.int8_linear, (x, cpu_quantized.pack_int8(codes), scales,
                                                        0))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda a: cpu_quantized.q4_1_linear(a, packed, 8),
                             fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), cpu_quantized.q4_1_linear(x, packed, 8))
