"""Chapter 14's recording: speculative decoding on input-grounded and open-ended work.

Three workloads of chat prompts on SmolLM2-135M (real weights: acceptance depends on what the
model writes, so no random-weight model stands in on a GPU either). Two are input-grounded, on a
public-domain text shipped in ``data/texts/`` (the Declaration of Independence):

- **rewrite**: summarise it, or restate it in modern English: the answer is about the text but
  in other words;
- **copy**: extract its "He has" sentences, quote its first sentence, proofread a misspelt
  paragraph: the answer copies the text, and drafts land;
- **open-ended**: stories, explanations, lists from a one-line request: nothing to copy.

Per workload, weights (fp32 and chapter 13's int4) and system, all on chapter 11's compiled
forward: decode tok/s at batch 1 (each prompt alone, greedy, a fixed number of new tokens; the
tokens after the first step over the time after it, p50 over repeats, and the end-to-end rate
with the prefill), acceptance rate, mean tokens per request-step and the histogram of drafts kept
per drafted step; and served runs (the workload's prompts from several clients at once, through
the engine in-process, the same rounds): output tok/s with its range, ITL and TPOT.
Systems: ``no drafts`` (chapter 09's engine), ``ngram`` (prompt lookup) and ``suffix`` (the
longest earlier match), both with adaptive draft lengths from the measured step costs, and
transformers' ``generate`` with and without ``prompt_lookup_num_tokens=k`` as the peer (fp32,
batch 1 only: HF's prompt lookup takes one sequence at a time; on the copy and open-ended
workloads).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..bench.devices import REPO_ROOT, LoadGuard, device_slug, recording_root, run_metadata
from ..bench.step_costs import measure_step_costs, write_step_costs
from ..core.kernels import unavailable_reason
from ..core.kv_cache import head_dim
from ..core.models import LoadedModel, chat_text, dtype_name, load_model, resolve_device
from ..core.sampling import SamplingParams
from ..engines import make_engine
from ..engines.speculative import SpeculationStats, step_costs_file

TEXT = REPO_ROOT / "data" / "texts" / "declaration_of_independence.txt"
# Our systems: the drafter each runs (None: chapter 09's engine, no drafts).
DRAFTERS = {"no drafts": None, "ngram": "ngram", "suffix": "suffix"}
HF_SYSTEMS = ("hf", "hf-prompt-lookup")  # the peer, on the model's own (fp32) weights
SYSTEMS = (*DRAFTERS, *HF_SYSTEMS)
OPEN_ENDED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a rainy Sunday afternoon, with a sentence on each.",
    "Write a poem about the first frost of autumn.",
)


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    # Sized so the chapter records in minutes on 2 cores: every prompt runs through every
    # system (repeat + 1) times at batch 1, on each weights.
    num_prompts: int = 2  # per workload, at most
    new_tokens: int = 48
    repeat: int = 2
    num_draft_tokens: int = 4  # the most a step drafts, ours and HF's prompt lookup alike
    forward: str = "compiled"  # every engine's (chapter 11's); its step costs set the budget
    weights: tuple[str, ...] = ("dense", "int4")
    served_clients: int = 8  # requests at once in a served round (the prompts, cycled)
    served_repeat: int = 3  # served rounds per engine (a round is seconds; its spread is wide)
    step_cost_repeats: int = 5  # rounds of the verification cost curve (1-9 tokens)
    attention_backend: str | None = None  # every engine's; None: attention_backend(lm)
    systems: tuple[str, ...] = SYSTEMS
    # Where HF's generate runs beside ours (at a third of our speed it was a third of the
    # recording): where prompt lookup has something to find, and where it has not.
    hf_workloads: tuple[str, ...] = ("copy", "open-ended")


def misspelt(text: str, every: int = 6) -> str:
    """``text`` with every ``every``-th word of more than five letters misspelt (its
    second-to-last letter dropped): a proofreading task whose answer is the text itself."""
    words = text.split(" ")
    for i in range(every - 1, len(words), every):
        if sum(c.isalpha() for c in words[i]) > 5:
            w = words[i].rstrip(".,;:")
            words[i] = w[:-2] + w[-1] + words[i][len(w):]
    return " ".join(words)


def input_grounded_tasks(text: str) -> dict[str, list[str]]:
    """Requests that answer from ``text``: those whose good answer restates it in other words
    (``rewrite``), and those whose good answer copies it (``copy``: extract, quote, proofread)."""
    paragraphs = [p for p in text.split("\n\n") if len(p.split()) > 30]
    first, second = paragraphs[0], paragraphs[1]
    return {
        "rewrite": [
            f"Summarise this text in three sentences.\n\n{second}",
            f"Rewrite this text in modern English, keeping its sentences in order.\n\n{second}",
        ],
        "copy": [
            f"Copy every sentence of this text that begins with \"He has\", word for word, one "
            f"per line.\n\n{text[:3000]}",
            f"Quote the first sentence of this text exactly, then explain it.\n\n{first}",
            f"Correct the spelling mistakes in this text and return the whole corrected "
            f"text.\n\n{misspelt(second)}",
        ],
    }


def workloads(lm: LoadedModel, config: SpeculationConfig,
              text_path: Path = TEXT) -> dict[str, list[list[int]]]:
    """Chat-formatted prompt ids per workload."""
    text = text_path.read_text()
    tasks = {**input_grounded_tasks(text), "open-ended": list(OPEN_ENDED)}
    return {name: [lm.tokenizer.encode(chat_text(lm.tokenizer, [{"role": "user", "content": t}]),
                                       add_special_tokens=False)
                   for t in prompts[:config.num_prompts]]
            for name, prompts in tasks.items()}


class _FirstTokens:
    """A ``generate`` streamer that stamps the first new tokens: ``put`` gets the prompt, then
    each step's new tokens (several at once when prompt lookup's drafts were kept)."""

    def __init__(self) -> None:
        self.calls, self.time, self.count = 0, 0.0, 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.count = value.cpu().numel()  # on the host: the step is done
            self.time = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _Run:
    tokens: list[int]
    seconds: float  # the whole call, prefill included
    decode_tokens: int  # after the first step's
    decode_seconds: float  # after the first step


def _hf_generate(lm: LoadedModel, prompt: list[int], new_tokens: int,
                 lookup: int | None) -> _Run:
    ids = torch.tensor([prompt], device=lm.device)
    # No EOS id: generate never stops early nor suppresses EOS, as ignore_eos does in ours.
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=lm.pad_token_id,
                              **({"prompt_lookup_num_tokens": lookup} if lookup else {}))
    first = _FirstTokens()
    start = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                streamer=first)
    end = time.perf_counter()
    return _Run(out[0, len(prompt):].tolist(), end - start, new_tokens - first.count,
                end - first.time)


def _engine_generate(engine, prompt: list[int], params: SamplingParams) -> _Run:
    start = time.perf_counter()
    result = engine.generate([prompt], params)
    end = time.perf_counter()
    times = result.token_times
    return _Run(result.token_ids[0], end - start, len(times) - 1, times[-1] - times[0])


def engines(lm: LoadedModel, config: SpeculationConfig, weights: str,
            runner=None) -> dict[str, object]:
    """Our systems on ``weights``, sharing one runner (``runner``, else a new one): one
    compiled forward and one KV pool (each run clears the prefix cache), so every system runs
    the same graphs."""
    built: dict[str, object] = {}
    for system, drafter in DRAFTERS.items():
        if system not in config.systems:
            continue
        options = {} if drafter is None else {"speculative": drafter,
                                              "num_draft_tokens": config.num_draft_tokens}
        # Graphs compiled as the runs meet them (each run's first round is a warm-up), not
        # every bucket up front.
        engine = make_engine("prefix-cache", lm, forward=config.forward, weights=weights,
                             attention_backend=config.attention_backend, warm_up=False,
                             **({} if runner is None else {"runner": runner}), **options)
        runner = engine.runner
        built[system] = engine
    return built


def attention_backend(lm: LoadedModel) -> str:
    """The attention every engine of the recording runs on, the same for each so that their
    tokens compare. On a CPU, chapter 11's C++ kernel where it builds: a verification step feeds
    a request ``k + 1`` tokens, which the kernel attends in place, where the reference copies
    each request's whole context out of the pool for every one of them. Elsewhere the engines'
    own choice."""
    if lm.device.type == "cpu" and unavailable_reason(
            "cpu", lm.device, head_dim=head_dim(lm.config)) is None:
        return "cpu"
    return "auto"


def _stats_columns(stats: SpeculationStats | None, before: SpeculationStats | None = None) -> dict:
    """Acceptance, tokens per request-step and the kept-drafts histogram ("kept:steps ..."),
    counted since ``before`` (a copy of the stats then)."""
    if stats is None:
        return {"acceptance_rate": float("nan"), "tokens_per_step": float("nan"),
                "kept_drafts": ""}
    before = before or SpeculationStats()
    drafted, accepted = stats.drafted - before.drafted, stats.accepted - before.accepted
    steps, tokens = stats.request_steps - before.request_steps, stats.tokens - before.tokens
    kept = stats.kept_drafts - before.kept_drafts
    return {"acceptance_rate": accepted / drafted if drafted else float("nan"),
            "tokens_per_step": tokens / steps if steps else float("nan"),
            "drafts_per_drafted_step": drafted / kept.total() if kept.total() else 0.0,
            "drafted_share": kept.total() / steps if steps else 0.0,
            "kept_drafts": " ".join(f"{n}:{kept[n]}" for n in sorted(kept))}


def _snapshot(engine) -> SpeculationStats | None:
    stats = getattr(engine, "stats", None)
    return None if stats is None else replace(stats, kept_drafts=Counter(stats.kept_drafts))


def batch1_rows(lm: LoadedModel, prompts: list[list[int]], config: SpeculationConfig,
                workload: str, weights: str, built: dict[str, object]) -> list[dict]:
    """Each prompt alone through every system, repeats interleaved; one row per system."""
    params = SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True)
    systems = [s for s in config.systems if s in built or (
        s in HF_SYSTEMS and weights == "dense" and workload in config.hf_workloads)]
    # Per system, one decode tok/s per repeat: all prompts' tokens after their first step
    # over the time after it (the prefill, long for the input-grounded prompts, left out).
    rates: dict[str, list[float]] = {s: [] for s in systems}
    end_to_end: dict[str, list[float]] = {s: [] for s in systems}
    tokens: dict[str, list[list[int]]] = {}
    before = {s: _snapshot(e) for s, e in built.items()}
    rounds = [(repeat, s) for repeat in range(config.repeat + 1) for s in systems]
    for repeat, s in tqdm(rounds, desc=f"{workload}, {weights}, batch 1", leave=False):
        # The first round (repeat 0) warms up.
        runs = []
        for prompt in prompts:
            if s in HF_SYSTEMS:
                lookup = config.num_draft_tokens if s == "hf-prompt-lookup" else None
                runs.append(_hf_generate(lm, prompt, config.new_tokens, lookup))
            else:
                built[s].reset_prefix_cache()  # each repeat computes its prompt again
                runs.append(_engine_generate(built[s], prompt, params))
        if repeat:
            rates[s].append(sum(r.decode_tokens for r in runs)
                            / sum(r.decode_seconds for r in runs))
            end_to_end[s].append(len(runs) * config.new_tokens
                                 / sum(r.seconds for r in runs))
        tokens.setdefault(s, [r.tokens for r in runs])
    reference = tokens[systems[0]]
    return [{
        "workload": workload, "weights": weights, "run": "batch-1", "system": s,
        "num_prompts": len(prompts), "new_tokens": config.new_tokens, "repeats": config.repeat,
        "tok_s": statistics.median(rates[s]), "tok_s_min": min(rates[s]),
        "tok_s_max": max(rates[s]), "end_to_end_tok_s": statistics.median(end_to_end[s]),
        **_stats_columns(getattr(built.get(s), "stats", None), before.get(s)),
        "same_tokens": tokens[s] == reference,
    } for s in systems]


def served_rows(prompts: list[list[int]], config: SpeculationConfig, workload: str,
                weights: str, built: dict[str, object]) -> list[dict]:
    """``config.served_clients`` requests (the prompts, cycled), all arriving at once, through
    each engine; ``config.served_repeat`` rounds after a warm-up, the engines interleaved in
    each round. One row per engine: output tok/s (median, slowest and fastest round), ITL and
    TPOT over every round's tokens, acceptance over every round's drafts."""
    params = SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True)
    batch = [prompts[i % len(prompts)] for i in range(config.served_clients)]
    for engine in built.values():
        engine.reset_prefix_cache()
        engine.generate(batch, params)  # warm-up: the round's step shapes compiled
    before = {s: _snapshot(e) for s, e in built.items()}
    rates: dict[str, list[float]] = {s: [] for s in built}
    timelines: dict[str, list] = {s: [] for s in built}
    rounds = [(r, s) for r in range(config.served_repeat) for s in built]
    for _, s in tqdm(rounds, desc=f"{workload}, {weights}, served", leave=False):
        engine = built[s]
        engine.reset_prefix_cache()  # each round computes its prompts again
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in batch]
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((r.request_id, r) for r in engine.step().outputs if r.finished)
        rates[s].append(len(batch) * config.new_tokens / (time.perf_counter() - start))
        timelines[s] += [finished[i].timeline for i in ids]
    rows = []
    for s, engine in built.items():
        gaps = [b - a for t in timelines[s]
                for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
        tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
                for t in timelines[s]]
        ttft = [t.token_times[0] - t.arrival for t in timelines[s]]
        rows.append({
            "workload": workload, "weights": weights, "run": "served", "system": s,
            "num_prompts": len(batch), "new_tokens": config.new_tokens,
            "repeats": config.served_repeat,
            "tok_s": statistics.median(rates[s]), "tok_s_min": min(rates[s]),
            "tok_s_max": max(rates[s]),
            "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3,
            "tpot_p50_ms": statistics.median(tpot) * 1e3,
            **_stats_columns(getattr(engine, "stats", None), before.get(s)),
        })
    return rows


def results_path(device: torch.device) -> Path:
    return recording_root() / "ch14" / f"{device_slug(device)}-speculative.csv"


def record_speculation(device: torch.device | str | None = "auto",
                       config: SpeculationConfig | None = None, lm: LoadedModel | None = None,
                       out: Path | None = None, text_path: Path = TEXT,
                       costs_root: Path | None = None) -> Path:
    """``make chapter-14``: per weights, the verification cost curve (into the step-cost file
    under ``costs_root``, default the recording's root), then every workload at batch 1 and
    served (into one CSV, ``out``)."""
    dev = resolve_device(device)
    config = config or SpeculationConfig()
    lm = lm or load_model("smollm2-135m", device=dev)
    if config.attention_backend is None:
        config = replace(config, attention_backend=attention_backend(lm))
    rows = []
    with LoadGuard(torch.get_num_threads() if dev.type == "cpu" else 1) as guard:
        prompts = workloads(lm, config, text_path)
        for weights in config.weights:
            built = engines(lm, config, weights)
            # The verification cost curve first: the draft budget reads it (the reader's own
            # recording, else the book's) when an engine is built, so the drafting engines are
            # built again over the same runner once it is written.
            runner = next(iter(built.values())).runner
            costs = measure_step_costs(lm, repeats=config.step_cost_repeats, runner=runner,
                                       forward=config.forward, weights=weights,
                                       attention_backend=config.attention_backend)
            write_step_costs(costs, step_costs_file(costs_root or recording_root(), dev),
                             {**run_metadata(dev), **guard.columns()})
            built = engines(lm, config, weights, runner)
            for name, workload_prompts in prompts.items():
                rows += batch1_rows(lm, workload_prompts, config, name, weights, built)
            # Served: the input-grounded prompts together, and the open-ended ones.
            grounded = [p for name in ("rewrite", "copy") for p in prompts[name]]
            for name, served in (("grounded", grounded), ("open-ended", prompts["open-ended"])):
                rows += served_rows(served, config, name, weights, built)
            del built
    meta = {**run_metadata(dev), "model": lm.name, "dtype": dtype_name(lm.dtype),
            "forward": config.forward, "num_draft_tokens": config.num_draft_tokens,
            "attention_backend": config.attention_backend, **guard.columns()}
    df = pd.DataFrame([{**meta, **row} for row in rows])
    out = out or results_path(dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(df[["workload", "weights", "run", "system", "tok_s", "acceptance_rate",
              "tokens_per_step"]]
          .round(2).to_string(index=False))
    print(f"wrote {out}")
    return out
