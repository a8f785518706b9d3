"""Chapter 12: tensor parallelism. The tiny model split over 2 and 4 processes (gloo on CPU)
gives TP=1's tokens and logits through the paged-attention and continuous engines; a rank that
dies or hangs fails the run with a message naming it; sizes that cannot split the heads are
refused, naming the numbers, before any process starts.

Every group of processes costs a few seconds to start (each rank imports torch and
transformers), so the equality tests share one TP=2 group."""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from miniinfer import (
    InvalidRequestError,
    MiniInferError,
    SamplingParams,
    load_model,
    make_engine,
)
from miniinfer.runner import StepBatch
from miniinfer.runner.tensor_parallel import (
    HEADER_LEN,
    RankFailure,
    ShardLayout,
    TensorParallelForward,
    shard_layout,
    weights_fingerprint,
)
from miniinfer.runner.tensor_parallel_costs import (
    LLAMA_70B,
    measure_all_reduce,
    paper_tensor_parallel,
    qwen25_7b,
)

POOL = {"num_blocks": 48, "block_size": 16}
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=7)
# Partial sums of 2-4 ranks add in another order than one matmul: fp32 rounding, no more.
LOGITS_ATOL = 1e-4


# The engine's own direct forward (over its own pool), the reference the TP runs are held to.
DIRECT = "direct"


