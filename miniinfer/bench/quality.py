"""What fewer bits cost in quality: perplexity on a public-domain text, and how often the
quantized model's next token is the fp32 model's (chapter 13).

Both run the model whole over a sequence (every position at once, causal attention through
SDPA: no KV pool, no engine), so the numbers measure the weights and nothing else:

- :func:`perplexity`: ``exp`` of the mean negative log-likelihood of each token given the
  ones before it, over the text cut into windows of ``window`` tokens (each window scored
  from its second token; no overlap, so every token is scored once and the first of each
  window without context).
- :func:`top1_agreement`: teacher-forced: over each prompt followed by the fp32 model's own
  greedy continuation, the share of continuation positions where the quantized model's argmax
  is the fp32 model's token. Unlike comparing two free-running generations, one early
  near-tie does not decide every later position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..runner.model import Model

TEXTS_DIR = Path(__file__).resolve().parents[2] / "data" / "texts"
# The quality text, in this order (sources in data/texts/README.md).
TEXT_FILES = ("declaration_of_independence.txt", "gettysburg_address.txt")


def quality_text() -> str:
    return "\n\n".join((TEXTS_DIR / name).read_text() for name in TEXT_FILES)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      **mask) -> torch.Tensor:
    """SDPA on ``[T, heads, dim]`` queries over ``[S, kv_heads, dim]`` keys and values (GQA:
    the key/value heads repeated), ``[T, heads, dim]`` out; ``mask``: SDPA's ``is_causal`` or
    ``attn_mask``."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 0),
                                         v.repeat_interleave(groups, 0), scale=scale, **mask)
    return out.transpose(0, 1)


