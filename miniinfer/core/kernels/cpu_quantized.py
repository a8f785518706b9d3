"""Chapter 13's kernel: Q4_1 and int8 linears with integer dot products on the CPU.

``cpu_quantized.cpp`` multiplies the file's weights (Q4_1 blocks of 32: fp16 ``d`` and ``m``,
32 four-bit codes) or int8 codes with a scale per output row, by the activations quantized in
the kernel to int8 per block of 32. It never makes a float weight: the products are integer
dot products, and each block's scales are applied once. The weights are repacked once, at
load (:func:`pack_q4_1`, :func:`pack_int8`): the same bytes, in groups of 8 output rows
interleaved 4 bytes at a time, so that one broadcast of 4 activation codes against one vector
gives 8 rows' partial sums at once. It is built
like chapter 11's kernel (:mod:`.cpu_decode`): with ``torch.utils.cpp_extension`` on first use,
cached by torch, registered as ``torch.ops.miniinfer.q4_1_linear`` and ``int8_linear`` with
fakes, so a compiled graph calls each as one node. Its AVX2 and AVX-512 VNNI paths are in one
build and chosen when called (``isa``: ``"auto"``, or one path by name, for tests).

:func:`quantize_activations` and :func:`reference_q4_1_linear` / :func:`reference_int8_linear`
are the kernel's specification in PyTorch: the same codes and scales, the sums taken exactly
(float64), so that the kernel can be held to them up to fp32 rounding.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ..errors import one_line
from .cpu_decode import SOURCE as DECODE_SOURCE
from .cpu_decode import build

SOURCE = DECODE_SOURCE.with_name("cpu_quantized.cpp")
TILES = SOURCE.with_name("cpu_quantized_tiles.h")  # the inner loops, included once per ISA
BLOCK = 32  # activations and weights per block
ISAS = {"auto": 0, "avx2": 1, "avx512-vnni": 2}


@functools.cache
def load() -> str | None:
    """Build (or find already built) and register the ops; None when they are ready, else
    why they are not."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the quantized kernel is written for x86-64 CPUs; this is {platform.machine()}"
    try:
        # One build per version of the sources (torch's cache would not see the header change).
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in (SOURCE, TILES))).hexdigest()
        # No -march: each path carries its own target attribute, so one build serves any x86.
        build(f"miniinfer_cpu_quantized_{digest[:12]}", SOURCE, [])
    except Exception as error:  # noqa: BLE001 (whatever stops the build is the reason)
        return one_line(error)
    if int(torch.ops.miniinfer.quantized_isas()) == 0:
        return "the quantized kernel needs AVX2, FMA and F16C; this CPU lacks them"

    @torch.library.register_fake("miniinfer::q4_1_linear")
    def _(x, packed, out_features, isa=0):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("miniinfer::int8_linear")
    def _(x, packed, scales, isa=0):
        return x.new_empty(x.shape[0], scales.shape[0])

    return None


def instruction_sets() -> list[str]:
    """The paths this CPU can run (empty where the kernel cannot be built or run)."""
    if load() is not None:
        return []
    return ["avx2", "avx512-vnni"][:int(torch.ops.miniinfer.quantized_isas())]


GROUP_ROWS = 8  # output rows interleaved in a packed group


