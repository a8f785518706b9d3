"""Stage ``naive``: the decode loop written out by hand.

Prefill the left-padded batch once, then one forward per step that feeds only the newest token
and reuses the KV cache (``past_key_values``) the model filled so far. This is what
``model.generate`` does underneath, without its generality; chapters 02-08 replace its parts.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..core.sampling import SamplingParams, make_generator, sample
from .base import Engine, GenerationResult, StepClock, left_pad, trim_at_eos


class NaiveEngine(Engine):
    name = "naive"
    summary = "hand-written decode loop on HF's DynamicCache"

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        lm = self.lm
        generator = make_generator(params, self.device)
        input_ids, attention_mask = left_pad(prompts, lm.pad_token_id, self.device)
        # Positions count real tokens only, so a left-padded prompt starts at position 0 (the
        # value at pad slots is irrelevant: they are masked out; 1 matches generate()).
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        cache = DynamicCache(config=self.model.config)
        clock = StepClock(self.device)

        tokens = input_ids  # prefill feeds the whole prompt, each decode step one token
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        generated: list[torch.Tensor] = []
        for step in range(params.max_new_tokens):
            logits = self.model(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position's logits are needed
            ).logits[:, -1, :]
            next_tokens, stop = self.pad_finished(sample(logits, params, generator), finished,
                                                  params)
            generated.append(next_tokens)
            clock.tick()
            if stop or step == params.max_new_tokens - 1:
                break
            tokens = next_tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], 1)
            position_ids = position_ids[:, -1:] + 1

        rows = torch.stack(generated, dim=1).tolist()
        return clock.finish(trim_at_eos(rows, None if params.ignore_eos else lm.eos_token_id))