class Recording:
    """A forward that keeps a copy of every step batch and its logits on the way through."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.steps: list[StepBatch] = []
        self.logits: list[torch.Tensor] = []

    def __call__(self, batch: StepBatch):
        logits = self.forward(batch)
        # A copy: the engine stages the next step's tensors in the same buffer.
        self.steps.append(copy.deepcopy(batch))
        self.logits.append(logits.clone())
        return logits


def prompts_for(lm, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, lm.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def paged_run(lm, forward, prompts, params) -> tuple[list[list[int]], Recording]:
    engine = make_engine("paged-attention", lm, forward="direct", **POOL)
    own = engine.runner.forward
    engine.runner.forward = recording = Recording(own if forward == DIRECT else forward)
    return engine.generate(prompts, params).token_ids, recording


def continuous_run(lm, forward) -> tuple[dict, Recording]:
    """Several requests arriving at different steps, prompts chunked by a 24-token budget, so
    that steps mix decodes with prompt chunks; one request samples."""
    engine = make_engine("continuous", lm, forward="direct", max_num_batched_tokens=24, **POOL)
    own = engine.runner.forward
    engine.runner.forward = recording = Recording(own if forward == DIRECT else forward)
    prompts = prompts_for(lm, [40, 5, 17, 30], seed=1)
    arrivals = {0: [0, 1], 2: [2], 5: [3]}
    params = {0: GREEDY, 1: SAMPLED, 2: GREEDY, 3: GREEDY}
    finished, step = {}, 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for rid in arrivals.get(step, []):
            engine.add_request(prompts[rid], params[rid], request_id=rid)
        result = engine.step()
        finished.update((r.request_id, r) for r in result.outputs if r.finished)
        step += 1
    return finished, recording


def assert_same_logits(ours: Recording, ref: Recording) -> None:
    assert len(ours.logits) == len(ref.logits)
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits, strict=True)):
        assert a.shape == b.shape, f"step {step}"
        assert torch.allclose(a, b, atol=LOGITS_ATOL, rtol=0), \
            f"step {step}: logits differ by up to {(a - b).abs().max():.2e}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- checks before any process starts ----------------------------------------------------------


def test_bad_sizes_name_the_numbers_and_start_nothing(tiny):
    with pytest.raises(InvalidRequestError) as err:
        TensorParallelForward(tiny, 3, **POOL)
    message = str(err.value)
    for part in ("tensor_parallel=3", "4 attention heads", "2 KV heads", "intermediate size 128",
                 "sizes that work: 1, 2, 4"):
        assert part in message, message
    assert not multiprocessing.active_children()
    for bad in (0, -2, True, 2.0, "2"):
        with pytest.raises(InvalidRequestError, match="integer >= 1"):
            shard_layout(tiny.config, bad)
    # SmolLM2-135M: 9 heads, 3 KV heads, intermediate 1536: TP=3 only (9 fails on 1536).
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                              intermediate_size=1536, head_dim=64)
    with pytest.raises(InvalidRequestError, match=r"9 attention heads.*sizes that work: 1, 3$"):
        shard_layout(smollm2, 2, "smollm2-135m")
    assert shard_layout(smollm2, 3).kv_heads_per_rank == 1


@pytest.mark.parametrize("kv_heads,group", [(1, 4), (2, 2), (3, 3), (4, 7), (8, 8)])
def test_every_rank_holds_the_kv_heads_its_query_heads_read(kv_heads, group):
    heads = kv_heads * group
    sizes = [n for n in range(1, heads + 1)
             if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    for n in sizes:
        layout = ShardLayout(n, heads, kv_heads, 16, 64 * n)
        held = [h for r in range(n) for h in layout.q_heads(r)]
        assert held == list(range(heads)), f"N={n}: query heads split into disjoint slices"
        for r in range(n):
            kv = layout.kv_heads(r)
            assert len(kv) == layout.kv_heads_per_rank
            # GQA: query head h reads KV head h // group; locally, the kernels' h // group too.
            for j, h in enumerate(layout.q_heads(r)):
                assert h // group == kv[j // (layout.heads_per_rank // len(kv))], (n, r, h)
        copies = [sum(k in layout.kv_heads(r) for r in range(n)) for k in range(kv_heads)]
        assert copies == [layout.kv_replicas] * kv_heads


# -- one rank, and the step on the wire --------------------------------------------------------


def test_tp1_is_direct_forward_bit_for_bit(tiny):
    prompts = prompts_for(tiny, [9, 23])
    ref_tokens, ref = paged_run(tiny, DIRECT, prompts, GREEDY)
    tokens, ours = paged_run(tiny, TensorParallelForward(tiny, 1, **POOL), prompts, GREEDY)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(ours.logits, ref.logits, strict=True))


def test_weights_fingerprint_tells_a_changed_tensor(tiny):
    """Workers load the model themselves; this is how rank 0 knows they loaded the same one."""
    again = load_model("tiny")  # random weights, from the same seed
    assert torch.equal(weights_fingerprint(again.model), weights_fingerprint(tiny.model))
    names = [name for name, _ in again.model.named_parameters()]
    with torch.no_grad():
        again.model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-6
    differs = weights_fingerprint(again.model) != weights_fingerprint(tiny.model)
    assert [names[i] for i in differs.nonzero()[:, 0]] == ["model.layers.1.mlp.up_proj.weight"]


def test_pack_then_unpack_gives_the_engines_step_batch(tiny):
    _, recording = continuous_run(tiny, DIRECT)
    kinds = set()
    for batch in recording.steps:
        header, payload = batch.pack()
        assert len(header) == HEADER_LEN - 1 and payload.numel() == StepBatch.payload_len(header)
        got = StepBatch.unpack(header, payload)
        for field in dataclasses.fields(StepBatch):
            sent, back = getattr(batch, field.name), getattr(got, field.name)
            if isinstance(sent, torch.Tensor):
                assert torch.equal(back, sent.to(back.dtype)), field.name
                assert back.shape == sent.shape, field.name
            else:
                assert back == sent, field.name
        kinds.add((batch.num_decodes > 0, batch.num_chunks > 0))
    assert kinds == {(True, False), (False, True), (True, True)}, "every kind of step was sent"


# -- TP=2 and TP=4 equal TP=1 ------------------------------------------------------------------


@pytest.fixture(scope="class")
def tp2(tiny):
    """One TP=2 group per class that asks for it: a process holds one torch.distributed group
    at a time, so it must be closed before the tests that start their own."""
    with TensorParallelForward(tiny, 2, **POOL) as forward:
        yield forward


class TestOneSharedTP2Group:
    def test_tp2_paged_attention_equals_tp1(self, tiny, tp2):
        prompts = prompts_for(tiny, [9, 23, 1, 16])
        direct = DIRECT
        for params in (GREEDY, SAMPLED):
            ref_tokens, ref = paged_run(tiny, direct, prompts, params)
            tokens, ours = paged_run(tiny, tp2, prompts, params)
            assert tokens == ref_tokens, params
            assert_same_logits(ours, ref)
        assert len(set(tokens[0])) > 1, "sampled tokens vary, so equal sequences mean something"
        assert all(alive(pid) for pid in tp2.pids) and len(tp2.pids) == 1

    def test_tp2_continuous_with_several_requests_equals_tp1(self, tiny, tp2):
        ref_finished, ref = continuous_run(tiny, DIRECT)
        finished, ours = continuous_run(tiny, tp2)
        assert sorted(finished) == [0, 1, 2, 3]
        for rid, request in finished.items():
            assert request.output_ids == ref_finished[rid].output_ids, f"request {rid}"
            assert request.finish_reason == ref_finished[rid].finish_reason
        mixed = [b for b in ours.steps if b.num_decodes and b.num_chunks]
        assert mixed, "some step carried decodes and prompt chunks together"
        assert_same_logits(ours, ref)

    def test_one_group_per_process(self, tiny, tp2):
        with pytest.raises(MiniInferError, match="already initialized"):
            TensorParallelForward(tiny, 2, **POOL)


def test_the_tensor_parallel_engine_holds_one_pool_on_rank_0_of_its_own_kv_heads(tiny):
    prompts = prompts_for(tiny, [12, 3, 20])
    ref = make_engine("continuous", tiny, forward="direct", **POOL).generate(prompts, GREEDY)
    engine = make_engine("tensor-parallel", tiny, tensor_parallel=2, **POOL)
    try:
        runner = engine.runner
        config = tiny.config
        # tiny has 2 KV heads: rank 0 holds one, in the runner's pool, which the forward uses.
        assert runner.kv_cache.kv.shape == (config.num_hidden_layers, 2, 48, 16, 1,
                                            config.hidden_size // config.num_attention_heads)
        assert runner.forward.kv[0][0].data_ptr() == runner.kv_cache.kv[0, 0].data_ptr()
        out = engine.generate(prompts, GREEDY)
        assert out.token_ids == ref.token_ids
        manager = runner.kv_cache.block_manager
        assert manager.num_free_blocks == manager.num_blocks
    finally:
        engine.close()
    with pytest.raises(MiniInferError, match=r"rank 0's KV pool must be \[3, 2, 48, 16, 1, 16\]"):
        TensorParallelForward(tiny, 2, **POOL, pool=torch.zeros(3, 2, 48, 16, 2, 16))


def test_tp4_replicates_kv_heads_and_equals_tp1(tiny):
    # tiny has 4 heads and 2 KV heads: at TP=4 each KV head lives on 2 ranks.
    prompts = prompts_for(tiny, [12, 3, 20])
    ref_tokens, ref = paged_run(tiny, DIRECT, prompts, SAMPLED)
    with TensorParallelForward(tiny, 4, **POOL) as tp4:
        assert tp4.layout.kv_replicas == 2 and tp4.kv[0][0].shape[2] == 1
        pids = tp4.pids
        tokens, ours = paged_run(tiny, tp4, prompts, SAMPLED)
    assert tokens == ref_tokens
    assert_same_logits(ours, ref)
    assert len(pids) == 3 and not any(alive(pid) for pid in pids), "close ended the workers"


# -- failures end the run ----------------------------------------------------------------------


class BeforeRank0Computes:
    """Rank 0's shard, with ``action`` run once the step's inputs have gone out."""

    def __init__(self, shard, action) -> None:
        self.shard, self.action = shard, action

    def __call__(self, batch):
        self.action()
        return self.shard(batch)


def test_a_rank_killed_mid_step_fails_the_run_naming_it(tiny):
    prompts = prompts_for(tiny, [10])
    tp = TensorParallelForward(tiny, 2, **POOL)
    (pid,) = tp.pids
    tp.shard = BeforeRank0Computes(tp.shard, lambda: os.kill(pid, signal.SIGKILL))
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"rank 1 \(pid {pid}\) died \(killed by signal "
                                          rf"SIGKILL\)"):
        paged_run(tiny, tp, prompts, GREEDY)
    assert time.monotonic() - start < 30
    assert not alive(pid)
    with pytest.raises(RankFailure, match="shut down"):
        paged_run(tiny, tp, prompts, GREEDY)
    tp.close()


def test_a_hung_rank_fails_the_run_after_the_step_timeout(tiny):
    tp = TensorParallelForward(tiny, 2, step_timeout_s=3, **POOL)
    (pid,) = tp.pids
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="timed out after 3 s"):
        paged_run(tiny, tp, prompts_for(tiny, [10]), GREEDY)
    assert 3 <= time.monotonic() - start < 30
    assert not alive(pid), "the hung rank was killed"
    tp.close()


def test_an_interrupted_step_ends_every_rank(tiny):
    def interrupt():
        raise KeyboardInterrupt

    tp = TensorParallelForward(tiny, 2, **POOL)
    (pid,) = tp.pids
    tp.shard = BeforeRank0Computes(tp.shard, interrupt)
    with pytest.raises(KeyboardInterrupt):
        paged_run(tiny, tp, prompts_for(tiny, [10]), GREEDY)
    assert not alive(pid)
    with pytest.raises(RankFailure, match="interrupted"):
        paged_run(tiny, tp, prompts_for(tiny, [10]), GREEDY)


# -- what it costs -----------------------------------------------------------------------------


def test_all_reduce_table_has_a_row_per_size_and_rank_count():
    sizes = (1024, 65536)
    rows = measure_all_reduce((2,), sizes, repeats=3, warmup=1)
    assert [(r["world_size"], r["message_bytes"]) for r in rows] == [(2, 1024), (2, 65536)]
    assert all(0 < r["min_us"] <= r["p50_us"] for r in rows)
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) for r in rows)  # 2(N-1)/N = 1
    assert {r["dtype"] for r in rows} == {"float32"}  # what the recorded table says it summed


def test_paper_arithmetic_for_7b_and_70b():
    qwen = {row["tp"]: row for row in paper_tensor_parallel(qwen25_7b())}
    assert qwen[1]["weights_per_device_GB"] == pytest.approx(15.23, abs=0.01)  # 7.6B x 2 bytes
    assert qwen[2]["all_reduces_per_step"] == 2 * 28
    assert "28 attention heads" in qwen[8]["note"], "28 heads cannot split 8 ways"
    llama = {row["tp"]: row for row in paper_tensor_parallel(LLAMA_70B)}
    assert not llama[1]["fits_h100"] and llama[2]["fits_h100"]
    assert llama[1]["bandwidth_floor_ms"] == pytest.approx(41.5, abs=0.1)  # 139 GB / 3.35 TB/s
    # Latency-bound all-reduces: 160 of them cost the same at any N, so the gain shrinks.
    assert llama[8]["comm_ms_best"] == pytest.approx(160 * 5.06e-3, rel=0.01)
    speedups = [llama[n]["speedup_best"] for n in (2, 4, 8)]
    assert speedups == sorted(speedups) and speedups[-1] < 8 * 0.8
