"""The notebooks' helpers for recorded results."""

from __future__ import annotations

import gzip
import json
import re

import pandas as pd
import torch

from miniinfer import ENGINES
from miniinfer.bench.profiling import load_trace
from miniinfer.book import (
    class_diff,
    package_map,
    pct_of_hf_spread_table,
    plot_stage_results,
    read_results,
    show_diff,
    speed_of_light_table,
    stage_results,
    stage_tree,
)
from miniinfer.book.chapters import CHAPTERS, chapter_of_stage
from miniinfer.book.overview import CHAPTERS_DIR, notebook_title
from miniinfer.engines import Engine


def test_commit_ids_stay_text(tmp_path):
    # "2638e60" is a valid float literal; read naively it becomes 2.638e63.
    path = tmp_path / "run.csv"
    pd.DataFrame({"chapter": ["07"], "git_sha": ["2638e60"], "date": ["2026-11-23"],
                  "tok_s": [1.0]}).to_csv(path, index=False)
    row = read_results(path).iloc[0]
    assert (row.chapter, row.git_sha) == ("07", "2638e60")


def test_the_recorded_runs_name_every_commit_a_file_was_recorded_at(tmp_path, monkeypatch):
    # Chapter 11's Intel Xeon served tables: the target rows at one commit, the budget sweep
    # recorded again on its own at a later one.
    from miniinfer.book import results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    (tmp_path / "ch11").mkdir()
    pd.DataFrame({"experiment": ["target", "target", "budget"], "device_name": "cpu",
                  "git_sha": ["1d1c717", "1d1c717", "bbd5eaa"],
                  "date": ["2026-11-28T18:14:16Z", "2026-11-28T18:14:16Z",
                           "2026-11-28T20:52:13Z"]}).to_csv(tmp_path / "ch11" / "x-runs.csv",
                                                           index=False)
    (row,) = results.recorded_runs().itertuples()
    assert (row.chapter, row.file, row.device_name) == ("11", "ch11/x-runs.csv", "cpu")
    assert row.git_sha == "1d1c717, bbd5eaa"
    assert row.date == "2026-11-28T18:14:16Z, 2026-11-28T20:52:13Z"
    assert row.isa == ""  # a column the file lacks


def test_speed_of_light_shares_rescale_to_one_bandwidth(monkeypatch):
    # Two runs of one device measured 10 and 30 GB/s: the median (20) becomes the reference, so
    # a 30% share measured against 10 GB/s is 15% against 20.
    runs = {
        "01": pd.DataFrame({"device_name": ["cpu"] * 2, "model": "m", "dtype": "float32",
                            "engine": ["hf", "naive"], "batch_size": 1,
                            "pct_of_floor": [30.0, 30.0], "bandwidth_gbs": [10.0, 10.0]}),
        "02": pd.DataFrame({"device_name": ["cpu"], "model": "m", "dtype": "float32",
                            "engine": ["paged-loop"], "batch_size": 1, "pct_of_floor": [10.0],
                            "bandwidth_gbs": [30.0]}),
    }
    monkeypatch.setattr("miniinfer.book.results.recorded_results",
                        lambda chapter: runs.get(chapter, pd.DataFrame()))
    table = speed_of_light_table(("01", "02")).iloc[0]
    assert table["hf"] == 15.0 and table["naive"] == 15.0 and table["paged-loop"] == 15.0


