"""Chapter 14's recording: speculative decoding on input-grounded and open-ended work.

Three workloads of chat prompts on SmolLM2-135M (real weights: acceptance depends on what the
model writes, so no random-weight model stands in on a GPU either). Two are input-grounded, on a
public-domain text shipped in ``data/texts/`` (the Declaration of Independence):

- **rewrite**: summarise it, or restate it in modern English: the answer is about the text but
  in other words;
- **copy**: extract its "He has" sentences, quote its first sentence, proofread a misspelt
  paragraph: the answer copies the text, and drafts land;
- **open-ended**: stories, explanations, lists from a one-line request: nothing to copy.

Per workload and system: decode tok/s at batch 1 (each prompt alone, greedy, a fixed number of
new tokens; the tokens after the first step over the time after it, p50 over repeats, and the
end-to-end rate with the prefill), acceptance rate and mean tokens per request-step (ours), and
served runs (every prompt several times at once through the engine in-process, the same rounds):
output tok/s with its range, ITL and TPOT.
Systems: ``prefix-cache`` (no speculation), ``speculative`` (adaptive draft lengths),
``speculative:fixed`` (always ``k`` where the lookup finds them), and transformers'
``generate`` with and without ``prompt_lookup_num_tokens=k`` as the peer (batch 1 only: HF's
prompt lookup takes one sequence at a time).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..bench.devices import REPO_ROOT, LoadGuard, device_slug, recording_root, run_metadata
from ..core.kernels import unavailable_reason
from ..core.kv_cache import head_dim
from ..core.models import LoadedModel, chat_text, dtype_name, load_model, resolve_device
from ..core.sampling import SamplingParams
from ..engines import make_engine

TEXT = REPO_ROOT / "data" / "texts" / "declaration_of_independence.txt"
SYSTEMS = ("prefix-cache", "speculative", "speculative:fixed", "hf", "hf-prompt-lookup")
SERVED_SYSTEMS = ("prefix-cache", "speculative", "speculative:fixed")
OPEN_ENDED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a rainy Sunday afternoon, with a sentence on each.",
    "Write a poem about the first frost of autumn.",
)


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    # Sized so the chapter records in minutes on 2 cores: every prompt runs through every
    # system (repeat + 1) times at batch 1.
    num_prompts: int = 3  # per workload, at most
    new_tokens: int = 48
    repeat: int = 2
    num_draft_tokens: int = 4  # ours and HF's prompt lookup alike
    served_copies: int = 4  # the served run sends each prompt this many times at once
    served_repeat: int = 3  # served rounds per engine (a round is seconds; its spread is wide)
    attention_backend: str | None = None  # every engine's; None: attention_backend(lm)
    systems: tuple[str, ...] = SYSTEMS


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


def _engine(lm: LoadedModel, system: str, config: SpeculationConfig):
    options = {"num_draft_tokens": config.num_draft_tokens} if system.startswith("speculative") \
        else {}
    return make_engine(system, lm, attention_backend=config.attention_backend, **options)


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


def batch1_rows(lm: LoadedModel, prompts: list[list[int]], config: SpeculationConfig,
                workload: str) -> list[dict]:
    """Each prompt alone through every system, repeats interleaved; one row per system."""
    params = SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True)
    engines = {s: _engine(lm, s, config) for s in config.systems if not s.startswith("hf")}
    # Per system, one decode tok/s per repeat: all prompts' tokens after their first step
    # over the time after it (the prefill, long for the input-grounded prompts, left out).
    rates: dict[str, list[float]] = {s: [] for s in config.systems}
    end_to_end: dict[str, list[float]] = {s: [] for s in config.systems}
    tokens: dict[str, list[list[int]]] = {}
    rounds = [(repeat, s) for repeat in range(config.repeat + 1) for s in config.systems]
    for repeat, s in tqdm(rounds, desc=f"{workload}, batch 1", leave=False):
        # The first round (repeat 0) warms up.
        runs = []
        for prompt in prompts:
            if s.startswith("hf"):
                lookup = config.num_draft_tokens if s == "hf-prompt-lookup" else None
                runs.append(_hf_generate(lm, prompt, config.new_tokens, lookup))
            else:
                engines[s].reset_prefix_cache()  # each repeat computes its prompt again
                runs.append(_engine_generate(engines[s], prompt, params))
        if repeat:
            rates[s].append(sum(r.decode_tokens for r in runs)
                            / sum(r.decode_seconds for r in runs))
            end_to_end[s].append(len(runs) * config.new_tokens
                                 / sum(r.seconds for r in runs))
        tokens.setdefault(s, [r.tokens for r in runs])
    reference = tokens[config.systems[0]]
    rows = []
    for s in config.systems:
        stats = getattr(engines.get(s), "stats", None)
        rows.append({
            "workload": workload, "run": "batch-1", "system": s,
            "num_prompts": len(prompts), "new_tokens": config.new_tokens, "repeats": config.repeat,
            "tok_s": statistics.median(rates[s]), "tok_s_min": min(rates[s]),
            "tok_s_max": max(rates[s]), "end_to_end_tok_s": statistics.median(end_to_end[s]),
            "acceptance_rate": stats.acceptance_rate if stats else float("nan"),
            "tokens_per_step": stats.tokens_per_step if stats else float("nan"),
            "same_tokens": tokens[s] == reference,
        })
    return rows


def served_rows(lm: LoadedModel, prompts: list[list[int]], config: SpeculationConfig,
                workload: str) -> list[dict]:
    """Every prompt ``served_copies`` times, all arriving at once, through each engine;
    ``config.served_repeat`` rounds after a warm-up, the engines interleaved in each round. One
    row per engine: output tok/s (median, slowest and fastest round), ITL and TPOT over every
    round's tokens, acceptance over every round's drafts."""
    params = SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True)
    batch = [p for p in prompts for _ in range(config.served_copies)]
    engines = {s: _engine(lm, s, config) for s in SERVED_SYSTEMS}
    for engine in engines.values():
        engine.generate(batch[:2], replace(params, max_new_tokens=4))  # warm-up
    before = {s: replace(e.stats) for s, e in engines.items() if hasattr(e, "stats")}
    rates: dict[str, list[float]] = {s: [] for s in engines}
    timelines: dict[str, list] = {s: [] for s in engines}
    rounds = [(r, s) for r in range(config.served_repeat) for s in engines]
    for _, s in tqdm(rounds, desc=f"{workload}, served", leave=False):
        engine = engines[s]
        engine.reset_prefix_cache()  # each round computes its prompts again
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in batch]
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((r.request_id, r) for r in engine.step().outputs if r.finished)
        rates[s].append(len(batch) * config.new_tokens / (time.perf_counter() - start))
        timelines[s] += [finished[i].timeline for i in ids]
    rows = []
    for s, engine in engines.items():
        gaps = [b - a for t in timelines[s]
                for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
        tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
                for t in timelines[s]]
        stats, start_stats = getattr(engine, "stats", None), before.get(s)
        drafted = stats.drafted - start_stats.drafted if stats else 0
        accepted = stats.accepted - start_stats.accepted if stats else 0
        request_steps = stats.request_steps - start_stats.request_steps if stats else 0
        produced = stats.tokens - start_stats.tokens if stats else 0
        rows.append({
            "workload": workload, "run": "served", "system": s, "num_prompts": len(batch),
            "new_tokens": config.new_tokens, "repeats": config.served_repeat,
            "tok_s": statistics.median(rates[s]), "tok_s_min": min(rates[s]),
            "tok_s_max": max(rates[s]),
            "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3,
            "tpot_p50_ms": statistics.median(tpot) * 1e3,
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "tokens_per_step": produced / request_steps if request_steps else float("nan"),
        })
    return rows


def results_path(device: torch.device) -> Path:
    return recording_root() / "ch14" / f"{device_slug(device)}-speculative.csv"


def record_speculation(device: torch.device | str | None = "auto",
                       config: SpeculationConfig | None = None, lm: LoadedModel | None = None,
                       out: Path | None = None, text_path: Path = TEXT) -> Path:
    """``make chapter-14``: both workloads at batch 1 and served; one CSV."""
    dev = resolve_device(device)
    config = config or SpeculationConfig()
    lm = lm or load_model("smollm2-135m", device=dev)
    if config.attention_backend is None:
        config = replace(config, attention_backend=attention_backend(lm))
    rows = []
    with LoadGuard(torch.get_num_threads() if dev.type == "cpu" else 1) as guard:
        for name, prompts in workloads(lm, config, text_path).items():
            rows += batch1_rows(lm, prompts, config, name)
            rows += served_rows(lm, prompts, config, name)
    meta = {**run_metadata(dev), "model": lm.name, "dtype": dtype_name(lm.dtype),
            "num_draft_tokens": config.num_draft_tokens,
            "attention_backend": config.attention_backend, **guard.columns()}
    df = pd.DataFrame([{**meta, **row} for row in rows])
    out = out or results_path(dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(df[["workload", "run", "system", "tok_s", "acceptance_rate", "tokens_per_step"]]
          .round(2).to_string(index=False))
    print(f"wrote {out}")
    return out
