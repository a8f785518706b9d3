"""The correctness template every engine stage reuses: greedy tokens equal HF generate's, token for
token, on the real SmolLM2 (fp32, CPU), for the whole mixed-length batch, and alone for the
prompts whose length is an edge case."""

from __future__ import annotations

from conftest import BOUNDARY_LENGTHS, NEW_TOKENS

from miniinfer import SamplingParams
from miniinfer.engines import Engine

ALONE_NEW_TOKENS = 16  # new tokens for the prompts checked alone (a prefix of HF's NEW_TOKENS)


def first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first differs at new token {i}: {x} vs HF {y}"
    return f"lengths differ: {len(a)} vs HF {len(b)}"


def assert_greedy_matches_hf(engine: Engine, prompts: list[list[int]],
                             hf_greedy: dict[str, list[list[int]]]) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    batched = engine.generate(prompts, params).token_ids
    for i, (ours, ref) in enumerate(zip(batched, hf_greedy["batched"], strict=True)):
        assert len(ours) == NEW_TOKENS
        assert ours == ref, f"{engine.name} batched, prompt {i} ({len(prompts[i])} tokens): " \
                            + first_difference(ours, ref)
    # Every prompt is checked in the batch above; alone (the engine's batch of one, no other
    # request in a step) the shortest and the block-boundary lengths, the edge cases of a
    # prefill. All twelve alone took about half of each stage's test time. 16 new tokens alone
    # instead of 32 take a third less time: the 16- and 32-token prompts' first decode still
    # opens a new block (the 17- and 33-token ones open theirs in the prefill), and the batch
    # above decodes across block boundaries at every length.
    boundary = range(len(prompts) - len(BOUNDARY_LENGTHS), len(prompts))
    alone = sorted({min(range(len(prompts)), key=lambda i: len(prompts[i])), *boundary})
    assert [len(prompts[i]) for i in boundary] == list(BOUNDARY_LENGTHS)
    alone_params = SamplingParams(max_new_tokens=ALONE_NEW_TOKENS, ignore_eos=True)
    for i in alone:
        prompt, ref = prompts[i], hf_greedy["single"][i][:ALONE_NEW_TOKENS]
        ours = engine.generate([prompt], alone_params).token_ids[0]
        assert ours == ref, f"{engine.name} alone, prompt {i} ({len(prompt)} tokens): " \
                            + first_difference(ours, ref)


def drive_requests(engine, requests: dict, arrival: dict[int, int], to_abort: dict[int, int],
                   min_steps: int, after_step=None) -> tuple[dict, set]:
    """Step a continuous engine until it is idle and ``min_steps`` have run: request ``rid`` of
    ``requests`` (id -> (prompt, params)) is added at step ``arrival[rid]``, and aborted at step
    ``to_abort[rid]`` where it has one. ``after_step(engine)`` runs after every step. Returns
    the finished requests by id and the ids whose abort took."""
    finished, steps, aborted = {}, 0, set()
    while engine.has_unfinished_requests() or steps < min_steps:
        for rid in [r for r, s in arrival.items() if s == steps]:
            engine.add_request(*requests[rid], request_id=rid)
        for rid in [r for r, s in to_abort.items() if s == steps]:
            if engine.abort(rid):
                aborted.add(rid)
        result = engine.step()
        if after_step is not None:
            after_step(engine)
        finished.update((r.request_id, r) for r in result.outputs if r.finished)
        steps += 1
    return finished, aborted


def assert_each_equals_naive(finished: dict, requests: dict, naive: Engine) -> None:
    """Every finished request's tokens equal the naive engine's on its prompt alone."""
    for rid, request in finished.items():
        prompt, params = requests[rid]
        ref = naive.generate([prompt], params).token_ids[0]
        assert request.output_ids == ref, f"request {rid}: " + first_difference(
            request.output_ids, ref)