def test_speed_of_light_takes_the_bandwidth_of_the_host_with_the_rows_instruction_set(
        monkeypatch):
    # One name, two hosts: a Zen 4 (AVX512, 40 GB/s) and a Zen 3 (AVX2, 10 GB/s). Each run's
    # share, measured against 20 GB/s, is rescaled to its own host's bandwidth, not the name's.
    # (Read back, the rows name each host with its instruction set: read_results.)
    runs = {"01": pd.DataFrame({"device_name": ["AMD EPYC (AVX512)", "AMD EPYC (AVX2)"],
                                "isa": ["AVX512", "AVX2"],
                                "model": "m", "dtype": "float32", "engine": "hf",
                                "batch_size": [1, 8], "pct_of_floor": [30.0, 30.0],
                                "bandwidth_gbs": [20.0, 20.0]})}
    devices = pd.DataFrame({"name": ["AMD EPYC"] * 2, "isa": ["AVX512", "AVX2"],
                            "bandwidth_gbs": [40.0, 10.0]})
    monkeypatch.setattr("miniinfer.book.results.recorded_results",
                        lambda chapter: runs.get(chapter, pd.DataFrame()))
    monkeypatch.setattr("miniinfer.book.results.device_table", lambda: devices)
    table = speed_of_light_table(("01",))["hf"]
    assert list(table) == [15.0, 60.0]  # batch 1 (AVX512), batch 8 (AVX2)


