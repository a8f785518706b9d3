"""One engine, composed (issue 78): every optimisation is a setting of one config, any two
settings combine, and a combination that cannot run is refused when the config is made, naming
both settings. The pairwise set runs on the tiny model; each run's greedy tokens equal the
plain continuous engine's (quantized weights: their own eager engine's), and the state that
matters is asserted: what the runner was built with, drafts taken, prefixes cached, ranks up."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.core.config import EngineConfig
from miniinfer.engines import engine_config
from miniinfer.engines.speculative import SpeculativeEngine

# The settings the pairwise set covers, each with the values it takes.
SETTINGS = {
    "weights": ("dense", "int8", "int4"),
    "forward": ("direct", "compiled"),
    "tensor_parallel": (1, 2),
    "prefix_caching": (False, True),
    "speculative": (None, "ngram"),
}
# Prompts that repeat themselves, so that prompt lookup drafts, and share a prefix, so that
# the prefix cache hits.
SHARED = [7, 8, 9, 10, 11, 12, 13, 14] * 3
PROMPTS = [SHARED + [5, 6, 7, 8, 9, 5, 6, 7], SHARED + [40, 41, 42, 40, 41]]
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _constructible(combination: dict) -> bool:
    try:
        EngineConfig(**combination)
    except InvalidRequestError:
        return False
    return True


def _pairs(combination: dict) -> set:
    return {((a, combination[a]), (b, combination[b]))
            for a, b in itertools.combinations(SETTINGS, 2)}


ALLOWED = [c for c in (dict(zip(SETTINGS, values, strict=True))
                       for values in itertools.product(*SETTINGS.values()))
           if _constructible(c)]


def pairwise_set() -> list[dict]:
    """A small set of allowed combinations in which every pair of values that some allowed
    combination holds occurs at least once (greedy: the combination covering the most
    uncovered pairs first)."""
    uncovered = set().union(*(_pairs(c) for c in ALLOWED))
    chosen = []
    while uncovered:
        best = max(ALLOWED, key=lambda c: len(_pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


CASES = pairwise_set()


def test_the_pairwise_set_covers_every_allowed_pair_and_only_those():
    every_pair = {((a, va), (b, vb)) for a, b in itertools.combinations(SETTINGS, 2)
                  for va in SETTINGS[a] for vb in SETTINGS[b]}
    runs = set().union(*(_pairs(c) for c in CASES))
    refused = every_pair - set().union(*(_pairs(c) for c in ALLOWED))
    assert runs == every_pair - refused
    assert (("forward", "compiled"), ("tensor_parallel", 2)) in refused
    assert (("weights", "int4"), ("tensor_parallel", 2)) in refused
    assert len(CASES) < len(ALLOWED) / 2, "pairwise, not the whole product"


@pytest.mark.parametrize(("first", "second"), [
    ({"forward": "compiled"}, {"tensor_parallel": 2}),
    ({"weights": "int4"}, {"tensor_parallel": 2}),
    ({"weights": "int8"}, {"tensor_parallel": 3}),
    ({"weights": "int8"}, {"forward": "registry"}),
])
def test_a_refused_combination_fails_at_construction_naming_both_settings(tiny, first, second):
    (a, va), (b, vb) = *first.items(), *second.items()
    with pytest.raises(InvalidRequestError, match=rf"{a}={va!r}.*{b}={vb!r}"):
        EngineConfig(**first, **second)
    # Before anything is built, by name, through a stage's preset: compiled + tensor parallel.
    with pytest.raises(InvalidRequestError, match=rf"{a}={va!r}.*{b}={vb!r}"):
        make_engine("continuous", tiny, **first, **second)


def test_a_stage_is_a_preset_and_any_setting_goes_on_top():
    assert engine_config("compiled").forward == "compiled"
    assert engine_config("quantized:int8-eager") == EngineConfig(weights="int8", forward="direct")
    assert engine_config("speculative:fixed", forward="compiled") == EngineConfig(
        forward="compiled", prefix_caching=True, speculative="ngram", draft_policy="fixed")
    with pytest.raises(InvalidRequestError, match=r"forward='compiled' and tensor_parallel=2"):
        engine_config("compiled", tensor_parallel=2)
    with pytest.raises(InvalidRequestError, match=r"forward='compiled' and tensor_parallel=2"):
        engine_config("tensor-parallel", forward="compiled")


def _reference(tiny, weights: str) -> list[list[int]]:
    engine = make_engine("continuous", tiny, weights=weights, forward="direct")
    return engine.generate(PROMPTS, PARAMS).token_ids


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_pair_of_settings_gives_the_reference_tokens(tiny, case):
    from miniinfer.runner.compiled import CompileOptions

    # Few buckets and no autotuning: what is checked here is what composes, not the kernels
    # the autotuner picks (chapter 11's and 13's own tests compile as the engines do).
    fast = {"compile_options": CompileOptions(token_buckets=(4, 16, 64), max_autotune=False)} \
        if case["forward"] == "compiled" else {}
    engine = make_engine("continuous", tiny, warm_up=False, max_num_batched_tokens=64, **fast,
                         **case)
    try:
        runner = engine.runner
        assert engine.config == EngineConfig(warm_up=False, max_num_batched_tokens=64, **fast,
                                             **case)
        # Built as asked, not patched, not silently on one rank.
        assert runner.weights == case["weights"] and runner.tensor_parallel == \
            case["tensor_parallel"]
        assert runner.forward_name.startswith(case["forward"])
        if case["tensor_parallel"] > 1:
            assert len(runner.forward.pids) == case["tensor_parallel"] - 1
        got = engine.generate(PROMPTS, PARAMS).token_ids
        assert got == _reference(tiny, case["weights"])
        manager = engine.kv_cache.block_manager
        assert manager.block_tables == {}, "every block given back"
        if case["prefix_caching"]:
            assert manager.num_cached_blocks > 0, "the shared prefix stays cached"
        if case["speculative"]:
            assert isinstance(engine, SpeculativeEngine)
            assert engine.stats.accepted > 0 and engine.stats.drafted >= engine.stats.accepted
        else:
            assert not isinstance(engine, SpeculativeEngine)
    finally:
        engine.close()


def test_the_cli_refuses_compiled_with_tensor_parallel_before_loading_the_model():
    done = subprocess.run(
        [sys.executable, "-m", "miniinfer", "serve", "--engine", "compiled",
         "--tensor-parallel", "2", "--model", "tiny"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "forward='compiled' and tensor_parallel=2" in lines[0], \
        done.stderr


def test_every_engine_setting_is_a_flag_and_reaches_the_engine(monkeypatch):
    from miniinfer import engines
    from miniinfer.cli import build_parser, main
    from miniinfer.core.config import SETTING_HELP

    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for name in SETTING_HELP:
        assert "--" + name.replace("_", "-") in help_text, name
    built = []

    class Stop(Exception):
        pass

    def fake_make_engine(name, lm, **options):
        built.append((name, options))
        raise Stop

    monkeypatch.setattr(engines, "make_engine", fake_make_engine)
    with pytest.raises(Stop):
        main(["generate", "--model", "tiny", "--engine", "continuous", "--weights", "int8",
              "--prefix-caching", "--speculative", "ngram", "--prompt", "Hello"])
    assert built == [("continuous", {"weights": "int8", "prefix_caching": True,
                                     "speculative": "ngram"})]


def test_metrics_report_what_runs(tiny):
    from prometheus_client import generate_latest

    from miniinfer.server.metrics import ServerMetrics

    engine = make_engine("prefix-cache", tiny, weights="int8", forward="direct",
                         speculative="ngram")
    text = generate_latest(ServerMetrics(engine, "tiny").registry).decode()
    line = next(t for t in text.splitlines() if t.startswith("miniinfer:engine_config_info{"))
    for setting in ('weights="int8"', 'forward="direct"', 'prefix_caching="True"',
                    'speculative="ngram"', 'tensor_parallel="1"'):
        assert setting in line, (setting, line)
    assert "vllm:spec_decode_num_drafts_total" in text
