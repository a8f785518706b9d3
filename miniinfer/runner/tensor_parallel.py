"""Tensor parallelism (chapter 12): one Llama/Qwen2 model split across N ranks of
``torch.distributed``, Megatron-style.

Every rank holds a slice of every layer, and a layer needs two collectives:

- **column parallel**: the q/k/v projections and the MLP's gate/up are split by output
  columns. Rank ``r`` holds whole attention heads (``num_heads / N`` query heads and their KV
  heads) and ``intermediate_size / N`` MLP channels, so attention and the gated activation run
  on each rank's own heads and channels without talking to anyone. GQA's KV heads are split
  with their query heads; where N is larger than the KV heads (tiny at TP=4: 2 KV heads), each
  KV head is *replicated* on ``N / kv_heads`` ranks, as vLLM does, and every rank still holds
  exactly the KV heads its query heads read.
- **row parallel**: o_proj and down_proj are split by input rows, matching the columns the rank
  produced. Each rank's product is a partial sum of the full output; **one all-reduce** (sum)
  each makes the hidden state whole and identical on every rank again. So a step costs
  ``2 x num_layers`` all-reduces of ``tokens x hidden`` values, and nothing else.
- **KV pool**: each rank's pool holds only its own KV heads (``[layers, 2, num_blocks,
  block_size, kv_heads / N, head_dim]``); the block tables index every rank's pool the same way.

The embedding and the LM head are **not split**. The embedding is replicated: a lookup reads
only the step's few rows, so splitting it would save memory but cost a third all-reduce per
step. The LM head runs **on rank 0 only**, the rank that samples: the hidden state after the
last all-reduce is already whole there, so the logits need no gather at all, and the other
ranks end their step at that all-reduce. A vocab-split head (each rank a slice of the vocab,
then a gather of ``rows x vocab / N`` logits) reads ``1 / N`` of the head per rank instead;
it pays off where the head is a large share of the weights read per step at high N (Qwen2.5-7B:
1.1 GB of 15 GB in bf16, read by rank 0 alone here), which is the next step, not this one.

Processes. Rank 0 is the caller's process: it owns the engine, the scheduler and the tokenizer.
Every step it sends the other ranks the step batch (:class:`~miniinfer.runner.step.StepBatch`,
packed by walking its fields: no wire format of its own), in two broadcasts: a fixed-size
header on a gloo "control" group, then one flat int64 payload on the data group. The attention
kernels are chosen once, at start, like rank 0's. Workers load the model
themselves by name (random-weight models are seeded, and a checksum of every weight tensor is
compared across ranks before the first step), keep only their shard, and loop: receive, run the
layers, all-reduce. On one machine the package starts them (``torch.multiprocessing`` spawn,
rendezvous on a ``TCPStore`` at a free localhost port); across machines ``torchrun`` starts
every rank and rank/world size/address come from its environment; after the rendezvous the code
path is the same. Backend: gloo on CPU, NCCL on CUDA (the control group is always gloo: workers
idle there between steps, which must not count against the step timeout).

Failure. Every collective a step runs is bounded by the step timeout (the data group's timeout;
rank 0's control broadcasts wait with the same bound), and rank 0 checks that its workers are
alive before each step and, when a step fails, which one died and how. A rank that dies or
hangs ends the run with :class:`RankFailure` naming it, never a silent hang; the other ranks are
shut down. Workers ignore SIGINT: Ctrl-C in a terminal reaches every process of the group, and
only rank 0 knows whether the step it interrupted can be finished, so rank 0 ends them (a
half-done step leaves the ranks out of step, so an interrupted forward cannot be reused). No
worker outlives rank 0: a spawned one gets SIGKILL when rank 0's process ends (Linux's
parent-death signal), a torchrun one sees its connection close and fails. On NCCL a hung
collective is ended by NCCL's own watchdog at the data group's timeout (it aborts the process),
since CUDA collectives do not block the host.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..core.errors import InvalidRequestError, MiniInferError
from ..core.kv_cache import head_dim, zeroed_pool
from ..core.models import LoadedModel, load_model
from .attention import PagedAttention
from .direct import DirectForward
from .model import Linear, Model, load, swap_linears, unsupported_reason
from .step import StepBatch

# A step is milliseconds on a GPU and at most seconds on a CPU; a collective that waits this
# long means a rank is gone or stuck.
DEFAULT_STEP_TIMEOUT_S = 60.0
# Workers import torch and transformers and load the model (a 7B random model on a GPU, or a
# slow shared CPU); rank 0 waits this long for all of them before giving up.
DEFAULT_START_TIMEOUT_S = 600.0
# Between steps workers wait on the control group: a server may idle for hours.
IDLE_TIMEOUT = timedelta(days=365)
# How long a worker that failed gets to report its exit status before rank 0 reports a hang.
EXIT_GRACE_S = 2.0
STORE_PREFIX = "miniinfer-tp/"
SETUP_KEY = "setup"
READY_KEY = "ready"  # a counter: workers ready to join the process group
ALL_READY_KEY = "all-ready"  # set by the last of them
LOCALHOST = "127.0.0.1"

STEP, SHUTDOWN = 1, 0
HEADER_LEN = 1 + StepBatch.header_len()  # the command, then the step batch's own header


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the group is shut down."""