def test_a_host_of_the_same_name_with_another_instruction_set_records_its_own_file(
        tiny, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from miniinfer.bench import devices
    from miniinfer.book import results
    from miniinfer.core import hardware

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(devices, "YOURS_DIR", tmp_path)  # this reader's recordings, read live
    (tmp_path / "ch06").mkdir()
    isa = devices.device_isa(tiny.device)
    slug = devices.device_slug(tiny.device)
    assert slug.startswith("cpu-") and slug.endswith("-" + isa.lower())
    # The same CPU name with another instruction set: another file, so neither overwrites the
    # other, and this device does not take the other's rows as its own.
    with monkeypatch.context() as patched:
        patched.setattr(hardware, "device_isa", lambda device: "OTHER")
        other = tmp_path / "ch06" / f"{devices.device_slug(tiny.device)}.csv"
    assert other.name != f"{slug}.csv" and other.name.endswith("-other.csv")
    live = pd.DataFrame({"engine": ["hf"], "tok_s": [1.0]})
    monkeypatch.setattr("miniinfer.bench.offline.run_bench", lambda lm, config, engines: live)
    full = SimpleNamespace(name="full", bench=SimpleNamespace(chapter="06"))
    row = {"model": tiny.name, "device": "cpu", "device_name": "AMD EPYC", "engine": "hf"}
    pd.DataFrame([{**row, "isa": "OTHER", "tok_s": 3.0}]).to_csv(other, index=False)
    df, source = results.this_device_or_live(tiny, full)
    assert df is live and source == "measured live in this notebook"
    path = tmp_path / "ch06" / f"{slug}.csv"
    pd.DataFrame([{**row, "isa": isa, "tok_s": 2.0}]).to_csv(path, index=False)
    df, source = results.this_device_or_live(tiny, full)
    assert df.tok_s.iloc[0] == 2.0 and source.startswith("recorded by your make chapter-06 on")
    assert f"AMD EPYC ({isa})" in source
    # Read back, the two hosts' rows are two machines to every table that groups by name.
    both = results.recorded_results("06", every_device=True)
    assert sorted(both.device_name) == sorted([f"AMD EPYC ({isa})", "AMD EPYC (OTHER)"])
    # Chapter 05's benchmark is <device>-bench.csv: found by its suffix, and only on this host.
    path.rename(path.with_name(path.stem + "-bench.csv"))
    assert results.this_device_or_live(tiny, full)[0] is live
    df, source = results.this_device_or_live(tiny, full, suffix="-bench")
    assert source.endswith("-bench.csv)") and df.tok_s.iloc[0] == 2.0


def test_a_live_table_names_its_host_as_the_recorded_tables_do(tiny, monkeypatch):
    """A notebook's live cells print the device by the name the recorded tables read back
    (a CPU with its instruction set), so a live row on a Zen 3 is not taken for the recorded
    Zen 4's; a GPU is named as it is."""
    from miniinfer.bench import devices
    from miniinfer.book.results import with_isa

    isa = devices.device_isa(tiny.device)
    label = devices.device_label(tiny.device)
    assert label == f"{devices.device_name(tiny.device)} ({isa})"
    assert with_isa(pd.Series(["AMD EPYC"]), pd.Series([isa])).tolist() == [f"AMD EPYC ({isa})"]
    speed = devices.DeviceSpeed("cpu-amd-epyc-avx2", "AMD EPYC", 29.4, 166.0, 2, "t", "d", "AVX2")
    assert speed.label == "AMD EPYC (AVX2)"
    gpu = devices.DeviceSpeed("cuda-nvidia-h200", "NVIDIA H200", 4000.0, 9e5, 1, "t", "d", "sm_90")
    assert gpu.label == "NVIDIA H200"
    monkeypatch.setattr(devices, "device_name", lambda device: "NVIDIA H200")
    assert devices.device_label(torch.device("cuda")) == "NVIDIA H200"


def test_spread_table_shows_each_engines_range_but_not_hfs():
    rows = [("hf", 100.0, 100.0, 100.0), ("paged-attention", 98.4, 91.6, 106.2)]
    df = pd.DataFrame([{"device_name": "cpu", "model": "m", "dtype": "float32", "batch_size": 8,
                        "engine": e, "pct_of_hf": p, "pct_of_hf_min": lo, "pct_of_hf_max": hi}
                       for e, p, lo, hi in rows])
    cells = pct_of_hf_spread_table(df).iloc[0]
    assert cells["hf"] == "100%"
    assert cells["paged-attention"] == "98% [92-106]"
    # Runs recorded before the range was kept show the median alone.
    old = pct_of_hf_spread_table(df.drop(columns=["pct_of_hf_min", "pct_of_hf_max"])).iloc[0]
    assert old["paged-attention"] == "98%"


def test_results_markdown_shows_tok_s_alone_for_a_run_without_hf(tmp_path, monkeypatch):
    from miniinfer.book import results

    meta = {"device_name": "cpu", "model": "m", "dtype": "float32", "prompt_len": 64,
            "new_tokens": 64, "repeats": 3, "torch": "t", "transformers": "x", "git_sha": "g"}
    (tmp_path / "ch06").mkdir()
    (tmp_path / "ch11").mkdir()
    pd.DataFrame([{**meta, "engine": e, "batch_size": 1, "tok_s": t, "pct_of_hf": p}
                  for e, t, p in (("hf", 10.0, 100.0), ("x", 12.0, 120.0))]
                 ).to_csv(tmp_path / "ch06" / "cpu.csv", index=False)
    pd.DataFrame([{**meta, "engine": e, "batch_size": 1, "tok_s": t, "pct_of_hf": None}
                  for e, t in (("a", 20.0), ("b", 30.0))]
                 ).to_csv(tmp_path / "ch11" / "cpu-ablation.csv", index=False)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    text = results.results_markdown()
    assert "| 1 | 10.0 (100%) | 12.0 (120%) |" in text
    assert "tok/s (no hf in this run):" in text and "| 1 | 20.0 | 30.0 |" in text
    assert "nan" not in text


def test_spread_table_has_a_row_per_recorded_device_model_and_batch_only():
    """Two devices with their own models: no row for a model a device never ran (pivoting with
    dropna=False would build the whole device x model x dtype x batch product)."""
    rows = [("cpu", "small", "float32", "hf", 100.0), ("cpu", "small", "float32", "x", 90.0),
            ("gpu", "big", "bfloat16", "hf", 100.0)]
    df = pd.DataFrame([{"device_name": d, "model": m, "dtype": t, "batch_size": 1, "engine": e,
                        "pct_of_hf": p} for d, m, t, e, p in rows])
    table = pct_of_hf_spread_table(df)
    assert list(table.index) == [("cpu", "small", "float32", 1), ("gpu", "big", "bfloat16", 1)]
    assert pd.isna(table.loc[("gpu", "big", "bfloat16", 1), "x"])  # the column stays, empty


# -- show_diff and the overview (chapter 00) ---------------------------------------------------


class _Parent:
    name = "t-parent"
    chapter = "98"

    def step(self, x):
        return x + 1

    def keep(self):
        return "kept"


class _Child(_Parent):
    name = "t-child"
    chapter = "99"
    summary = "not a method"

    def step(self, x):
        return x + 2

    def extra(self, a, b):
        return a < b


class _Grandchild(_Child):
    name = "t-grandchild"
    chapter = "99"

    def keep(self):
        return "changed"


def test_class_diff_shows_overrides_against_the_inherited_source_and_new_methods():
    diff = class_diff(_Child)
    changes = {c.name: c for c in diff.changes}
    assert set(changes) == {"step", "extra"}  # keep is inherited untouched; summary is data
    assert changes["step"].kind == "overrides" and changes["step"].inherited_from == "_Parent"
    assert "-    return x + 1" in changes["step"].diff
    assert "+    return x + 2" in changes["step"].diff
    assert " def step(self, x):" in changes["step"].diff  # unchanged lines kept as context
    assert changes["extra"].kind == "adds" and changes["extra"].inherited_from is None
    assert all(line.startswith(("+", "@")) for line in changes["extra"].diff.splitlines()[2:])
    assert "subclasses `t-parent`" in diff.header()
    # The notebook view escapes source text: `a < b` must not open an HTML tag.
    assert "a &lt; b" in diff._repr_html_() and "a < b" not in diff._repr_html_()


def test_class_diff_finds_the_inherited_version_further_up():
    change = class_diff(_Grandchild).changes[0]
    assert (change.name, change.kind, change.inherited_from) == ("keep", "overrides", "_Parent")
    assert '-    return "kept"' in change.diff and '+    return "changed"' in change.diff


def test_every_stage_has_a_diff_and_continuous_holds_a_runner():
    for name, cls in ENGINES.items():
        diff = show_diff(name)
        assert diff.cls is cls and (diff.changes or diff.settings), name
    # A serving stage is a preset of the engine's config: its diff names what it sets.
    assert show_diff("compiled").settings == (("forward", "compiled"),)
    assert "It sets weights='int4' in the engine's config." in show_diff("quantized").header()
    # Chapter 08's engine holds a model runner (chapter 06's forward) instead of inheriting a
    # static-batch stage; prefix caching builds on it.
    assert show_diff("continuous").parent is Engine
    assert show_diff("prefix-cache").parent is ENGINES["continuous"]
    assert show_diff("async:overlap").cls is ENGINES["async"]


def test_stage_tree_nests_every_stage_under_its_parent_class():
    lines = stage_tree().splitlines()
    labels = {}
    for i, line in enumerate(lines):
        depth = len(line) - len(line.lstrip("│├└─ "))
        labels[i] = (depth, line[depth:].split(":")[0].split(" ")[0])
    assert sorted(name for _, name in labels.values()) == sorted(["Engine", *ENGINES])
    for i, (depth, name) in labels.items():
        if name == "Engine":
            continue
        parent = next(n for j in range(i - 1, -1, -1)
                      for d, n in [labels[j]] if d < depth)
        assert parent == getattr(ENGINES[name].__mro__[1], "name", "Engine"), name


def test_chapter_table_is_the_registry_with_each_stages_module_and_summary():
    from miniinfer.book import chapter_table

    table = chapter_table().set_index("chapter")
    assert list(table.index) == list(CHAPTERS)
    for number, chapter in CHAPTERS.items():
        row = table.loc[number]
        assert (row.title, row.notebook) == (chapter.title, chapter.notebook)
        for stage in chapter.stages:
            assert ENGINES[stage].__module__ in row.modules
            assert f"`{stage}`: {ENGINES[stage].summary}" in row.idea
    assert table.loc["05"].idea == CHAPTERS["05"].idea  # no stage: the registry's sentence


def _bench_rows(device, chapter, engines_pct, bandwidth=10.0):
    return pd.DataFrame([{"device_name": device, "model": "m", "dtype": "float32",
                          "chapter": chapter, "engine": e, "batch_size": 8, "pct_of_hf": p,
                          "pct_of_floor": p / 4, "bandwidth_gbs": bandwidth}
                         for e, p in engines_pct.items()])


def test_stage_results_take_each_stage_from_the_chapter_that_adds_it(monkeypatch):
    runs = {
        "02": pd.concat([_bench_rows("cpu", "02", {"hf": 100.0, "paged-loop": 50.0}),
                         _bench_rows("H100", "02", {"hf": 100.0, "paged-loop": 40.0})]),
        "03": _bench_rows("cpu", "03", {"hf": 100.0, "paged-vectorized": 90.0,
                                        "paged-loop": 60.0}),
    }
    monkeypatch.setattr("miniinfer.book.results.recorded_results",
                        lambda chapter: runs.get(chapter, pd.DataFrame()))
    df = stage_results(("02", "03"))
    cpu = df[df.device_name == "cpu"].set_index("engine")
    assert list(cpu.index) == ["hf", "paged-loop", "paged-vectorized"]  # book order, hf first
    assert cpu.loc["paged-loop", "pct_of_hf"] == 50.0  # chapter 02's run, as chapter 02 shows it
    assert cpu.loc["paged-vectorized", "pct_of_hf"] == 90.0
    assert set(df[df.device_name == "H100"].engine) == {"hf", "paged-loop"}
    fig = plot_stage_results(df)
    assert len(fig.axes) == 4  # two panels per recorded device


def test_package_map_assigns_each_stage_module_to_its_chapter():
    modules = package_map().set_index("module")
    assert all(chapter_of_stage(name) is not None for name in ENGINES)
    for cls in ENGINES.values():
        assert modules.loc[cls.__module__, "chapter"] == (chapter_of_stage(cls.name) or "-")
    assert modules.loc["miniinfer.core.kernels.reference", "chapter"] == "06"  # a package's children
    # A later chapter's module inside an earlier chapter's package is the later chapter's.
    assert modules.loc["miniinfer.core.kernels.cpu_decode", "chapter"] == "11"
    assert modules.loc["miniinfer.runner.compiled_attention", "chapter"] == "11"
    assert modules.loc["miniinfer.runner.tensor_parallel_costs", "chapter"] == "12"
    assert modules.loc["miniinfer.runner.direct", "chapter"] == "06"


def test_every_registered_chapter_has_its_notebook_under_its_title():
    assert "00" in CHAPTERS and CHAPTERS["00"].engines == ()
    for chapter in CHAPTERS.values():
        path = CHAPTERS_DIR / chapter.notebook
        assert path.exists(), chapter.notebook
        assert notebook_title(path) == chapter.title, chapter.notebook
    assert sorted(p.name for p in CHAPTERS_DIR.glob("[0-9][0-9]_*.ipynb")) == \
        sorted(ch.notebook for ch in CHAPTERS.values())


def test_load_trace_reads_a_gzipped_chrome_trace(tmp_path):
    events = [{"ph": "X", "name": "decode_step", "cat": "user_annotation", "ts": 0, "dur": 10,
               "tid": 1, "pid": 1},
              {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 2, "dur": 3, "tid": 1,
               "pid": 1},
              {"ph": "M", "name": "process_name", "ts": 0, "pid": 1, "tid": 0}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = load_trace(path, warmup_steps=0)
    assert list(trace.events.name) == ["decode_step", "aten::mm"]  # metadata events dropped
    assert trace.sql("SELECT sum(dur) AS d FROM events").d.iloc[0] == 13


def test_every_chapter_has_exercises_and_each_stage_chapter_shows_its_diff():
    for chapter in CHAPTERS.values():
        cells = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]
        text = ["".join(c["source"]) for c in cells]
        assert any(t.startswith("## Exercises") for t in text), chapter.notebook
        if chapter.number >= "02" and chapter.stages:
            assert any(f'show_diff("{s}")' in t for s in chapter.stages for t in text), \
                chapter.notebook


# -- how a chapter opens: what you will learn, and a link to its lab notes --------------------


def test_every_notebook_opens_with_what_you_will_learn():
    # Static prose, never generated from whichever CSVs are on disk: a reader's own recording
    # cannot change it (tests/test_reader_recordings.py).
    for number, chapter in CHAPTERS.items():
        first = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"][0]
        text = "".join(first["source"])
        assert text.startswith(f"# Chapter {number} — "), chapter.notebook
        assert "**What you will learn**" in text and text.count("\n* ") >= 3, chapter.notebook
        if number != "00":
            notes = f"data/results/ch{number}/NOTES.md"
            assert notes in text and (CHAPTERS_DIR.parent / notes).exists(), chapter.notebook


def test_every_notebook_that_quotes_a_reference_post_cites_it():
    from miniinfer.book.references import POSTS

    by_word = {"mini-infer": ["mini-infer"], "roseinfer": ["roseinfer-perf", "roseinfer-paged"],
               "wde": ["wde"]}
    for chapter in CHAPTERS.values():
        cells = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells)
        for word, keys in by_word.items():
            if word in text:
                assert any(POSTS[k].title in text for k in keys), \
                    f"{chapter.notebook} quotes the {word} post without citing it"
    assert "https://github.com/noooop/wde" in (CHAPTERS_DIR / CHAPTERS["08"].notebook).read_text()


