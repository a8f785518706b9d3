"""What a running engine needs of its machine: where the package lives, how to wait for a
device, and what the device computes with. The benchmark's view of a machine (names, speeds,
load, floors) is :mod:`miniinfer.bench.devices`."""

from __future__ import annotations

from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


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
