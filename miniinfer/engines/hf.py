"""Stage ``hf``: Hugging Face ``model.generate``, the baseline every chapter is measured against."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from ..core.sampling import SamplingParams
from .base import Engine, GenerationResult, StepClock, left_pad, trim_at_eos


class _TokenClock(BaseStreamer):
    """generate() hands a streamer the prompt once, then each step's new tokens (already copied
    to the host, so the device is done): a free, HF-native place to stamp step times."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self.saw_prompt:
            self.clock.tick()
        self.saw_prompt = True

    def end(self) -> None:
        pass


class HFEngine(Engine):
    name = "hf"
    summary = "Hugging Face model.generate (the baseline)"

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        lm = self.lm
        input_ids, attention_mask = left_pad(prompts, lm.pad_token_id, self.device)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            # Without an EOS id generate never stops early and never suppresses EOS, which is
            # exactly "ignore EOS" as the other engines implement it.
            eos_token_id=None if params.ignore_eos else lm.eos_token_id,
            pad_token_id=lm.pad_token_id,
            **(
                {}
                if params.greedy
                else {"temperature": params.temperature, "top_k": params.top_k or None,
                      "top_p": params.top_p}
            ),
        )
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)
        clock = StepClock(self.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            streamer=_TokenClock(clock),
        )
        new_tokens = out[:, input_ids.shape[1] :].tolist()
        return clock.finish(trim_at_eos(new_tokens, None if params.ignore_eos else lm.eos_token_id))