def test_chapter_00_has_the_glossary():
    cells = json.loads((CHAPTERS_DIR / CHAPTERS["00"].notebook).read_text())["cells"]
    glossary = next("".join(c["source"]) for c in cells
                    if "".join(c["source"]).startswith("## Glossary"))
    for term in ("TTFT", "TPOT", "ITL", "goodput", "block", "slot mapping", "roofline", "GQA"):
        assert f"**{term}**" in glossary, term


def test_every_recorded_table_names_its_machine_dtype_versions_and_commit():
    """Every figure traces to a device, a dtype, the software and the commit that measured it:
    each recorded CSV carries those columns (devices.csv, the speed-of-light table, is keyed by
    device and says its dtype in ``how_measured``; a repro log, named by its commit, times
    chapters and measures nothing)."""
    from miniinfer.book.results import RESULTS
    from miniinfer.lab.repro import REPRO_LOGS

    needed = {"device", "device_name", "dtype", "torch", "git_sha", "date"}
    files = [p for p in sorted(RESULTS.rglob("*.csv"))
             if p.name != "devices.csv" and p.parent != REPRO_LOGS]
    assert files
    missing = {str(p.relative_to(RESULTS)): sorted(needed - set(pd.read_csv(p, nrows=0).columns))
               for p in files}
    assert not {name: cols for name, cols in missing.items() if cols}


