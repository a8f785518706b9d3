"""The chapter registry: every fact about a chapter, in one place and as data only.

``repro`` (what ``make chapter-NN`` records), the overview's map of the book (chapter 00),
``python -m miniinfer engines`` and the README's chapter table (a test checks it against
:func:`chapters_markdown`) all read :data:`CHAPTERS`. To add a chapter or a stage: its entry
here, its module, its notebook, its tests; nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

# What each kind of recording is, in words (the recordings themselves: lab.recordings).
RECORDINGS = {
    "none": "nothing (reads the recorded results)",
    "bench": "offline benchmark",
    "paged": "offline benchmark; on a GPU also the decode kernel's bandwidth",
    "profile": "profiled decode steps and the offline benchmark",
    "async": "offline benchmark and stream timelines",
    "serving": "serving workloads (rate, budget and batching sweeps)",
    "prefix": "shared-prefix and multi-turn serving workloads",
    "server": "the target workload in-process and over HTTP",
    "catching": "offline benchmark and the target workload in-process and over HTTP, beside "
                "vLLM (the lab notes' probes with MINIINFER_CH11_PROBES=1)",
    "parallel": "gloo all-reduce times and a TP=1 vs TP=3 benchmark",
    "quantized": "offline benchmark and, where `make peers-llama` built it, llama.cpp on the same "
                 "GGUF (Q4_1, Q8_0, F32)",
    "speculative": "input-grounded (rewrite, copy) and open-ended chat prompts at batch 1 and "
                   "served, beside transformers' prompt lookup",
    "composed": "the whole engine served from 1, 4 and 16 clients beside llama-server and vLLM "
                "where built, then an ablation",
}


# The book's reference recordings, one device per kind: every table and figure a chapter shows
# is read from these devices' files (``data/results/chNN/<slug>*.csv``); other machines' files
# stay in the data and appear once, in the overview's "other machines" table. The CPU's are one
# `repro all --for-book` run at one commit (its log: data/results/logs/repro-<commit>.csv).
REFERENCE_DEVICES = {"cpu": "cpu-amd-epyc-avx512", "cuda": "cuda-nvidia-h200"}
# (chapter, kind) -> a slug that chapter shows instead; none today (a test keeps the CPU's empty).
REFERENCE_OVERRIDES: dict[tuple[str, str], str] = {}


def reference_device(chapter: str, kind: str) -> str:
    """The slug of the device whose recording chapter ``chapter`` shows for ``kind``."""
    return REFERENCE_OVERRIDES.get((chapter, kind), REFERENCE_DEVICES[kind])


@dataclass(frozen=True, slots=True)
class Chapter:
    number: str  # "01"
    slug: str  # the notebook's file name without ".ipynb"
    title: str  # the notebook's first heading, after "Chapter NN — "
    stages: tuple[str, ...] = ()  # the engine stages it adds (names in the engine registry)
    modules: tuple[str, ...] = ()  # the supporting modules it adds
    idea: str = ""  # one sentence, for a chapter that adds no stage
    # What `repro` records: "bench" (the offline benchmark of `engines`), "none" (reads the
    # recorded results only), or the name of the chapter's own recording in lab.recordings.
    recording: str = "bench"
    engines: tuple[str, ...] = ()  # the stages its recording compares, in one run
    cuda_engines: tuple[str, ...] = ()  # added to `engines` on a GPU
    context_sweep: tuple[str, ...] = ()  # the stages its context-length sweep runs, if any
    # The CPU benchmark's decode length where the chapter needs other than the book's 32 tokens.
    new_tokens: int | None = None

    @property
    def notebook(self) -> str:
        return f"{self.slug}.ipynb"

    def engines_for(self, device_type: str) -> tuple[str, ...]:
        """The stages its recording compares on a device of this type ("cpu", "cuda")."""
        return self.engines + (self.cuda_engines if device_type == "cuda" else ())


CHAPTERS: dict[str, Chapter] = {ch.number: ch for ch in (
    Chapter("00", "00_overview", "The map of the book", recording="none",
            idea="what each chapter adds and every stage's recorded results at a glance"),
    Chapter("01", "01_naive_hf_decode", "Decoding by hand, and the baseline to beat",
            stages=("hf", "naive"),
            modules=("miniinfer.core.models", "miniinfer.bench.offline", "miniinfer.bench.devices"),
            engines=("hf", "naive")),
    Chapter("02", "02_paged_kv_cache", "A paged KV cache", stages=("paged-loop",),
            modules=("miniinfer.core.kv_cache",), engines=("hf", "naive", "paged-loop")),
    # From chapter 03 on, naive (== hf within noise, chapter 01) is left out to save time.
    Chapter("03", "03_vectorized_gather", "One gather per layer", stages=("paged-vectorized",),
            engines=("hf", "paged-loop", "paged-vectorized"),
            context_sweep=("hf", "paged-loop", "paged-vectorized")),
    # The stage's two changes measured apart: the buffer (no allocation, no cat) with the old
    # per-request K/V write, then the batched write on top.
    Chapter("04", "04_preallocated_buffers", "Preallocated buffers, fewer ops",
            stages=("paged-prealloc",),
            engines=("hf", "paged-loop", "paged-vectorized", "paged-prealloc:per-request",
                     "paged-prealloc"),
            context_sweep=("hf", "paged-loop", "paged-vectorized", "paged-prealloc")),
    Chapter("05", "05_decode_profiling", "Where does a decode step's time go?",
            modules=("miniinfer.core.ranges", "miniinfer.bench.profiling"),
            idea="named profiler ranges over every phase of a step, and SQL over the exported "
                 "trace to see where the time goes",
            recording="profile", engines=("hf", "paged-prealloc")),
    # Both ways into the model: HF's modules (registry) and our direct forward (the default).
    # The context sweep leaves the registry variant out: its ablation is the benchmark's.
    Chapter("06", "06_paged_attention", "Paged attention: read the KV where it lies",
            stages=("paged-attention",),
            modules=("miniinfer.core.kernels", "miniinfer.runner"),
            recording="paged",
            engines=("hf", "paged-vectorized", "paged-prealloc", "paged-attention:registry",
                     "paged-attention"),
            context_sweep=("hf", "paged-vectorized", "paged-prealloc", "paged-attention")),
    Chapter("07", "07_async_streams",
            "Async loops and CUDA graphs: take the host off the critical path",
            stages=("async",), recording="async",
            engines=("hf", "paged-attention", "async:sync", "async:overlap"),
            cuda_engines=("async:cuda-graph",)),
    Chapter("08", "08_continuous_batching",
            "Continuous batching, chunked prefill and online serving metrics",
            stages=("continuous",),
            modules=("miniinfer.core.scheduler", "miniinfer.bench.serving"),
            recording="serving", engines=("continuous",)),
    Chapter("09", "09_prefix_caching",
            "Prefix caching: a prompt's shared beginning is computed once",
            stages=("prefix-cache",), modules=("miniinfer.core.prefix_cache",),
            idea="hash-chained full blocks with ref counts and LRU eviction: a shared prompt "
                 "beginning is computed once",
            recording="prefix", engines=("continuous", "prefix-cache")),
    Chapter("10", "10_openai_server", "Serving over HTTP: an OpenAI-compatible server",
            modules=("miniinfer.server",),
            idea="the engine behind an OpenAI-compatible HTTP API, driven by the official client",
            recording="server", engines=("continuous",)),
    Chapter("11", "11_catching_vllm", "Catching vLLM: PyTorch's compiler on the reader's CPU",
            stages=("compiled",),
            modules=("miniinfer.runner.compiled", "miniinfer.runner.compiled_attention",
                     "miniinfer.runner.onednn_linear", "miniinfer.core.kernels.cpu_decode",
                     "miniinfer.bench.peers"),
            recording="catching", engines=("hf", "paged-attention", "compiled", "vllm")),
    Chapter("12", "12_tensor_parallel", "Tensor parallelism: one model across several processes",
            stages=("tensor-parallel",),
            modules=("miniinfer.runner.tensor_parallel", "miniinfer.runner.tensor_parallel_costs"),
            recording="parallel", engines=("hf", "continuous", "tensor-parallel")),
    Chapter("13", "13_quantized_weights",
            "Weights as they ship: int8, and int4 from the GGUF's own blocks, against llama.cpp",
            stages=("quantized",),
            modules=("miniinfer.runner.quantized", "miniinfer.bench.quality",
                     "miniinfer.bench.peers.llama_cpp", "miniinfer.lab.quantization"),
            recording="quantized",
            # fp32 against 8 and 4 bits on one forward (chapter 11's compiled one), as llama.cpp
            # runs each format; 64 new tokens, so the decode step weighs more than the prefill.
            engines=("hf", "compiled", "quantized:int8", "quantized:int4"), new_tokens=64),
    Chapter("14", "14_speculative_decoding",
            "Speculative decoding: several tokens per step, the same tokens out",
            stages=("speculative",),
            modules=("miniinfer.core.speculative", "miniinfer.lab.speculation"),
            recording="speculative",
            engines=("prefix-cache", "speculative", "speculative:fixed", "hf")),
    Chapter("15", "15_the_whole_engine",
            "The whole engine, served: every optimisation at once, against llama.cpp and vLLM",
            stages=("composed",), modules=("miniinfer.lab.deploy",
                                           "miniinfer.bench.peers.llama_server"),
            recording="composed", engines=("composed", "llama-server", "vllm")),
)}


def chapter_of_stage(stage: str) -> str | None:
    """The chapter that adds ``stage`` (``"stage:variant"``: the stage's); None for a name no
    chapter registers."""
    name = stage.partition(":")[0]
    return next((ch.number for ch in CHAPTERS.values() if name in ch.stages), None)


def chapters_markdown() -> str:
    """The README's chapter table: number, notebook, the stages each chapter adds and what its
    recording runs (titles stay in the notebooks and here)."""
    rows = ["| ch | notebook | stages it adds | what `make chapter-NN` records |",
            "| --- | --- | --- | --- |"]
    rows += [f"| {ch.number} | `{ch.slug}` | {', '.join(f'`{s}`' for s in ch.stages) or '-'} | "
             f"{RECORDINGS[ch.recording]}"
             f"{': ' + ', '.join(f'`{e}`' for e in ch.engines) if ch.engines else ''} |"
             for ch in CHAPTERS.values()]
    return "\n".join(rows)


def chapter_nav(number: str) -> str:
    """The line that ends every chapter: links to the previous and next chapters and the map."""
    numbers = list(CHAPTERS)
    i = numbers.index(number)

    def link(n: str) -> str:
        return f"[Chapter {n} — {CHAPTERS[n].title}]({CHAPTERS[n].notebook})"

    parts = [f"**Previous:** {link(numbers[i - 1])}"] if i > 0 else []
    parts += [f"**Next:** {link(numbers[i + 1])}"] if i + 1 < len(numbers) else []
    parts += ["[The map of the book](00_overview.ipynb)"] if number != "00" else []
    return " · ".join(parts)
