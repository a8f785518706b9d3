"""What a verification step costs (chapter 14): the engine's step time with 1, 2, ... tokens fed
to one request, relative to a one-token step, measured on this device for one model, forward
and weights. The speculative engine's draft budget reads the result
(:func:`miniinfer.engines.speculative.measured_step_costs`) in place of the roofline's guess.

The step is the engine's own (schedule, forward, verification, rollback), so the measurement
holds what a verification really adds: the extra rows through every matmul, attention over
them, the LM head and the sampler for each scored position. A request of ``context`` prompt
tokens is prefilled; each timed step then feeds its last token and ``n - 1`` drafts that the
model rejects (a token it never predicts), so the context grows by one token a step, and the
counts are interleaved round by round so that drift touches every count alike.

    python -m miniinfer.bench.step_costs --forward compiled --weights int4
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch

from ..core.models import dtype_name, load_model
from ..core.sampling import SamplingParams
from ..engines import make_engine
from ..engines.speculative import step_costs_file
from .devices import LoadGuard, recording_for_book, recording_root, run_metadata

FIELDS = ("model", "forward", "weights", "dtype", "context", "tokens", "repeats", "step_ms",
          "step_ms_min", "step_ms_max", "relative_cost")


def measure_step_costs(lm, *, max_tokens: int = 9, context: int = 256, repeats: int = 5,
                       **settings) -> list[dict[str, object]]:
    """One row per token count 1..``max_tokens``: the p50 step time over ``repeats`` rounds,
    its range, and the p50 over the one-token step's p50 (``relative_cost``). ``settings``:
    the engine's (a ``runner`` among them is used as it is and left running)."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    engine = make_engine("speculative", lm, draft_policy="fixed",
                         num_draft_tokens=max_tokens - 1, **settings)
    drafts = {"n": 0}
    filler = 0  # a token the model does not predict here, so every draft is rolled back
    engine.propose = lambda request, k: [filler] * min(k, drafts["n"])
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, lm.config.vocab_size - 100, (context,), generator=generator)
    new_tokens = 4 + (1 + repeats) * max_tokens * max_tokens
    request_id = engine.add_request(prompt.tolist(),
                                    SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    try:
        while engine.step().num_decodes == 0:  # the prefill (in chunks where it must)
            pass
        times: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
        for round_ in range(repeats + 1):  # the first round warms up (compiles) each count
            for n in times:
                drafts["n"] = n - 1
                result = engine.step()
                if round_:
                    times[n].append((result.end - result.start) * 1e3)
    finally:
        engine.abort(request_id)  # its blocks back to the pool, which a runner passed in keeps
        if "runner" not in settings:
            engine.close()
    base = statistics.median(times[1])
    config = engine.config
    return [{"model": lm.name, "forward": engine.runner.forward_name, "weights": config.weights,
             "dtype": dtype_name(lm.dtype), "context": context, "tokens": n, "repeats": repeats,
             "step_ms": round(statistics.median(ms), 3), "step_ms_min": round(min(ms), 3),
             "step_ms_max": round(max(ms), 3),
             "relative_cost": round(statistics.median(ms) / base, 4)}
            for n, ms in times.items()]


def write_step_costs(rows: list[dict[str, object]], path: Path, metadata: dict) -> None:
    """Replace ``path``'s rows for the same model, forward and weights with ``rows``."""
    key = ("model", "forward", "weights")
    fields = [*FIELDS, *metadata]
    kept = []
    if path.is_file():
        with path.open(newline="") as f:
            ours = {tuple(str(rows[0][k]) for k in key)}
            kept = [r for r in csv.DictReader(f) if tuple(r[k] for k in key) not in ours]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
        writer.writerows({**row, **metadata} for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--forward", default="compiled")
    parser.add_argument("--weights", default="dense")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    lm = load_model(args.model, device="cpu")
    with LoadGuard(threads=torch.get_num_threads()) as guard:
        rows = measure_step_costs(lm, max_tokens=args.max_tokens, context=args.context,
                                  repeats=args.repeats, forward=args.forward,
                                  weights=args.weights)
    guard.warn("the step-cost measurement")
    path = step_costs_file(recording_root(), lm.device)
    write_step_costs(rows, path, {**run_metadata(lm.device), **guard.columns()})
    for row in rows:
        print(f"{row['tokens']:>2} tokens: {row['step_ms']:7.2f} ms "
              f"({row['step_ms_min']:.2f}-{row['step_ms_max']:.2f}), "
              f"{row['relative_cost']:.2f}x one token")
    where = "the book's" if recording_for_book() else "your"
    print(f"wrote {where} step costs: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