# -- which rank holds what ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How a model's heads and MLP channels split over ``world_size`` ranks."""

    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (more than 1 only when N > KV heads)."""
        return max(1, self.world_size // self.num_kv_heads)

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.world_size

    def q_heads(self, rank: int) -> range:
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        """The KV heads that rank's query heads read: with N > KV heads, rank ``r`` holds
        head ``r // replicas``; its query heads all belong to that head's group."""
        first = rank // self.kv_replicas * self.kv_heads_per_rank
        return range(first, first + self.kv_heads_per_rank)

    def channels(self, rank: int) -> range:
        n = self.intermediate_per_rank
        return range(rank * n, (rank + 1) * n)


def _layout_problems(config, n: int) -> list[str]:
    heads, kv, inter = (config.num_attention_heads, config.num_key_value_heads,
                        config.intermediate_size)
    problems = []
    if heads % n:
        problems.append(f"it does not divide the {heads} attention heads (every rank holds "
                        f"whole heads)")
    if kv % n and n % kv:
        problems.append(f"it neither divides the {kv} KV heads nor is a multiple of them (a "
                        f"multiple replicates each KV head on N / {kv} ranks)")
    if inter % n:
        problems.append(f"it does not divide the intermediate size {inter}")
    return problems


def shard_layout(config, tensor_parallel: int, model_name: str = "the model") -> ShardLayout:
    """The split of ``config``'s layers over ``tensor_parallel`` ranks, checked: raises
    :class:`InvalidRequestError` naming the numbers (and the sizes that would work)."""
    n = tensor_parallel
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequestError(f"tensor_parallel must be an integer >= 1, got {n!r}")
    if problems := _layout_problems(config, n):
        sizes = [m for m in range(1, config.num_attention_heads + 1)
                 if not _layout_problems(config, m)]
        raise InvalidRequestError(
            f"tensor_parallel={n} cannot split {model_name}: {'; '.join(problems)}; sizes that "
            f"work: {', '.join(map(str, sizes))}")
    return ShardLayout(n, config.num_attention_heads, config.num_key_value_heads,
                       head_dim(config), config.intermediate_size)


# -- one rank's slice of the model -------------------------------------------------------------


class RowParallelLinear(Linear):
    """A :class:`~miniinfer.runner.model.Linear` split by input columns: this rank's slice of
    the weight takes the slice of the input its column-parallel predecessor produced, the
    partial products are summed over the ranks (one all-reduce), and the bias is added once.
    Alone (one rank), exactly the dense ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, world_size: int) -> None:
        super().__init__(weight, bias)
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        partial = F.linear(x, self.weight)
        dist.all_reduce(partial)
        return partial if self.bias is None else partial + self.bias


def column_parallel(dense: Linear, rows: torch.Tensor) -> Linear:
    """A column-parallel Linear: ``dense``'s output rows ``rows`` (its weight and bias rows,
    copied, so that the whole tensor can be freed). It needs no communication: the next
    row-parallel Linear reads its output as this rank's slice."""
    bias = None if dense.bias is None else dense.bias[rows].contiguous()
    return Linear(dense.weight[rows].contiguous(), bias)


