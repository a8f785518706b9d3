"""Model loader: cache reused, no hub, unknown names fail clearly."""

from __future__ import annotations

import os

import pytest
import torch

from miniinfer import MODELS, UnknownNameError, load_model
from miniinfer.core.models import smollm2_cache


def test_hub_is_off():
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_unknown_model_lists_names():
    with pytest.raises(UnknownNameError, match="available models: smollm2-135m, qwen2.5-7b, tiny"):
        load_model("gpt-5")


def test_unknown_dtype_and_device():
    with pytest.raises(UnknownNameError, match="unknown dtype"):
        load_model("tiny", dtype="float7")
    with pytest.raises(UnknownNameError, match="device"):
        load_model("tiny", device="tpu")


def test_smollm2_cache_is_reused(smollm2):
    cache = smollm2_cache()
    weights = cache / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = load_model("smollm2-135m")
    assert weights.stat().st_mtime_ns == mtime  # read, not converted from the GGUF again
    for a, b in zip(smollm2.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_smollm2_is_the_real_model(smollm2):
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.vocab_size == 49152 and smollm2.dtype == torch.float32
    assert 130e6 < sum(p.numel() for p in smollm2.model.parameters()) < 140e6
    assert smollm2.tokenizer.decode([smollm2.eos_token_id]) == "<|im_end|>"


def test_random_models_are_seeded():
    a, b = load_model("tiny"), load_model("tiny")
    assert torch.equal(a.model.model.embed_tokens.weight, b.model.model.embed_tokens.weight)
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-7b", "tiny"}


def test_a_cache_carried_without_weights_serves_the_random_models(tmp_path, monkeypatch):
    """A GPU machine without the GGUF gets the tokenizer files alone: the random-weight models
    load from them, and nothing tries to convert (the GGUF lookup would fail)."""
    carried = tmp_path / "smollm2-135m"
    carried.mkdir()
    source = smollm2_cache(weights=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (carried / name).write_bytes((source / name).read_bytes())
    monkeypatch.setenv("MINIINFER_CACHE", str(tmp_path))

    def no_gguf():
        raise AssertionError("the carried cache was not used")

    monkeypatch.setattr("miniinfer.core.models.smollm2_gguf", no_gguf)
    lm = load_model("tiny")
    assert lm.tokenizer.decode(lm.tokenizer("a carried tokenizer")["input_ids"]) \
        == "a carried tokenizer"
    assert not (carried / "model.safetensors").exists()
    with pytest.raises(AssertionError, match="not used"):
        smollm2_cache()  # the weights are still asked for where the real model needs them
