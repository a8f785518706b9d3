"""The correctness template every engine stage reuses: greedy tokens equal HF generate's, token for
token, on the real SmolLM2 (fp32, CPU), for the whole mixed-length batch and each prompt alone."""

from __future__ import annotations

from conftest import NEW_TOKENS

from miniinfer import SamplingParams
from miniinfer.engines import Engine


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
    for i, (prompt, ref) in enumerate(zip(prompts, hf_greedy["single"], strict=True)):
        ours = engine.generate([prompt], params).token_ids[0]
        assert ours == ref, f"{engine.name} alone, prompt {i} ({len(prompt)} tokens): " \
                            + first_difference(ours, ref)
