"""Greedy token equality with HF, checked where it can hold (chapters 06-08 call this).

Our engines promise HF's greedy tokens. In fp32 they deliver them exactly, on any device: the
same math in another order (a paged kernel, another GEMM algorithm for another batch size) moves
logits by about 1e-6, far less than the gap between the two best tokens. In bf16 it moves them by
about 1e-2, and a near-tie flips: with an 8-layer Qwen2 of the 7B layout in bf16, paged-attention
left hf's tokens on 4 of 6 prompts (first at new tokens 1, 10, 19 and 24); in fp32 all 6 matched.
After one flip the two continuations are different texts, so comparing tokens past it means
nothing. Hence two checks:

* **exact**, on a float32 model: the chapter's model itself where it is fp32 (the CPU's
  SmolLM2), otherwise the same architecture in fp32 (:func:`equality_model`: for a random-weight
  model, at most ``EXACT_LAYERS`` layers, since Qwen2.5-7B in fp32 would be 30 GB);
* **within tolerance**, on a bf16/fp16 model: each row must equal the reference up to its first
  difference, and there the two tokens must be a near-tie: their logits, recomputed by the
  model's own HF forward on the prompt and the common prefix, differ by at most
  ``NEAR_TIE_ULPS`` units in the last place of the row's largest logit (what reordered rounding
  can move). On an H100, Qwen2.5-7B in bf16 flipped a token whose two logits (about 5.6) were
  0.094 apart: 3 units of bf16's last place there (0.031 between 4 and 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from transformers import AutoModelForCausalLM

from ..core.models import RANDOM_WEIGHT_SEED, LoadedModel, load_model
from ..core.sampling import SamplingParams
from ..engines import make_engine

EXACT_DTYPE = torch.float32
# Layers of the fp32 stand-in for a big random-weight model: enough for attention and the MLP
# of every layer to matter, small enough to sit next to the bf16 model on one GPU (~8 GB for
# Qwen2.5-7B's layout, most of it the embedding and LM head).
EXACT_LAYERS = 4
# The logit gap that counts as a near-tie, in units in the last place of the largest logit.
NEAR_TIE_ULPS = 4

Tokens = list[list[int]]


def equality_model(lm: LoadedModel) -> LoadedModel:
    """A float32 model for exact token equality: ``lm`` itself when it is fp32; otherwise the
    same named model in fp32 (real weights), or, for random weights, the same architecture
    with at most ``EXACT_LAYERS`` layers, seeded like the named model."""
    if lm.dtype == EXACT_DTYPE:
        return lm
    if lm.name == "smollm2-135m":
        return load_model(lm.name, device=lm.device, dtype=EXACT_DTYPE)
    config = lm.config.to_dict()
    layers = min(config["num_hidden_layers"], EXACT_LAYERS)
    config["num_hidden_layers"] = layers
    config.pop("layer_types", None)  # one entry per layer: rebuilt for the new count
    config = type(lm.config).from_dict(config)
    torch.manual_seed(RANDOM_WEIGHT_SEED)
    with torch.device(lm.device):
        model = AutoModelForCausalLM.from_config(config, dtype=EXACT_DTYPE).eval()
    model.generation_config = lm.model.generation_config
    return LoadedModel(f"{lm.name}-{layers}-layers", model, lm.tokenizer, lm.device,
                       EXACT_DTYPE, lm.eos_token_id, lm.pad_token_id)


def compare_greedy(lm: LoadedModel, prompts: Sequence[Sequence[int]], tokens: Tokens,
                   reference: Tokens, what: str = "tokens") -> str:
    """Assert that ``tokens`` (row ``i`` generated for ``prompts[i]`` on ``lm``) are the
    ``reference`` tokens: exactly on an fp32 model, up to near-ties otherwise (module
    docstring). Returns how it compared, for the notebook to print."""
    if len(tokens) != len(reference) or len(prompts) != len(tokens):
        raise AssertionError(f"{what}: {len(tokens)} rows vs {len(reference)} reference rows "
                             f"for {len(prompts)} prompts")
    exact = lm.dtype == EXACT_DTYPE
    flips = 0
    for i, (row, ref) in enumerate(zip(tokens, reference, strict=True)):
        if row == ref:
            continue
        k = next((j for j, (a, b) in enumerate(zip(row, ref, strict=False)) if a != b), None)
        if exact or k is None:
            where = f"first differs at new token {k}" if k is not None else \
                f"lengths differ: {len(row)} vs {len(ref)}"
            raise AssertionError(f"{what}, prompt {i}: {where} ({lm.dtype})")
        gap, limit = near_tie(lm, [*prompts[i], *ref[:k]], row[k], ref[k])
        if gap > limit:
            raise AssertionError(
                f"{what}, prompt {i}: new token {k} is {row[k]}, the reference's {ref[k]}; "
                f"their logits differ by {gap:.4g} > {limit:.4g}, not a near-tie of "
                f"{lm.dtype} rounding")
        flips += 1
    if exact:
        return f"{what}: equal, token for token ({lm.name}, {lm.dtype})"
    return (f"{what}: equal up to {flips} near-tie flip(s) in {len(tokens)} rows "
            f"({lm.name}, {lm.dtype}, logits within {NEAR_TIE_ULPS} units in the last place)")


def near_tie(lm: LoadedModel, context: list[int], token: int, ref_token: int
             ) -> tuple[float, float]:
    """The gap between two tokens' next-token logits after ``context`` (HF's own forward of
    ``lm``), and the largest gap that counts as a near-tie."""
    with torch.inference_mode():
        ids = torch.tensor([context], device=lm.device)
        logits = lm.model(ids, logits_to_keep=1).logits[0, -1].float()
    gap = float((logits[token] - logits[ref_token]).abs())
    return gap, NEAR_TIE_ULPS * ulp(float(logits.abs().max()), lm.dtype)


def ulp(value: float, dtype: torch.dtype) -> float:
    """The gap between ``value`` (> 0) and the next larger number of ``dtype``: ``eps`` (the
    gap above 1.0) scaled to ``value``'s power of two. A relative bound such as 2**-8 of the
    value would be half of bf16's unit at the bottom of each power of two."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(value))


