"""Chapter 11's recording: our engine before and after ``torch.compile``, beside vLLM.

Two tables, everything in one process's run so that ratios compare like with like:

- the offline benchmark (``<device>.csv``): hf, chapter 06's ``paged-attention`` (our best
  eager stage), the ``compiled`` stage and, when installed, the peer ``vllm``, at batch 1 and 8;
  the compiled forward's compile time per graph goes to ``<device>-compile.csv``;
- chapter 08's target workload (``<device>-{runs,requests,steps}.csv``): ``continuous`` on the
  eager forward and on the compiled one (``compiled``), and vLLM's offline ``LLM.generate``.

On a GPU it records nothing for now (see :func:`run_chapter11`).

Without the peer (``make peers``) the chapter records our rows and says so.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from ..bench.offline import make_bench_engine, run_bench, summary_table
from ..bench.peers import VLLM, PeerMissingError, check_peer
from ..core.devices import REPO_ROOT, device_slug, device_speed, run_metadata
from ..core.models import load_model, resolve_device
from .chapters import CHAPTERS
from .results import RESULTS
from .serving_records import record_serving
from .workloads import default_workload, serving_experiments

BATCH_SIZES = (1, 8)  # the rows: one request alone, and a batch


def peer_available() -> bool:
    """Whether vLLM is installed as a peer; prints why not (one line) when it is not."""
    try:
        check_peer(VLLM)
    except PeerMissingError as missing:
        print(f"chapter 11 records our rows only: {missing}")
        return False
    return True


def run_chapter11(device: str | torch.device | None = "auto") -> list[Path]:
    """Chapter 11 on this machine: the offline benchmark and the compile times, then chapter
    08's target workload served by each system (see the module's docstring)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        # The GPU plan has no room left in a session's device time (book.plans), and the
        # device machine cannot install the peer.
        print("chapter 11 records on a CPU only for now; nothing to measure here")
        return []
    systems = tuple(e for e in CHAPTERS["11"].engines_for(dev.type)
                    if e != VLLM or peer_available())
    model, base = default_workload(dev)
    lm = load_model(model, device=dev)
    out_dir = RESULTS / "ch11"
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = device_slug(dev)

    config = replace(base, engines=systems, batch_sizes=BATCH_SIZES, chapter="11")
    engines = {name: make_bench_engine(name, lm) for name in systems}
    try:
        bench = run_bench(lm, config, engines, speed=device_speed(dev, store=True))
    finally:
        for engine in engines.values():
            if hasattr(engine, "close"):
                engine.close()
    print(summary_table(bench).to_string(index=False))
    bench_path = out_dir / f"{slug}.csv"
    bench.to_csv(bench_path, index=False)
    forward = engines["compiled"].runner.forward
    compile_path = out_dir / f"{slug}-compile.csv"
    pd.DataFrame([{"graph": graph, "tokens": tokens, "compile_s": seconds}
                  for (graph, tokens), seconds in sorted(forward.compile_seconds.items())]) \
        .assign(compiled=forward.compiled, reason_eager=forward.reason_eager or "",
                model=lm.name, **run_metadata(dev)).to_csv(compile_path, index=False)
    for path in (bench_path, compile_path):
        print(f"wrote {path.relative_to(REPO_ROOT)}")

    _, experiments = serving_experiments(dev)
    served = ("continuous", "compiled", *(s for s in systems if s == VLLM))
    serving = {"target": replace(experiments["target"], systems=served, chapter="11")}
    return [bench_path, compile_path, *record_serving(dev, "11", model, serving)[1]]