def _heads(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def shard_model(model: Model, layout: ShardLayout, rank: int, lm_head: bool) -> Model:
    """Rank ``rank``'s share of ``model``: its query heads and their KV heads of the fused QKV
    projection and its MLP channels of the fused gate/up projection (column parallel), the
    matching input columns of the output and down projections (row parallel, an all-reduce
    each), everything else shared; the LM head where ``lm_head`` (rank 0). At one rank, the
    model's own weights (no copies)."""
    if layout.world_size == 1:
        return model
    dim = layout.head_dim
    q_all, kv_all = layout.num_heads * dim, layout.num_kv_heads * dim
    q_rows, kv_rows = _heads(layout.q_heads(rank), dim), _heads(layout.kv_heads(rank), dim)
    channels = layout.channels(rank)
    channels = torch.arange(channels.start, channels.stop)
    rows = {"qkv": torch.cat([q_rows, q_all + kv_rows, q_all + kv_all + kv_rows]),
            "gate_up": torch.cat([channels, layout.intermediate_size + channels])}
    columns = {"out": q_rows, "down": channels}

    def split(name: str, linear: Linear) -> Linear:
        kind = name.rsplit(".", 1)[-1]
        if kind in rows:
            return column_parallel(linear, rows[kind])
        if kind in columns:
            return RowParallelLinear(linear.weight[:, columns[kind]].contiguous(), linear.bias,
                                     layout.world_size)
        return linear if lm_head else None  # the LM head: whole, on rank 0 only

    shard = swap_linears(model, split)
    local = (len(q_rows), len(kv_rows), len(kv_rows))
    for layer in shard.layers:
        layer.attention.qkv_sizes = local
    return shard


class ShardedForward(DirectForward):
    """Rank ``rank``'s share of :class:`DirectForward`: the same model with parallel linears
    (:func:`shard_model`) and, on rank 0 only, the LM head. Same call as DirectForward;
    without the LM head it returns None."""

    def __init__(self, model: PreTrainedModel, layout: ShardLayout, rank: int,
                 attention: PagedAttention | None, lm_head: bool) -> None:
        super().__init__(shard_model(load(model), layout, rank, lm_head), attention)


def allocate_kv_pool(config, layout: ShardLayout, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One rank's pool, its KV heads only; per layer the (k_cache, v_cache) views."""
    kv = zeroed_pool((config.num_hidden_layers, 2, num_blocks, block_size,
                      layout.kv_heads_per_rank, layout.head_dim), dtype, device)
    return [(layer[0], layer[1]) for layer in kv]


# Same-size integer views: an integer sum is exact and independent of summation order.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_fingerprint(model: PreTrainedModel) -> torch.Tensor:
    """Per parameter, the int64 sum of its bits (read as integers): equal on every rank when
    the ranks hold the same weights, whatever the device's summation order."""
    return torch.stack([p.detach().flatten().view(_INT_OF_SIZE[p.element_size()])
                        .sum(dtype=torch.int64) for p in model.parameters()]).cpu()


# -- processes and groups ----------------------------------------------------------------------


@dataclass(slots=True)
class Rendezvous:
    """Where a rank is and how it reaches the others (before the process group exists)."""

    rank: int
    world_size: int
    local_rank: int  # the CUDA device index on its machine
    store: dist.Store


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What rank 0 tells every worker through the store (torchrun workers know nothing else)."""

    model_name: str
    dtype: torch.dtype
    device_type: str
    num_blocks: int
    block_size: int
    step_timeout_s: float
    attention_backend: str | None  # as rank 0's (None: the best available)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any env:// launcher) started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ \
        else None


def rendezvous_from_env(timeout_s: float) -> Rendezvous:
    """torchrun's rendezvous: rank, world size and the store's address from its environment
    (the store torchrun's agent already runs, as ``init_process_group("env://")`` finds it)."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return Rendezvous(rank, world_size, local_rank, dist.PrefixStore(STORE_PREFIX, store))


def _data_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def _rank_device(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def report_ready(rdv: Rendezvous) -> None:
    """A worker is ready to join the group (the last one to say so tells rank 0)."""
    if rdv.store.add(READY_KEY, 1) == rdv.world_size - 1:
        rdv.store.set(ALL_READY_KEY, b"1")


def wait_ready(rdv: Rendezvous, workers: Workers | None, what: str, timeout_s: float) -> None:
    """Rank 0: wait until every worker is ready; ours are watched so that a crash (an import
    error, a failed load) is reported at once instead of after the timeout."""
    if workers is None:
        rdv.store.wait([ALL_READY_KEY], timedelta(seconds=timeout_s))
    else:
        workers.wait_until(lambda: rdv.store.check([ALL_READY_KEY]), what, timeout_s)


def join_groups(rdv: Rendezvous, device: torch.device, step_timeout_s: float):
    """Every rank: the default (data) group and the gloo control group; returns the latter."""
    backend = _data_backend(device.type)
    dist.init_process_group(backend, store=dist.PrefixStore("pg/", rdv.store), rank=rdv.rank,
                            world_size=rdv.world_size,
                            timeout=timedelta(seconds=step_timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class Workers:
    """The worker processes rank 0 started (ranks 1..N-1) and their store."""

    def __init__(self, world_size: int, target: Callable, args: tuple, start_timeout_s: float,
                 cuda_base: int = 0) -> None:
        # Port 0: the OS picks a free port, and the store holds it from then on (no race).
        self.store = dist.TCPStore(LOCALHOST, 0, world_size, is_master=True,
                                   timeout=timedelta(seconds=start_timeout_s),
                                   wait_for_workers=False)
        self.context = mp.start_processes(
            target, args=(self.store.port, world_size, start_timeout_s, cuda_base, *args),
            nprocs=world_size - 1, join=False, daemon=True, start_method="spawn")
        self.pids = self.context.pids()

    def rendezvous(self, world_size: int, cuda_base: int) -> Rendezvous:
        return Rendezvous(0, world_size, cuda_base, dist.PrefixStore(STORE_PREFIX, self.store))

    def check(self) -> bool:
        """Raise :class:`RankFailure` if a worker failed (the others are then ended); True when
        every worker has exited cleanly."""
        codes = [p.exitcode for p in self.context.processes]
        failed = [rank for rank, code in enumerate(codes, 1) if code not in (None, 0)]
        if not failed:
            return all(code == 0 for code in codes)
        self.stop(grace_s=EXIT_GRACE_S)
        # When one rank dies the others fail too, their connections to it closed. A rank
        # killed by a signal (a kill, the OOM killer) is the likely cause; else the lowest.
        first = min(failed, key=lambda rank: (codes[rank - 1] > 0, rank))
        also = "; ".join(self._describe(rank, brief=True) for rank in failed if rank != first)
        raise RankFailure(f"tensor-parallel {self._describe(first)}"
                          + (f"\n(then also: {also})" if also else ""))

    def _describe(self, rank: int, brief: bool = False) -> str:
        """How worker ``rank`` ended, with the traceback it left (torch's spawn wrapper saves
        it in a file for the parent) or, ``brief``, its last line."""
        process = self.context.processes[rank - 1]
        code = process.exitcode
        head = f"rank {rank} (pid {process.pid})"
        if code < 0:
            return f"{head} died (killed by signal {signal.Signals(-code).name})"
        error_file = self.context.error_files[rank - 1]
        if not os.path.exists(error_file):
            return f"{head} died (exit code {code})"
        with open(error_file, "rb") as f:
            trace = pickle.load(f).rstrip()
        return f"{head} failed: {trace.splitlines()[-1]}" if brief \
            else f"{head} raised an error:\n{trace}"

    def wait_for_exit(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for some worker to exit; raise RankFailure if one did."""
        running = [p for p in self.context.processes if p.exitcode is None]
        ready = multiprocessing.connection.wait([p.sentinel for p in running],
                                                timeout=timeout_s) if running else []
        for process in running:
            if process.sentinel in ready:
                # Its sentinel closes as it exits, a moment before it can be reaped: wait for
                # that (a non-blocking look could still see it running).
                process.join()
        self.check()

    def wait_until(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Wait for ``done()``, checking every 0.1 s that no worker has died meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel workers did not {what} within {timeout_s} s")
            self.wait_for_exit(0.1)

    def stop(self, grace_s: float) -> None:
        """End every worker still running: wait ``grace_s`` for a clean exit, then SIGKILL."""
        deadline = time.monotonic() + grace_s
        for process in self.context.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.context.processes:
            if process.is_alive():
                process.kill()
            process.join()


class _Group:
    """Rank 0's side of a live group: what ``close`` and the finalizer must release."""

    def __init__(self, workers: Workers | None, control, step_timeout_s: float) -> None:
        self.workers = workers  # None under torchrun: its agent owns the processes
        self.control = control
        self.step_timeout = timedelta(seconds=step_timeout_s)
        self.closed_because: str | None = None

    def broadcast_header(self, header: list[int]) -> None:
        """Rank 0's send on the control group, bounded by the step timeout (workers wait there
        without one, between steps)."""
        work = dist.broadcast(torch.tensor(header, dtype=torch.int64), 0, group=self.control,
                              async_op=True)
        work.wait(self.step_timeout)

    def failure(self, exc: BaseException) -> RankFailure:
        """What went wrong when a collective failed: a worker that died, else a hang."""
        if self.workers is not None:
            try:
                self.workers.wait_for_exit(EXIT_GRACE_S)
            except RankFailure as died:
                return died
        return RankFailure(f"a tensor-parallel collective failed or timed out after "
                           f"{self.step_timeout.total_seconds():g} s (a rank hung or died): "
                           f"{exc}")

    def shutdown(self, reason: str = "closed", graceful: bool = True) -> None:
        """Tell the workers to exit (graceful) or kill them; idempotent, finalizer-safe."""
        if self.closed_because is not None:
            return
        self.closed_because = reason
        if graceful:
            try:
                self.broadcast_header([SHUTDOWN] + [0] * (HEADER_LEN - 1))
            except Exception:  # a worker already gone: it is killed below
                graceful = False
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group still has to go
            pass
        if self.workers is not None:
            self.workers.stop(grace_s=10.0 if graceful else 0.0)


def check_no_process_group() -> None:
    if dist.is_initialized():
        raise MiniInferError("a torch.distributed process group is already initialized in this "
                             "process (another TensorParallelForward still open?); close it "
                             "first")


class TensorParallelForward:
    """Rank 0's forward over ``tensor_parallel`` ranks, with :class:`DirectForward`'s call:
    ``forward(input_ids [T], position_ids [T], metadata, logits_rows=None)`` -> logits
    ``[rows, vocab]``. Only the index tensors of ``metadata`` are used: every rank attends in
    its own pool of ``num_blocks`` blocks of ``block_size`` tokens (its KV heads only), indexed
    by the engine's block tables.

    ``lm`` is rank 0's model (its shard is copied out; the other ranks load ``lm.name``
    themselves). At TP=1 no process starts and the forward is DirectForward's computation.
    Close it (``close``, ``with``, or let the finalizer do it) to end the workers; a process
    holds one group at a time.

    The workers are spawned: a script that builds one needs the usual ``if __name__ ==
    "__main__":`` guard, and the thread that builds it must outlive it (a worker is killed when
    the thread that started it ends: Linux's parent-death signal, so none outlives rank 0)."""

    def __init__(self, lm: LoadedModel, tensor_parallel: int, num_blocks: int, block_size: int,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 pool: torch.Tensor | None = None, attention_backend: str | None = None) -> None:
        reason = unsupported_reason(lm.model)
        if reason:
            raise MiniInferError(f"tensor parallelism cannot run {lm.name!r}: {reason}")
        self.layout = shard_layout(lm.config, tensor_parallel, repr(lm.name))
        self.world_size = n = tensor_parallel
        rank = torchrun_rank()
        if rank is not None and rank != 0:
            raise MiniInferError(f"rank {rank} of a torchrun job runs run_worker(), not the "
                                 f"engine; only rank 0 builds a TensorParallelForward")
        if rank is None and n > 1 and lm.device.type == "cuda":
            base, count = lm.device.index or 0, torch.cuda.device_count()
            if base + n > count:
                raise InvalidRequestError(
                    f"tensor_parallel={n} from {lm.device} needs cuda:{base}..cuda:{base + n - 1}"
                    f"; this machine has {count} GPU(s)")
        if n > 1:
            check_no_process_group()
        self._group: _Group | None = None
        # Rank 0's pool: the engine's, where it passes one of this rank's heads (a model
        # runner's), or one of its own.
        if pool is None:
            self.kv = allocate_kv_pool(lm.config, self.layout, num_blocks, block_size,
                                       lm.dtype, lm.device)
        else:
            expected = (lm.config.num_hidden_layers, 2, num_blocks, block_size,
                        self.layout.kv_heads_per_rank, self.layout.head_dim)
            if tuple(pool.shape) != expected:
                raise MiniInferError(f"rank 0's KV pool must be {list(expected)} (its own "
                                     f"KV heads only), got {list(pool.shape)}")
            self.kv = [(layer[0], layer[1]) for layer in pool]
        attention = PagedAttention.over(self.kv, lm.device, block_size, attention_backend)
        self.shard = ShardedForward(lm.model, self.layout, 0, attention, lm_head=True)
        if n == 1:
            return
        setup = WorkerSetup(lm.name, lm.dtype, lm.device.type, num_blocks, block_size,
                            step_timeout_s, attention.backend.name)
        workers = None
        if rank is None:
            workers = Workers(n, _spawned_worker, (), start_timeout_s, lm.device.index or 0)
            rdv = workers.rendezvous(n, lm.device.index or 0)
        else:
            rdv = rendezvous_from_env(start_timeout_s)
            if rdv.world_size != n:
                raise InvalidRequestError(f"tensor_parallel={n} but torchrun started "
                                          f"{rdv.world_size} processes (WORLD_SIZE)")
        try:
            rdv.store.set(SETUP_KEY, pickle.dumps(setup))
            wait_ready(rdv, workers, "load the model", start_timeout_s)
            control = join_groups(rdv, lm.device, step_timeout_s)
        except BaseException:
            if workers is not None:
                workers.stop(grace_s=0.0)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self._group = _Group(workers, control, step_timeout_s)
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        try:
            self._check_same_weights(lm.model)
        except BaseException:
            self.close()
            raise

    def _check_same_weights(self, model: PreTrainedModel) -> None:
        mine = weights_fingerprint(model)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self._group.control, async_op=True).wait(
            self._group.step_timeout)
        names = [name for name, _ in model.named_parameters()]
        for rank, theirs in enumerate(gathered):
            if not torch.equal(theirs, mine):
                first = names[int((theirs != mine).nonzero()[0])]
                raise MiniInferError(f"tensor-parallel rank {rank} loaded different weights "
                                     f"than rank 0 (first differing tensor: {first}); a "
                                     f"random-weight model must be created from a fixed seed")

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (empty at TP=1 and under torchrun)."""
        group = self._group
        return [] if group is None or group.workers is None else list(group.workers.pids)

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        group = self._group
        if group is None:
            return self.shard(batch)
        if group.closed_because is not None:
            raise RankFailure(f"this tensor-parallel group is shut down ({group.closed_because})"
                              f"; build a new TensorParallelForward")
        header, payload = batch.pack()
        self.check_alive()
        try:
            group.broadcast_header([STEP, *header])
            dist.broadcast(payload, 0)
            return self.shard(batch)
        except KeyboardInterrupt:
            # The workers are somewhere in this step: they cannot be brought back in step.
            group.shutdown("interrupted during a step", graceful=False)
            raise
        except Exception as exc:
            failure = group.failure(exc)
            group.shutdown(str(failure), graceful=False)
            raise failure from exc

    def check_alive(self) -> None:
        """Raise :class:`RankFailure` if a worker has exited (the group is then shut down);
        no collective runs, so a server's idle engine can call it between steps."""
        group = self._group
        if group is None or group.workers is None:
            return
        if group.closed_because is not None:
            raise RankFailure(f"this tensor-parallel group is shut down ({group.closed_because})"
                              f"; build a new TensorParallelForward")
        try:
            if group.workers.check():
                raise RankFailure("every tensor-parallel worker has exited")
        except RankFailure as exc:
            group.shutdown(str(exc), graceful=False)
            raise

    def close(self) -> None:
        """Shut the workers down (they exit their loop); the forward cannot run again."""
        if self._group is not None:
            self._finalizer()

    def __enter__(self) -> TensorParallelForward:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -- the worker side ---------------------------------------------------------------------------


def _spawned_worker(index: int, port: int, world_size: int, start_timeout_s: float,
                    cuda_base: int) -> None:
    """Entry point of a worker rank 0 spawned (``index`` 0 is rank 1). An error propagates:
    torch's spawn wrapper hands its traceback to rank 0, which reports it."""
    # Ignoring SIGINT (see ``serve``) also ignores the signal torch's spawn sends a child
    # whose parent died; a kill cannot be ignored, and no worker outlives rank 0.
    mp._prctl_pr_set_pdeathsig(signal.SIGKILL)
    store = dist.TCPStore(LOCALHOST, port, world_size, is_master=False,
                          timeout=timedelta(seconds=start_timeout_s))
    rank = index + 1
    serve(Rendezvous(rank, world_size, cuda_base + rank, dist.PrefixStore(STORE_PREFIX, store)))


def run_worker(start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
    """A torchrun rank other than 0: serve rank 0's steps until it closes the group. The CLI
    calls this instead of building an engine when ``torchrun_rank()`` is not 0."""
    serve(rendezvous_from_env(start_timeout_s))


def serve(rdv: Rendezvous) -> None:
    """A worker's life: load, shard, join the groups, then run steps until told to stop."""
    # Ctrl-C reaches every process of the terminal's group; rank 0 decides what ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup: WorkerSetup = pickle.loads(rdv.store.get(SETUP_KEY))
    device = _rank_device(setup.device_type, rdv.local_rank)
    if device.type == "cpu":
        # N processes share the machine's cores (rank 0 keeps the caller's setting).
        torch.set_num_threads(max(1, torch.get_num_threads() // rdv.world_size))
    else:
        torch.cuda.set_device(device)
    lm = load_model(setup.model_name, device, setup.dtype)
    config = lm.config
    layout = shard_layout(config, rdv.world_size, repr(setup.model_name))
    fingerprint = weights_fingerprint(lm.model)
    shard = ShardedForward(lm.model, layout, rdv.rank, None, lm_head=False)
    del lm  # only the shard (and the shared embedding and norms) stays, before the pool
    kv = allocate_kv_pool(config, layout, setup.num_blocks, setup.block_size, setup.dtype, device)
    shard.attention = PagedAttention.over(kv, device, setup.block_size, setup.attention_backend)
    report_ready(rdv)
    control = join_groups(rdv, device, setup.step_timeout_s)
    dist.all_gather([torch.empty_like(fingerprint) for _ in range(rdv.world_size)], fingerprint,
                    group=control)
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0, group=control)
            values = header.tolist()
            if values[0] == SHUTDOWN:
                break
            payload = torch.empty(StepBatch.payload_len(values[1:]), dtype=torch.int64,
                                  device=device)
            dist.broadcast(payload, 0)
            shard(StepBatch.unpack(values[1:], payload))
    dist.destroy_process_group()