def check_greedy(lm: LoadedModel, prompts: Sequence[Sequence[int]],
                 run: Callable[[LoadedModel], tuple[Tokens, Tokens]],
                 what: str = "tokens") -> list[str]:
    """``run(model)`` gives (tokens, reference tokens) for ``prompts`` on ``model``. Runs it on
    the fp32 :func:`equality_model` (exact) and, where ``lm`` is not fp32, on ``lm`` too
    (within tolerance); returns one line per check."""
    models = [equality_model(lm)] + ([lm] if lm.dtype != EXACT_DTYPE else [])
    return [compare_greedy(model, prompts, *run(model), what=what) for model in models]


def check_engines(lm: LoadedModel, engine: str, prompts: Sequence[Sequence[int]],
                  params: SamplingParams, reference: str = "hf", one_by_one: bool = False) -> list[str]:
    """:func:`check_greedy` for two named engines on the whole batch (and, with
    ``one_by_one``, on each prompt alone)."""

    def run(model: LoadedModel) -> tuple[Tokens, Tokens]:
        ours, theirs = make_engine(engine, model), make_engine(reference, model)
        tokens = ours.generate(list(prompts), params).token_ids
        ref = theirs.generate(list(prompts), params).token_ids
        if one_by_one:
            tokens += [ours.generate([p], params).token_ids[0] for p in prompts]
            ref += [theirs.generate([p], params).token_ids[0] for p in prompts]
        return tokens, ref

    what = f"{engine} vs {reference}" + (", batched and one by one" if one_by_one else "")
    return check_greedy(lm, [*prompts, *prompts] if one_by_one else prompts, run, what)