# -- a chapter teaches: short prose, no lab notes --------------------------------------------
MAX_WORDS = 2500
# A commit named in prose ("git 4b9aa69", "since 8e8f58b", "commit 1d1c717") is lab notes.
COMMIT = re.compile(r"\b(?:git|commit|since|until|at)\s+`?[0-9a-f]{7,40}\b")


def test_every_chapter_is_at_most_2500_words_of_prose_and_names_no_commit():
    for chapter in CHAPTERS.values():
        cells = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]
        prose = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        words = sum(len(text.split()) for text in prose)
        assert words <= MAX_WORDS, f"{chapter.notebook}: {words} words of markdown"
        found = [m.group(0) for text in prose for m in COMMIT.finditer(text)]
        assert not found, f"{chapter.notebook} names commits in its prose: {found}"


# An assert whose message or comment points at the prose, or a map of the verdicts the prose gives.
PROSE_CHECK = re.compile(r"\b(?:the text|the prose|the introduction|says?|said)\b|said = \{")
MAX_TEACHING_ASSERTS = 3
PRINTED_COMMIT = re.compile(r"git \{|\.git_sha\b|\[\"git_sha\"\]")


def test_teaching_cells_hold_few_asserts_none_checking_the_prose_nor_printing_a_commit():
    """A check a reader learns from (the tokens equal hf's, every block is free again) may stay;
    the facts the prose states are checked by tests (test_chapter_facts.py), and the commit a
    table was recorded at is the lab notes' business."""
    for chapter in CHAPTERS.values():
        cells = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        asserts = [line.strip() for text in code for line in text.splitlines()
                   if line.lstrip().startswith("assert ")]
        assert len(asserts) <= MAX_TEACHING_ASSERTS, f"{chapter.notebook}: {asserts}"
        quoting = [line for line in asserts if PROSE_CHECK.search(line)]
        quoting += [line for text in code for line in text.splitlines() if "said = {" in line]
        assert not quoting, f"{chapter.notebook} checks its prose in a teaching cell: {quoting}"
        assert not any(PRINTED_COMMIT.search(text) for text in code), \
            f"{chapter.notebook} shows the commit a table was recorded at"


