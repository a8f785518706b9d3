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


def causal_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal attention over the whole sequence, ``[T, heads, dim]`` in and out (GQA: the
    key/value heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 0),
                                         v.repeat_interleave(groups, 0), is_causal=True,
                                         scale=scale)
    return out.transpose(0, 1)


@torch.inference_mode()
def sequence_logits(model: Model, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[T, vocab]`` (fp32) of every position of one sequence."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.embed.device)
    cos, sin = model.rope(torch.arange(len(ids), device=ids.device))
    return model.head(model.body(ids, cos, sin, causal_attend)).float()


def perplexity(model: Model, token_ids: Sequence[int], window: int = 512) -> float:
    """Perplexity of ``token_ids`` under ``model``, in windows of ``window`` tokens."""
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = list(token_ids[start:start + window])
        if len(chunk) < 2:
            break
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


def top1_agreement(reference: Model, model: Model, prompts: Sequence[Sequence[int]],
                   new_tokens: int = 32) -> tuple[int, int]:
    """(positions where ``model``'s argmax is ``reference``'s greedy token, positions), over
    each prompt's ``reference`` greedy continuation, teacher-forced."""
    agree = total = 0
    for prompt in prompts:
        continuation = greedy_continuation(reference, prompt, new_tokens)
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


def record_quality(lm, new_tokens: int = 32) -> Path:
    """Perplexity on :func:`quality_text` and top-1 agreement with fp32 of the int8 and int4
    weights (and int4 with fp32 activations: the file's own body weights), one row each, to
    ``<recording root>/ch13/<device slug>-quality.csv``. A quality measurement, not a timing
    one: any machine, busy or not, gives the same numbers."""
    import pandas as pd

    from ..core.devices import device_slug, recording_root, run_metadata
    from ..runner.model import load
    from ..runner.quantized import quantized, weight_bytes

    ids = lm.tokenizer.encode(quality_text())
    prompts = [lm.tokenizer.encode(p) for p in AGREEMENT_PROMPTS]
    dense = load(lm.model)
    models = {"fp32": (dense, "float32"),
              "int8": (quantized(lm, "int8"), "bfloat16"),
              "int4": (quantized(lm, "int4"), "bfloat16"),
              "int4 (fp32 activations)": (quantized(lm, "int4", torch.float32), "float32")}
    rows = []
    for weights, (model, compute) in models.items():
        if model is dense:
            agree = total = len(prompts) * new_tokens
        else:
            agree, total = top1_agreement(dense, model, prompts, new_tokens)
        rows.append({"model": lm.name, "weights": weights, "compute_dtype": compute,
                     "weight_bytes": weight_bytes(model), "text_tokens": len(ids),
                     "perplexity": round(perplexity(model, ids), 4),
                     "top1_agree": agree, "positions": total,
                     "agreement": round(agree / total, 4), **run_metadata(lm.device)})
    path = recording_root() / "ch13" / f"{device_slug(lm.device)}-quality.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    return path
