"""The machine a result came from: names, a file-name slug, versions, how busy it was while a
benchmark ran (the load guard), and its speed of light (memory bandwidth and peak compute,
measured once per device and kept in ``data/results/devices.csv``)."""

from __future__ import annotations

import csv
import datetime as dt
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from ..core.hardware import (
    REPO_ROOT,
    RESULTS_DIR,
    YOURS_DIR,
    device_isa,
    device_name,
    device_slug,
    sync,
)
from ..core.kv_cache import kv_bytes_per_block
from ..core.models import LoadedModel


def cpu_label(name: str, isa: str) -> str:
    """A CPU as the book's tables name it, its name and instruction set: "AMD EPYC (AVX2)"
    (a name that has it already is left as it is: chapter 07's timelines were once written
    with the label)."""
    label = f" ({isa})"
    return name if name.endswith(label) else name + label


def device_label(device: torch.device) -> str:
    """This device as the recorded tables name it: a GPU by its name, a CPU by
    :func:`cpu_label` (so a live table says which of two hosts of one name it ran on)."""
    name = device_name(device)
    return name if device.type == "cuda" else cpu_label(name, device_isa(device))


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
        "isa": device_isa(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_sha": git_sha(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _best_time(device: torch.device, work, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``work`` after one warm-up: on a shared machine
    other work only ever slows a run down, so the best run is closest to what the hardware does."""
    work()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(device: torch.device, mib: int = 512, repeats: int = 7) -> float:
    """Device memory bandwidth in bytes/s: the best of ``repeats`` copies of a ``mib`` MiB
    tensor (a copy reads and writes every byte once). A decode step must read every weight, so
    weight bytes / this bandwidth is a lower bound on its time."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_time(device, lambda: dst.copy_(src), repeats)


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the book's models use on ``device`` (fp32 on CPU, bf16 on CUDA)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def measure_peak_flops(device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """Dense matmul throughput in FLOP/s: the best of ``repeats`` ``n x n @ n x n`` products in
    the book's dtype for the device, with torch's current thread count."""
    a = torch.randn(n, n, device=device).to(compute_dtype(device))
    b = torch.randn(n, n, device=device).to(compute_dtype(device))
    return 2 * n**3 / _best_time(device, lambda: a @ b, repeats)


# The book's recordings (committed) and the reader's own (``make chapter-NN``; gitignored). A
# reader's run never writes into the book's data, so it cannot change the book's text or tables.
# Set by ``repro --for-book`` (a clean tree only): the recording becomes the book's.
FOR_BOOK_ENV = "MINIINFER_RECORD_FOR_BOOK"
DEVICES_CSV = RESULTS_DIR / "devices.csv"


def recording_for_book() -> bool:
    """Whether this process is the book's own sitting (``repro --for-book``), not a reader's."""
    return os.environ.get(FOR_BOOK_ENV) == "1"


def recording_root() -> Path:
    """Where a recording made now goes: the book's results for ``repro --for-book``, else the
    reader's own folder."""
    return RESULTS_DIR if recording_for_book() else YOURS_DIR
DEVICE_FIELDS = ("slug", "isa", "name", "bandwidth_gbs", "peak_gflops", "threads",
                 "how_measured", "date")


@dataclass(frozen=True, slots=True)
class DeviceSpeed:
    """A device's speed of light: what every chapter's decode floor divides by. A device is its
    slug and its instruction set together: two hosts sold under one name (a Zen 4 and a Zen 3
    "AMD EPYC" here) differed threefold in bandwidth (49 vs 16 GB/s)."""

    slug: str
    name: str
    bandwidth_gbs: float
    peak_gflops: float  # nan where not known
    threads: int
    how_measured: str
    date: str
    isa: str = ""  # device_isa(): AVX512, AVX2, sm_90, ...

    @property
    def key(self) -> tuple[str, str]:
        return self.slug, self.isa

    @property
    def label(self) -> str:
        """The device as the tables name it (:func:`device_label`)."""
        return cpu_label(self.name, self.isa) if self.slug.startswith("cpu") and self.isa \
            else self.name

    @property
    def bandwidth(self) -> float:  # bytes/s
        return self.bandwidth_gbs * 1e9

    @property
    def peak_flops(self) -> float:  # FLOP/s
        return self.peak_gflops * 1e9


def read_devices(path: Path = DEVICES_CSV) -> dict[tuple[str, str], DeviceSpeed]:
    """The recorded devices by (slug, isa) (empty when none is recorded yet)."""
    if not Path(path).exists():
        return {}
    with open(path, newline="") as f:
        speeds = [DeviceSpeed(row["slug"], row["name"], float(row["bandwidth_gbs"]),
                              float(row["peak_gflops"] or "nan"), int(row["threads"]),
                              row["how_measured"], row["date"], row.get("isa") or "")
                  for row in csv.DictReader(f)]
    return {speed.key: speed for speed in speeds}


def measure_device(device: torch.device) -> DeviceSpeed:
    """Measure bandwidth (best of 7 copies of 512 MiB) and peak matmul compute now."""
    bandwidth = measure_bandwidth(device)
    flops = measure_peak_flops(device)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    how = (f"bandwidth: best of 7 copies of 512 MiB (fp32); compute: best of 5 2048^3 matmuls "
           f"({str(compute_dtype(device)).removeprefix('torch.')}"
           + (f", {threads} threads)" if threads else ")"))
    return DeviceSpeed(device_slug(device), device_name(device), round(bandwidth / 1e9, 2),
                       round(flops / 1e9, 1), threads, how,
                       dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"), device_isa(device))


def write_device(speed: DeviceSpeed, path: Path = DEVICES_CSV) -> None:
    """Add or replace ``speed``'s row in the device table."""
    devices = read_devices(path) | {speed.key: speed}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(DEVICE_FIELDS)
        for d in sorted(devices.values(), key=lambda d: d.key):
            writer.writerow([getattr(d, name) for name in DEVICE_FIELDS])


# A device without a row in the table is measured once per process, not once per benchmark.
_measured_this_process: dict[tuple[str, str], DeviceSpeed] = {}


def device_speed(device: torch.device, path: Path = DEVICES_CSV, store: bool = False,
                 remeasure: bool = False) -> DeviceSpeed:
    """This device's speed of light, from the device table; measured when the table has no row
    for it (or ``remeasure``), and then written to the table only when ``store`` (``make
    chapter-NN`` stores; a notebook's live run never writes results). One figure per device
    keeps every chapter's floor on the same line, where a measurement per run moves with the
    machine's load. A row for the same name with another instruction set is another machine."""
    key = device_slug(device), device_isa(device)
    # The book's table, then the reader's own (where ``make chapter-NN`` stores a new device).
    tables = (path, YOURS_DIR / "devices.csv") if path == DEVICES_CSV else (path,)
    recorded = next((row for table in tables if (row := read_devices(table).get(key))), None) \
        or _measured_this_process.get(key)
    if recorded is not None and not remeasure:
        return recorded
    speed = _measured_this_process[key] = measure_device(device)
    if store:
        write_device(speed, recording_root() / "devices.csv" if path == DEVICES_CSV else path)
    return speed


# The load guard. A benchmark's own threads keep about that many cores busy; load beyond that
# is someone else's work competing for the cores (or, in a VM, the host's: CPU steal).
BUSY_EXTRA_LOAD_PER_CORE = 0.25
BUSY_STEAL_PCT = 5.0


def cpu_times() -> tuple[int, int] | None:
    """(total, steal) jiffies of all CPUs from /proc/stat; None where there is no such file."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:]]
    return sum(values), values[7] if len(values) > 7 else 0


def load_per_core() -> float:
    """1-minute load average over the number of cores (nan where the OS has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return float("nan")


@dataclass(slots=True)
class LoadGuard:
    """Records how busy the machine was around a measurement: ``with LoadGuard(threads) as g:``
    then ``g.columns()`` gives ``load_before``, ``load_after`` (load per core), ``steal_pct``
    (CPU steal over the interval, nan without /proc/stat) and ``busy`` (competing work seen)."""

    threads: int = 1  # runnable threads the measurement itself keeps busy
    load_before: float = float("nan")
    load_after: float = float("nan")
    steal_pct: float = float("nan")
    _times: tuple[int, int] | None = None

    def __enter__(self) -> LoadGuard:
        self.load_before = load_per_core()
        self._times = cpu_times()
        return self

    def __exit__(self, *exc) -> None:
        self.load_after = load_per_core()
        end = cpu_times()
        if self._times is not None and end is not None and end[0] > self._times[0]:
            self.steal_pct = 100 * (end[1] - self._times[1]) / (end[0] - self._times[0])

    @property
    def busy(self) -> bool:
        return is_busy(self.load_before, self.load_after, self.steal_pct, self.threads)

    def columns(self) -> dict[str, float | bool]:
        return {"load_before": round(self.load_before, 3), "load_after": round(self.load_after, 3),
                "steal_pct": round(self.steal_pct, 2), "busy": self.busy}

    def warn(self, what: str) -> None:
        if self.busy:
            print(f"warning: {what} ran on a busy machine (load per core {self.load_before:.2f} "
                  f"before, {self.load_after:.2f} after, CPU steal {self.steal_pct:.1f}%; its "
                  f"own work explains {self.threads / (os.cpu_count() or 1):.2f}): its timings "
                  "are not representative", file=sys.stderr)


def is_busy(load_before: float, load_after: float, steal_pct: float, threads: int,
            cores: int | None = None) -> bool:
    """Competing work: load per core beyond what the measurement's own ``threads`` explain, or
    CPU steal above ``BUSY_STEAL_PCT``. The 1-minute load before a run still holds the previous
    runs of the same benchmark, so our own threads are allowed for on both sides."""
    cores = cores or os.cpu_count() or 1
    own = min(threads, cores) / cores
    return bool(load_before > BUSY_EXTRA_LOAD_PER_CORE + own
                or load_after > BUSY_EXTRA_LOAD_PER_CORE + own
                or steal_pct > BUSY_STEAL_PCT)


@dataclass(frozen=True, slots=True)
class DecodeFloor:
    """The speed of light of one decode step: the bytes it must read over the bandwidth, or the
    FLOPs it must do over the peak compute, whichever takes longer."""

    weight_bytes: int
    kv_bytes: int
    bandwidth: float  # bytes/s
    flops: float = 0.0
    peak_flops: float = float("nan")  # FLOP/s; nan: no compute roof known

    @property
    def memory_ms(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth * 1e3

    @property
    def compute_ms(self) -> float:
        return self.flops / self.peak_flops * 1e3 if self.peak_flops > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        return max(self.memory_ms, self.compute_ms) if self.compute_ms == self.compute_ms \
            else self.memory_ms

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms > self.memory_ms else "memory"


def kv_bytes_per_token(lm: LoadedModel) -> int:
    return kv_bytes_per_block(lm.config, lm.dtype, 1)


def decode_floor(lm: LoadedModel, batch_size: int, context_len: int, bandwidth: float,
                 peak_flops: float = float("nan"), weight_bytes: int | None = None
                 ) -> DecodeFloor:
    """Floor for a step at ``context_len`` cached tokens per request: all weights read once,
    plus every request's K and V for every layer; and 2 FLOPs per weight per token (a
    multiply-add; the embedding table counts once, as the tied LM head's matmul) plus attention's
    2 FLOPs per cached K (or V) element per query head sharing it. ``weight_bytes``: what a
    step of a stage with smaller weights reads instead (int8, int4 codes and their scales); its
    FLOPs stay the model's."""
    cfg = lm.config
    kv = kv_bytes_per_token(lm) * batch_size * context_len
    itemsize = torch.empty((), dtype=lm.dtype).element_size()
    heads_per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    flops = 2 * batch_size * lm.weight_bytes / itemsize + 2 * heads_per_kv * kv / itemsize
    return DecodeFloor(weight_bytes or lm.weight_bytes, kv, bandwidth, flops, peak_flops)
