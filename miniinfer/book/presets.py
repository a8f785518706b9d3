"""How big a notebook's live runs are: the ``small`` preset the test suite uses, or ``full``."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..bench.offline import BenchConfig
from ..core.models import resolve_device
from .workloads import default_workload


@dataclass(frozen=True, slots=True)
class Preset:
    """How big the notebook's live runs are. ``small`` keeps a chapter to a couple of minutes
    on 2 CPU cores (the test suite uses it); ``full`` has the sizes ``make chapter-NN`` records
    with on this device (:func:`miniinfer.book.workloads.default_workload`)."""

    name: str
    device: torch.device
    model: str
    bench: BenchConfig


def preset(engines: tuple[str, ...], chapter: str) -> Preset:
    name = os.environ.get("MINIINFER_PRESET", "full")
    if name not in ("small", "full"):
        raise ValueError(f"MINIINFER_PRESET must be 'small' or 'full', got {name!r}")
    if name == "small":
        # CPU and the real SmolLM2 even where a GPU exists: the test suite checks the prose's
        # claims, it does not measure.
        return Preset(name, torch.device("cpu"), "smollm2-135m",
                      BenchConfig(engines, (1, 4), prompt_len=32, new_tokens=8, warmup=0,
                                  repeat=1, chapter=chapter))
    # The sizes `make chapter-NN` records with (book.workloads), so a live run and the
    # recorded one compare like for like.
    device = resolve_device(os.environ.get("MINIINFER_DEVICE", "auto"))
    model, config = default_workload(device, chapter)
    return Preset(name, device, os.environ.get("MINIINFER_MODEL") or model,
                  replace(config, engines=engines, chapter=chapter))
