"""One engine's settings in one object: every optimisation the book builds is a field here, and
a stage of the book is a named preset of it (``engines.ENGINES``). The scheduler's budget, the
KV pool, and how the runner builds the model it runs, in a fixed order: the weights (quantized
or not), then the forward over them (eager or compiled, on one rank or sharded), then CUDA
graphs around it on a GPU; then what the engine does around the runner (prefix caching,
speculative drafts).

A combination that cannot work is refused here, when the config is made, with a message that
names both settings, never at the first request and never silently (vLLM's lesson: one config,
checked once)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import InvalidRequestError, UnknownNameError
from .kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig
from .scheduler import SchedulerConfig

# "dense": the model's own weights and dtype (fp32 on a CPU); the others are chapter 13's
# weight-only formats, int4 from the GGUF's own Q4_1 blocks.
WEIGHTS = ("dense", "int8", "int4")
# The runner's forwards ("auto": direct wherever it applies, else registry).
FORWARDS = ("auto", "direct", "registry", "compiled")
SPECULATIVE = ("ngram", "suffix")
DRAFT_POLICIES = ("adaptive", "fixed")
# A verification step feeds a request num_draft_tokens + 1 tokens. The CPU attention kernel
# attends runs of fewer than 16 tokens one at a time, as it does decodes, so that a verified
# token's attention is bit for bit its decode's (see kMinTileTokens in cpu_decode.cpp).
MAX_DRAFT_TOKENS = 14


# What each setting does, for the command line's flags (one per setting, `--help` from here).
SETTING_HELP = {
    "weights": "chapter 13: dense (the model's own), int8, or int4 (the GGUF's Q4_1 blocks)",
    "forward": "chapters 06/11: how a step runs the model (direct, registry, compiled; auto: "
               "direct wherever it applies)",
    "attention_backend": "the paged attention kernels (default: the best available)",
    "block_size": "tokens per KV block",
    "cuda_graphs": "chapter 07: decode steps replayed as CUDA graphs on a GPU",
    "prefix_caching": "chapter 09: reuse the KV blocks of a prompt prefix seen before",
    "speculative": "chapter 14: draft tokens to verify in the same step (ngram: prompt lookup; "
                   "suffix: the longest earlier match, drafts as long as it)",
    "num_draft_tokens": f"chapter 14: the most draft tokens a request gets in one step (at most "
                        f"{MAX_DRAFT_TOKENS})",
    "draft_policy": "chapter 14: adaptive (drafts where the step's cost model says they pay) "
                    "or fixed",
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What chapter 08's continuous engine and every stage built on it are configured by."""

    # the scheduler (chapter 08)
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 256  # requests running at once
    chunked_prefill: bool = True
    # the KV pool
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # the pool's size in blocks (None: from kv_cache_bytes)
    kv_cache_bytes: int | None = None  # the pool's size in bytes (None: the default pool)
    # the runner, built in this order: weights, forward, tensor parallelism, CUDA graphs
    weights: str = "dense"  # chapter 13: one of WEIGHTS
    forward: str = "auto"  # chapters 06 and 11: one of FORWARDS
    compile_options: object | None = None  # the compiled forward's CompileOptions (None: its own)
    warm_up: bool = True  # compiled: build every bucket's graph before the first step
    attention_backend: str | None = None  # None: the best available
    tensor_parallel: int = 1  # chapter 12: ranks the model is split over
    cuda_graphs: bool = True  # chapter 07's graphs for decode steps, where the device has CUDA
    # around the runner
    prefix_caching: bool = False  # chapter 09
    speculative: str | None = None  # chapter 14: one of SPECULATIVE, or None
    num_draft_tokens: int = 4  # the most draft tokens a request gets in one step
    draft_policy: str = "adaptive"  # one of DRAFT_POLICIES
    knee_tokens: float | None = None  # the draft budget's cost model (None: the device's)
    token_cost: float | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise (UnknownNameError if problem.startswith("unknown") else
                   InvalidRequestError)(problem)

    def problem(self) -> str | None:
        """Why these settings cannot run, naming each setting involved; None if they can."""
        for name, allowed in (("weights", WEIGHTS), ("forward", FORWARDS),
                              ("draft_policy", DRAFT_POLICIES)):
            if getattr(self, name) not in allowed:
                return (f"unknown {name} {getattr(self, name)!r}; choose one of "
                        f"{', '.join(allowed)}")
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            return (f"unknown speculative {self.speculative!r}; choose one of "
                    f"{', '.join(SPECULATIVE)} (or none)")
        for name in ("tensor_parallel", "num_draft_tokens"):
            value = getattr(self, name)
            least = 1 if name == "tensor_parallel" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                return f"{name} must be an integer >= {least}, got {value!r}"
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            return (f"num_draft_tokens must be at most {MAX_DRAFT_TOKENS}, got "
                    f"{self.num_draft_tokens}: a longer verification would attend in the CPU "
                    f"kernel's tiles, not as its decodes do, and could change the tokens")
        tp = self.tensor_parallel
        if tp > 1 and self.forward not in ("auto", "direct"):
            # Each rank runs the direct forward over its shard; a compiled graph per rank
            # (and its warm-up under a collective) is not built yet.
            return (f"forward={self.forward!r} and tensor_parallel={tp} do not combine: the "
                    f"sharded model runs the direct forward on every rank")
        if tp > 1 and self.weights != "dense":
            return (f"weights={self.weights!r} and tensor_parallel={tp} do not combine: "
                    f"the ranks shard dense weights only")
        if self.weights != "dense" and self.forward == "registry":
            return (f"weights={self.weights!r} and forward='registry' do not combine: quantized "
                    f"linears live in our own model, which the registry forward does not run")
        return None

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """``config`` (default: the defaults) with ``options`` set; an option that is no field
        is an error naming it."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s) {', '.join(unknown)}; "
                                      f"options: {', '.join(names)}")
        return dataclasses.replace(config or cls(), **options)

    @property
    def kv_cache(self) -> KVCacheConfig:
        return KVCacheConfig(self.block_size, self.num_blocks, self.kv_cache_bytes)

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                               self.chunked_prefill)

    @staticmethod
    def choices(name: str) -> tuple | None:
        """The values a setting takes, where they are a fixed list."""
        return {"weights": WEIGHTS, "forward": FORWARDS, "speculative": SPECULATIVE,
                "draft_policy": DRAFT_POLICIES}.get(name)

    def describe(self) -> dict[str, object]:
        """The settings that say what runs (for ``/v1/models`` and ``/metrics``)."""
        return {name: getattr(self, name) for name in (
            "weights", "forward", "attention_backend", "tensor_parallel", "cuda_graphs",
            "prefix_caching", "speculative", "num_draft_tokens", "draft_policy",
            "max_num_batched_tokens", "max_num_seqs", "block_size")}
