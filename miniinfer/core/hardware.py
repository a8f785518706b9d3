"""What a running engine needs of its machine: where the package lives, how to wait for a
device, and what the device computes with. The benchmark's view of a machine (names, speeds,
load, floors) is :mod:`miniinfer.bench.devices`."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
# The book's recordings, and a reader's own (never read by the tests or the book's text).
RESULTS_DIR = REPO_ROOT / "data" / "results"
YOURS_DIR = REPO_ROOT / "data" / "yours"


def device_isa(device: torch.device) -> str:
    """What the device computes with, beyond its name: hosts sold under one CPU name differ
    (an "AMD EPYC" VM here was a Zen 4 with AVX-512 one day and a Zen 3 with AVX2 only the
    next), and that decides which kernels can run (bf16 needs AVX-512). A CPU's vector
    extension as PyTorch dispatches to it (``AVX512``, ``AVX2``, ...); a GPU's ``sm_XY``."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return torch.backends.cpu.get_cpu_capability()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    """``cpu-intel-xeon-platinum-8481c-avx512`` / ``cuda-nvidia-h100-80gb-hbm3``: the CSV file
    name. A CPU's ends with its instruction set (:func:`device_isa`): hosts sold under one name
    are different machines (a Zen 4 and a Zen 3 were both "AMD EPYC" here), and one's results
    must not overwrite the other's. A GPU's name says which chip it is."""
    name = device_name(device).lower()
    name = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$|\bprocessor\b|\d+-core", " ", name)
    if device.type == "cpu":
        name += f" {device_isa(device)}".lower()
    name = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"{device.type}-{name}" if name else device.type