def causal_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal attention over the whole sequence, ``[T, heads, dim]`` in and out."""
    return grouped_attention(q, k, v, scale, is_causal=True)


@torch.inference_mode()
def sequence_logits(model: Model, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[T, vocab]`` (fp32) of every position of one sequence."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.embed.device)
    cos, sin = model.rope(torch.arange(len(ids), device=ids.device))
    return model.head(model.body(ids, cos, sin, causal_attend)).float()


def windows(token_ids: Sequence[int], window: int = 512) -> list[list[int]]:
    """``token_ids`` cut into windows of ``window`` tokens, each of at least 2 (a window scores
    every token but its first: ``len(w) - 1`` tokens a window)."""
    chunks = [list(token_ids[start:start + window]) for start in range(0, len(token_ids), window)]
    return [chunk for chunk in chunks if len(chunk) >= 2]


def perplexity(model: Model, token_ids: Sequence[int], window: int = 512) -> float:
    """Perplexity of ``token_ids`` under ``model``, in windows of ``window`` tokens."""
    nll, count = 0.0, 0
    for chunk in windows(token_ids, window):
        logits = sequence_logits(model, chunk)[:-1]
        target = torch.tensor(chunk[1:], device=logits.device)
        nll += F.cross_entropy(logits, target, reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy_continuation(model: Model, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """``model``'s greedy continuation of ``prompt`` (each step the whole sequence again:
    slow, but exact and free of any engine)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(sequence_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def greedy_continuations(model: Model, prompts: Sequence[Sequence[int]],
                         new_tokens: int) -> list[list[int]]:
    """:func:`greedy_continuation` of every prompt at once: the sequences packed into one (a
    token attends to the earlier tokens of its own sequence only), each layer's keys and values
    kept, so a step runs one new token per sequence and reads the weights once for all. The
    same greedy tokens but where a near-tie falls the other way under another summation order."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    device = model.embed.device
    seqs = [list(p) for p in prompts]
    step = [(i, pos, tok) for i, p in enumerate(seqs) for pos, tok in enumerate(p)]
    keys = torch.empty(0, 2, dtype=torch.long, device=device)  # (sequence, position) of each key

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        if layer in cache:
            k, v = (torch.cat([old, new]) for old, new in zip(cache[layer], (k, v), strict=True))
        cache[layer] = k, v
        return grouped_attention(q, k, v, scale, attn_mask=mask)

    for _ in range(new_tokens):
        queries = torch.tensor([(i, pos) for i, pos, _ in step], device=device)
        keys = torch.cat([keys, queries])
        mask = ((keys[None, :, 0] == queries[:, None, 0])
                & (keys[None, :, 1] <= queries[:, None, 1]))
        cos, sin = model.rope(queries[:, 1])
        ids = torch.tensor([tok for *_, tok in step], dtype=torch.long, device=device)
        hidden = model.body(ids, cos, sin, attend)
        # each sequence's last token in this step
        last = [max(j for j, (i, *_) in enumerate(step) if i == seq) for seq in range(len(seqs))]
        for seq, token in zip(seqs, model.head(hidden[last]).argmax(-1).tolist(), strict=True):
            seq.append(token)
        step = [(i, len(seq) - 1, seq[-1]) for i, seq in enumerate(seqs)]
    return [seq[len(p):] for seq, p in zip(seqs, prompts, strict=True)]


def top1_agreement(reference: Model, model: Model, prompts: Sequence[Sequence[int]],
                   new_tokens: int = 32,
                   continuations: Sequence[Sequence[int]] | None = None) -> tuple[int, int]:
    """(positions where ``model``'s argmax is ``reference``'s greedy token, positions), over
    each prompt's ``reference`` greedy continuation, teacher-forced. ``continuations``: those
    continuations where already computed (one set for several models)."""
    if continuations is None:
        continuations = [greedy_continuation(reference, p, new_tokens) for p in prompts]
    agree = total = 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        logits = sequence_logits(model, [*prompt, *continuation])
        predicted = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        agree += sum(p == t for p, t in zip(predicted, continuation, strict=True))
        total += len(continuation)
    return agree, total


# The prompts of the agreement measurement (short, of several kinds: facts, code, a story, chat).
AGREEMENT_PROMPTS = (
    "The capital of France is", "def fibonacci(n):",
    "Once upon a time, in a small village by the river, there lived",
    "Question: what is 2 + 2? Answer:", "The three primary colours are",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at", "import numpy as np\n\n",
)


# The weight formats of the quality table, each as the quantized stage builds its model
# (runner.quantized.quantized: int8 per channel from fp32, int4 from the GGUF's own Q4_1 blocks;
# both with bf16 activations in their linears).
QUALITY_FORMATS = ("fp32", "int8", "int4")


def quality_rows(lm, window: int = 512, new_tokens: int = 32,
                 prompts: Sequence[str] = AGREEMENT_PROMPTS) -> list[dict]:
    """One row per weight format of :data:`QUALITY_FORMATS`: perplexity on :func:`quality_text`
    in windows of ``window`` tokens, its ratio to fp32's, and teacher-forced top-1 agreement
    with fp32 over ``prompts`` and ``new_tokens`` of fp32's greedy continuation. A quality
    measurement, not a timing one: a busy machine gives the same numbers."""
    from ..core.models import dtype_name
    from ..runner.model import load
    from ..runner.quantized import quantized, weight_bytes

    ids = lm.tokenizer.encode(quality_text())
    scored = sum(len(chunk) - 1 for chunk in windows(ids, window))
    encoded = [lm.tokenizer.encode(p) for p in prompts]
    dense = load(lm.model)
    # fp32's greedy continuations, computed once for every format, all prompts a step (one at a
    # time, the whole sequence again each step, was 40% of this table's time on 2 cores).
    continuations = greedy_continuations(dense, encoded, new_tokens)
    rows = []
    for weights in QUALITY_FORMATS:
        model = dense if weights == "fp32" else quantized(lm, weights)
        if model is dense:
            # The reference itself: it agrees with its own greedy tokens at every position by
            # construction (written as 1, not measured).
            agree = total = len(encoded) * new_tokens
        else:
            agree, total = top1_agreement(dense, model, encoded, new_tokens, continuations)
        # The dtype the linears compute in (the quantized ones: int8 activations in chapter 13's
        # kernel, or bf16 in PyTorch's ops where the kernel does not run).
        compute = getattr(model.lm_head, "compute_dtype", lm.dtype)
        rows.append({"model": lm.name, "weights": weights, "compute_dtype": dtype_name(compute),
                     "dtype": dtype_name(lm.dtype), "weight_bytes": weight_bytes(model),
                     "text": "+".join(TEXT_FILES), "text_tokens": len(ids), "window": window,
                     "tokens_scored": scored, "perplexity": perplexity(model, ids, window),
                     "prompts": len(encoded), "new_tokens": new_tokens, "top1_agree": agree,
                     "positions": total, "agreement": agree / total})
    fp32 = rows[0]["perplexity"]
    for row in rows:
        row["ppl_ratio"] = row["perplexity"] / fp32
        row["ppl_change_pct"] = 100 * (row["ppl_ratio"] - 1)
    return rows