def _interleave(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[out, blocks, n]`` (n bytes of each row's block) as ``[groups, blocks, n / 4,
    8, 4]``: the out rows padded with zeros to whole groups of 8, and each group's bytes taken
    4 at a time from each of its 8 rows in turn."""
    out, blocks, n = rows.shape
    padded = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, -out % GROUP_ROWS))
    return (padded.view(-1, GROUP_ROWS, blocks, n // 4, 4)
            .permute(0, 2, 3, 1, 4))


def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """The file's Q4_1 ``blocks`` ``[out, in / 32 * 20]`` (uint8: per block fp16 ``d``, fp16
    ``m``, 16 bytes of codes) repacked for :func:`q4_1_linear`: ``[ceil(out / 8), in / 32,
    160]`` uint8, per group of 8 rows and block the 8 ``d``, the 8 ``m`` (fp16, as the file
    has them) and the 8 rows' code bytes interleaved 4 at a time. The same 20 bytes a block."""
    rows = blocks.view(blocks.shape[0], -1, 20)
    groups = _interleave(rows)  # [groups, blocks, 5, 8, 4]: bytes 0-3 are d and m
    halves = groups[:, :, 0].reshape(*groups.shape[:2], 8, 2, 2)  # [.., row, (d, m), 2 bytes]
    d_then_m = halves.transpose(2, 3).reshape(*groups.shape[:2], 32)
    codes = groups[:, :, 1:].reshape(*groups.shape[:2], 128)
    return torch.cat([d_then_m, codes], dim=-1).contiguous()


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 ``codes`` ``[out, in]`` repacked for :func:`int8_linear`: ``[ceil(out / 8), in /
    32, 256]``, per group of 8 rows and block the rows' codes interleaved 4 at a time."""
    if codes.shape[1] % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK}, got {codes.shape[1]}")
    groups = _interleave(codes.view(codes.shape[0], -1, BLOCK))
    return groups.reshape(*groups.shape[:2], 256).contiguous()


def unpack_int8(groups: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int8`: ``[out_features, in]`` int8 codes."""
    rows = groups.view(groups.shape[0], groups.shape[1], BLOCK // 4, GROUP_ROWS, 4)
    return rows.permute(0, 3, 1, 2, 4).reshape(-1, groups.shape[1] * BLOCK)[:out_features]


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                isa: str = "auto") -> torch.Tensor:
    """``x`` ``[tokens, in]`` fp32 times the Q4_1 weight ``packed`` by :func:`pack_q4_1`
    (``out_features`` rows), transposed: ``[tokens, out]``."""
    return torch.ops.miniinfer.q4_1_linear(x, packed, out_features, ISAS[isa])


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                isa: str = "auto") -> torch.Tensor:
    """``x`` ``[tokens, in]`` fp32 times ``codes * scales[:, None]`` (``codes`` packed by
    :func:`pack_int8`, ``scales`` fp32 ``[out]``), transposed."""
    return torch.ops.miniinfer.int8_linear(x, packed, scales, ISAS[isa])


# -- the specification -----------------------------------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of 32 of ``x`` ``[tokens, in]`` as int8 codes and one scale: ``scale = max
    |x| / 127``, ``code = round(x * (127 / max |x|))`` (ties to even; fp32 arithmetic, as the
    kernel's). Returns the codes ``[tokens, in]`` and scales ``[tokens, in / 32]``."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # A true division, as the kernel's (Python's ``127.0 / amax`` is 127 times a reciprocal).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    codes = torch.round(blocks * inv)
    return codes.reshape(x.shape).to(torch.int8), (amax / 127.0).squeeze(-1)


def reference_q4_1_linear(x: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                          q: torch.Tensor) -> torch.Tensor:
    """What :func:`q4_1_linear` computes, exactly: blocks ``d * q + m`` (``d``, ``m`` ``[out,
    in / 32]``, ``q`` ``[out, in]`` codes 0..15) against the quantized activations."""
    codes, scales = quantize_activations(x)
    tokens, out = x.shape[0], q.shape[0]
    c = codes.double().reshape(tokens, 1, -1, BLOCK)
    integer = (c * q.double().reshape(1, out, -1, BLOCK)).sum(-1)  # [tokens, out, blocks]
    sums = c.sum(-1)  # [tokens, 1, blocks]
    s = scales.double()[:, None, :]
    return ((d.double() * s * integer) + (m.double() * s * sums)).sum(-1).float()


def reference_int8_linear(x: torch.Tensor, codes: torch.Tensor,
                          scales: torch.Tensor) -> torch.Tensor:
    """What :func:`int8_linear` computes, exactly."""
    c, s = quantize_activations(x)
    tokens, out = x.shape[0], codes.shape[0]
    integer = (c.double().reshape(tokens, 1, -1, BLOCK)
               * codes.double().reshape(1, out, -1, BLOCK)).sum(-1)
    return (scales.double() * (s.double()[:, None, :] * integer).sum(-1)).float()
