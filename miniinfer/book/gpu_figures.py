"""What a GPU shows in a chapter's callout until a GPU row is recorded: each a reference post's
own figure, and the post (its key in :data:`~miniinfer.book.references.POSTS`; empty: none)."""

from __future__ import annotations

GPU_FIGURES: dict[str, tuple[str, tuple[str, str]]] = {
    "00": ("mini-infer", (
        "the paged gather went from 49.1% of HF (a Python loop) to 88.4% (vectorized), the gap "
        "chapters 02-06 close on a GPU;",
        "serving (chapters 08-10) wins there as here; no GPU row is recorded yet.")),
    "01": ("wde", (
        "an RTX 4090 has 1008 GB/s and 83 TFLOPS, 82 FLOP per byte: decode is memory-bound far "
        "past batch 8;",
        "so batching is nearly free there: the step barely grows with the batch.")),
    "02": ("mini-infer", (
        "the Python-loop gather ran at 49.1% of HF's throughput;",
        "its thousands of small copies are half of a ~17 ms forward step there.")),
    "03": ("mini-infer", (
        "the vectorized gather brought it to 88.4% of HF (batch 8: 361 vs 409 tok/s);",
        "the gather itself fell to 0.27-0.32 ms of a ~18 ms step.")),
    "04": ("roseinfer-perf", (
        "a preallocated KV buffer and fewer view ops: 408 -> 446 tokens/s (+9%);",
        "every aten op count per range explained from the shapes, as here.")),
    "05": ("mini-infer", (
        "model_forward 17.3-17.9 ms per step, 97-98% of the labelled time at batch 1/4/8;",
        "yet 12% behind HF: 3.8 ms per step sat between the labelled phases.")),
    "06": ("roseinfer-paged", (
        "no dense mask and one pinned copy of the block tables: 1908.7 -> 1921.1 decode tok/s;",
        "small at a 1,024-token context; a real paged kernel removes a copy that grows with it.")),
    "07": ("wde", (
        "a 7B fp8 decode step takes ~14 ms, of which scheduling and pre/post-processing 0.3 ms;",
        "async loops fill the GPU's idle gaps, and each request's decode latency roughly doubles.")),
    "08": ("wde", (
        "one step's time is set mainly by max_num_batched_tokens (its throughput-latency curves);",
        "a large budget can even lower throughput at the same latency.")),
    "09": ("", (
        "no GPU row yet, and none of the four reference posts measures prefix caching;",
        "vLLM's and SGLang's own write-ups (chapter 09's reading list) are the figures to expect.")),
    "10": ("", (
        "no GPU row yet, and none of the four reference posts measures an HTTP server;",
        "a GPU step of milliseconds makes the server's fixed cost per request a larger share.")),
    "11": ("wde", (
        "vLLM 0.6.3's throughput matched wde's synchronous loop there (wde is built on vLLM's "
        "code), and SGLang 0.3.5 was somewhat faster;",
        "no GPU row yet: on a GPU the compiled stage also captures CUDA graphs.")),
    "12": ("", (
        "no GPU row yet; on the chapter's paper model, Llama-3-70B at TP=8 on H100s holds 21.3 GB "
        "per device and takes 6.5-7.3 ms a step (TP=1 does not fit one device);",
        "Qwen2.5-7B stops at TP=4 there: 8 does not divide its 28 attention heads.")),
}