def test_every_chapter_ends_with_links_to_its_neighbours_and_the_map():
    from miniinfer.book.chapters import chapter_nav

    for number, chapter in CHAPTERS.items():
        cells = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]
        last = "".join([c for c in cells if c["cell_type"] == "markdown"][-1]["source"])
        assert last.rstrip().endswith(chapter_nav(number)), f"{chapter.notebook}: {last[-200:]}"


def test_the_commit_pattern_finds_what_lab_notes_write():
    assert COMMIT.search("recorded at git 4b9aa69 on the Zen 3")
    assert COMMIT.search("the sweep measures every length first (since `8e8f58b`)")
    assert not COMMIT.search("doi.org/10.1145/1498765.1498785")


def test_every_chapter_has_a_drawn_concept_figure_and_solutions_to_its_exercises():
    # A concept figure is drawn (a cell tagged concept-figure with an image), not a result plot;
    # every exercise has its solution, collapsed (a cell tagged solution after the exercises).
    for chapter in CHAPTERS.values():
        cells = json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]
        tagged = {tag: [c for c in cells if tag in c.get("metadata", {}).get("tags", [])]
                  for tag in ("concept-figure", "solution")}
        figures = [c for c in tagged["concept-figure"] if c["cell_type"] == "code" and any(
            "image/png" in o.get("data", {}) for o in c.get("outputs", []))]
        assert figures, f"{chapter.notebook}: no drawn concept figure (a cell tagged concept-figure)"
        exercises = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                         and "".join(c["source"]).lstrip().startswith("## Exercises"))
        solutions = [c for c in tagged["solution"] if cells.index(c) > exercises]
        assert solutions, f"{chapter.notebook}: its exercises have no solutions"
        asked = len(re.findall(r"^\d+\. ", "".join(cells[exercises]["source"]), re.M))
        answered = sum(len(re.findall(r"^\d+\. ", "".join(c["source"]), re.M)) for c in solutions
                       if c["cell_type"] == "markdown")
        assert answered >= asked, f"{chapter.notebook}: {asked} exercises, {answered} solutions"


