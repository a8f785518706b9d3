"""Chapter 11's compiled stage on a GPU, first contact (issue 25): does it compile there, are its
greedy tokens hf's, how long does the compile take, and how fast is a step against hf's.

Run by ``scripts/gpu_session.sh``'s ``compiled`` step on the lent machine:

    python3 scripts/gpu_compiled.py OUT_DIR [DEVICE]     (cpu: part 1 only, to check the script)

1. The ``tiny`` model in fp32 on the GPU: the compiled engine's greedy tokens against hf's
   (exact expected), compile seconds per graph.
2. Qwen2.5-7B's layout, random weights, bf16: the offline benchmark (prompt 64, 64 new, batch 1
   and 8, p50 of 3) of ``hf`` and ``compiled`` in one run, tokens compared (bf16 near-ties
   allowed: counted, not asserted), to ``OUT_DIR/compiled-qwen.csv``.

GEMM autotuning is off and the buckets are the few these runs need (1, 8, 64): with the stage's
defaults (12 buckets, autotuned GEMMs up to 32 tokens) the warm-up would outlast a device call.
"""

from __future__ import annotations

import sys
import time

import torch

from miniinfer.bench.offline import BenchConfig, make_prompts, run_bench
from miniinfer.core.models import load_model
from miniinfer.core.sampling import SamplingParams
from miniinfer.engines import make_engine
from miniinfer.engines.compiled import CompiledEngine
from miniinfer.runner.compiled import CompileOptions

BUCKETS = (1, 8, 64)


def build(lm):
    """The compiled engine over ``lm``, its buckets compiled one at a time, each reported as it
    finishes (a call cut off mid-compile still says how far it got)."""
    start = time.perf_counter()
    engine = CompiledEngine(lm, compile_options=CompileOptions(token_buckets=BUCKETS,
                                                               max_autotune=False),
                            warm_up=False)
    forward = engine.runner.forward
    print(f"{lm.name} {lm.dtype}: compiled={forward.compiled} reason_eager={forward.reason_eager}",
          flush=True)
    for bucket in BUCKETS:
        forward.warm_up([bucket])
        print(f"  bucket {bucket}: body {forward.compile_seconds.get(('body', bucket), 0):.1f} s, "
              f"head {forward.compile_seconds.get(('head', bucket), 0):.1f} s "
              f"({time.perf_counter() - start:.1f} s since the build began)", flush=True)
    return engine


def mismatches(ours: list[list[int]], ref: list[list[int]]) -> int:
    """Prompts whose greedy tokens differ from the reference's anywhere."""
    return sum(a != b for a, b in zip(ours, ref, strict=True))


def main(out: str, device: str = "cuda") -> None:
    print("torch", torch.__version__, device, flush=True)
    lm = load_model("tiny", device, "float32")
    engine = build(lm)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    for batch in (1, 8):
        prompts = make_prompts(lm, batch, 40)
        ref = make_engine("hf", lm).generate(prompts, params).token_ids
        got = engine.generate(prompts, params).token_ids
        print(f"tiny fp32 batch {batch}: {mismatches(got, ref)} of {batch} prompts differ "
              f"from hf", flush=True)
    del engine, lm
    if device != "cuda":  # a check of this script on a CPU: the 7B model is for the GPU
        return
    torch.cuda.empty_cache()

    start = time.perf_counter()
    lm = load_model("qwen2.5-7b", "cuda", "bfloat16")
    print(f"qwen2.5-7b loaded in {time.perf_counter() - start:.1f} s", flush=True)
    engines = {"hf": make_engine("hf", lm), "compiled": build(lm)}
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    prompts = make_prompts(lm, 8, 64)
    ref = engines["hf"].generate(prompts, params).token_ids
    got = engines["compiled"].generate(prompts, params).token_ids
    print(f"qwen bf16 batch 8: {mismatches(got, ref)} of 8 prompts differ from hf "
          f"(bf16: near-ties possible)", flush=True)
    df = run_bench(lm, BenchConfig(engines=tuple(engines), batch_sizes=(1, 8), repeat=3,
                                   chapter="11"), engines=engines)
    df.to_csv(f"{out}/compiled-qwen.csv", index=False)
    cols = [c for c in ("engine", "batch_size", "tok_s", "step_ms", "ttft_ms", "pct_of_hf",
                        "pct_of_floor") if c in df.columns]
    print(df[cols].to_string(index=False), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
