"""Our engine against llama.cpp on the same weights, round by round (issue 92's benchmark).

Each round runs, for every format and batch size, our stage (one ``generate`` of ``batch``
prompts of ``prompt_len`` tokens and ``new_tokens`` new ones, EOS ignored) and then
``llama-batched-bench`` on the matching GGUF (one process, one run, llama.cpp's own decode
timing): the two meet the same state of the machine. Decode tok/s on both sides are the tokens
after the prefill over the time after it. Each round gives one paired ratio; the table reports
the median ratio and its 95 % interval, a bootstrap over the rounds (the guide's rule: a
side is faster only where the interval excludes 1).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

import pandas as pd
import torch

from ..core.models import LoadedModel, cache_dir, smollm2_gguf
from ..core.sampling import SamplingParams
from .offline import make_bench_engine, make_prompts, run_metrics
from .peers import llama_cpp

# Our stage for each of llama.cpp's formats: compiled forwards over the same bytes per weight.
STAGES = {"int4": "quantized:int4", "int8": "quantized:int8", "fp32": "compiled"}


def ratio_interval(ratios: Sequence[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95 % interval of the median of ``ratios`` (a bootstrap over the rounds)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def race(lm: LoadedModel, formats: Sequence[str] = ("int4", "int8"),
         batch_sizes: Sequence[int] = (1,), rounds: int = 5, prompt_len: int = 64,
         new_tokens: int = 64) -> pd.DataFrame:
    """One row per format and batch size: both sides' median decode tok/s and the paired
    ratio (ours / llama.cpp) with its interval. Raises ``PeerMissingError`` without llama.cpp."""
    threads = torch.get_num_threads()
    models = {f: llama_cpp.gguf_file(f, smollm2_gguf(), cache_dir() / "llama.cpp")
              for f in formats}
    engines = {f: make_bench_engine(STAGES[f], lm) for f in formats}
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = {b: make_prompts(lm, b, prompt_len) for b in batch_sizes}
    for f in formats:  # compile the buckets the rounds meet, untimed
        for b in batch_sizes:
            engines[f].generate(prompts[b], params)
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for f in formats:
            for b in batch_sizes:
                ours = run_metrics(engines[f].generate(prompts[b], params), b, new_tokens)
                (peer,) = llama_cpp.batched_bench(models[f], (b,), prompt_len, new_tokens,
                                                  threads, 1)
                runs.setdefault((f, b), []).append((ours["decode_tok_s"], peer["decode_tok_s"]))
    rows = []
    for (f, b), pairs in runs.items():
        ratios = [o / p for o, p in pairs]
        low, high = ratio_interval(ratios)
        rows.append({"format": f, "peer_format": llama_cpp.FORMATS[f], "batch_size": b,
                     "ours_tok_s": statistics.median(o for o, _ in pairs),
                     "llama_cpp_tok_s": statistics.median(p for _, p in pairs),
                     "ratio": statistics.median(ratios), "ratio_low": low, "ratio_high": high,
                     "rounds": len(pairs), "stage": STAGES[f], "threads": threads,
                     "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "peer_version": llama_cpp.version()})
    return pd.DataFrame(rows)