def test_no_rendered_text_says_nan():
    # A generated sentence from an empty table once printed "between nan% and nan% of hf".
    for chapter in CHAPTERS.values():
        for cell in json.loads((CHAPTERS_DIR / chapter.notebook).read_text())["cells"]:
            texts = ["".join(cell["source"])] if cell["cell_type"] == "markdown" else [
                "".join(o.get("text", "")) for o in cell.get("outputs", [])]
            for text in texts:
                assert not re.search(r"\bnan ?%", text, re.I), (chapter.notebook, text[:200])


TEST_RUN_MARKS = ("preset=small", "busy machine", "not representative", "-dirty")


def stored_outputs(path) -> str:
    """Every output a notebook was stored with: streams, plain text and HTML."""
    texts = []
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")))
            for kind in ("text/plain", "text/html"):
                texts.append("".join(out.get("data", {}).get(kind, "")))
    return "\n".join(texts)


def test_stored_outputs_are_the_reference_sitting_not_a_test_run():
    """The stored notebooks are the book: executed once with the full preset on a quiet machine
    (`repro all --for-book`), never a test run's outputs."""
    for chapter in CHAPTERS.values():
        text = stored_outputs(CHAPTERS_DIR / chapter.notebook)
        marks = [m for m in TEST_RUN_MARKS if m in text]
        assert not marks, f"{chapter.notebook}'s stored outputs say {marks}"


def test_the_stored_output_check_finds_a_test_runs_marks(tmp_path):
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["preset=small  device=cpu\n"]}]}]}
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    assert "preset=small" in stored_outputs(tmp_path / "x.ipynb")
