"""The serving engine's decode steps under CUDA graphs (issue 67): on a CPU everything but the
capture itself, through the emulated graphs (the same static buffers, padding and bucket
choice, run without a graph): the tokens of a workload whose batch changes every step, which
steps replayed, and the scratch block the padding rows use. Capture safety (no host reads in
the captured function) is checked in tests/test_gpu_readiness.py; the GPU's own run against
hf in tests/test_gpu_equality.py."""

from __future__ import annotations

import dataclasses

import torch

from miniinfer import SamplingParams, make_engine
from miniinfer.runner.cuda_graphs import GRAPH_BUCKETS, SCRATCH_REQUEST, DecodeGraphs

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_k=30, seed=3)


def workload(lm, engine) -> dict[int, list[int]]:
    """Requests that arrive at different steps, with prompts chunked by a small budget, so the
    batch grows and shrinks: decode-only steps of 1 to 5 requests between mixed ones."""
    gen = torch.Generator().manual_seed(67)
    prompts = [torch.randint(3, lm.config.vocab_size, (n,), generator=gen).tolist()
               for n in (20, 5, 33, 9, 14)]
    arrivals = {0: [0, 1], 3: [2], 6: [3, 4]}
    finished, step = {}, 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for rid in arrivals.get(step, []):
            engine.add_request(prompts[rid], SAMPLED if rid == 3 else GREEDY, request_id=rid)
        finished.update((o.request_id, o.output_ids) for o in engine.step().outputs
                        if o.finished)
        step += 1
    return finished


class CountingGraphs(DecodeGraphs):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replayed: list[int] = []  # each replayed step's batch size

    def replay(self, step):
        self.replayed.append(step.num_tokens)
        return super().replay(step)


def test_emulated_decode_graphs_give_the_eager_tokens(tiny):
    eager = make_engine("continuous", tiny, forward="direct", max_num_batched_tokens=24)
    assert eager.runner.decode_graphs is None, "no graphs on a CPU unless asked for"
    want = workload(tiny, eager)

    engine = make_engine("continuous", tiny, forward="direct", max_num_batched_tokens=24)
    runner = engine.runner
    runner.decode_graphs = graphs = CountingGraphs(runner.forward, runner.kv_cache,
                                                   tiny.max_context, emulate=True)
    got = workload(tiny, engine)
    assert got == want
    # Decode-only steps of several sizes replayed, each in the smallest bucket holding it.
    assert set(graphs.replayed) >= {1, 2, 5}
    assert set(graphs.graphs) == {next(b for b in GRAPH_BUCKETS if b >= n)
                                  for n in graphs.replayed}
    assert graphs.forward is runner.forward
    # Every request's blocks went back; the padding rows' scratch block stays taken.
    manager = runner.kv_cache.block_manager
    assert SCRATCH_REQUEST in manager and len(manager.block_tables[SCRATCH_REQUEST]) == 1
    assert manager.num_free_blocks == manager.num_blocks - 1


def test_a_step_with_prompt_chunks_or_several_scored_positions_runs_eagerly(tiny):
    engine = make_engine("continuous", tiny, forward="direct", max_num_batched_tokens=24)
    runner = engine.runner
    graphs = DecodeGraphs(runner.forward, runner.kv_cache, tiny.max_context, emulate=True)
    engine.add_request(list(range(5, 25)), GREEDY, request_id=0)
    with torch.inference_mode():  # as the engine's step runs
        step, _ = runner.prepare_step(
            engine.scheduler.schedule().plan(runner.kv_cache.block_manager))
    assert step.num_chunks == 1 and not graphs.fits(step)
    decode = dataclasses.replace(step, num_decodes=step.num_tokens, query_starts=None)
    assert not graphs.fits(decode), "20 scored positions of one request are not decodes"


