"""The machine a result came from: names, a file-name slug, versions, and memory bandwidth
(the speed of light of decode)."""

from __future__ import annotations

import datetime as dt
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from .models import LoadedModel

REPO_ROOT = Path(__file__).resolve().parent.parent


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_slug(device: torch.device) -> str:
    """``cpu-intel-xeon-platinum-8481c`` / ``cuda-nvidia-h100-80gb-hbm3``: the CSV file name."""
    name = device_name(device).lower()
    name = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$|\bprocessor\b|\d+-core", " ", name)
    name = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"{device.type}-{name}" if name else device.type


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        # Only the engine's code decides whether a result is reproducible from the sha; results
        # and notebooks being rewritten by the run itself do not.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "miniinfer", "data/configs"],
                               cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_metadata(device: torch.device) -> dict[str, str | int]:
    """Columns every result row carries, so a number can always be traced to its machine."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_sha": git_sha(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, mib: int = 512, repeats: int = 7) -> float:
    """Device memory bandwidth in bytes/s: p50 of timed tensor copies (a copy reads and writes
    every byte once). A decode step must read every weight, so weight bytes / this bandwidth is
    a lower bound on its time."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in both buffers
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times)


@dataclass(frozen=True, slots=True)
class DecodeFloor:
    """The speed of light of one decode step: bytes it must read over the bandwidth."""

    weight_bytes: int
    kv_bytes: int
    bandwidth: float  # bytes/s

    @property
    def step_ms(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth * 1e3


def kv_bytes_per_token(lm: LoadedModel) -> int:
    cfg = lm.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.empty((), dtype=lm.dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize


def decode_floor(lm: LoadedModel, batch_size: int, context_len: int, bandwidth: float) -> DecodeFloor:
    """Floor for a step at ``context_len`` cached tokens per request: all weights once, plus
    every request's K and V for every layer."""
    kv = kv_bytes_per_token(lm) * batch_size * context_len
    return DecodeFloor(lm.weight_bytes, kv, bandwidth)
