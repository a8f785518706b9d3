"""What the chapter notebooks share: the chapter registry, the run preset, the recorded results
of every device, the analysis and figures drawn from them, and each stage as a diff."""

from .analysis import SWEEP_PHASES, context_phase_table, context_sentences, host_split
from .chapters import CHAPTERS, Chapter, chapter_of_stage, chapters_markdown
from .diff import StageDiff, class_diff, show_diff
from .overview import CHAPTERS_DIR, chapter_table, package_map, stage_tree
from .plots import (
    plot_by_device,
    plot_context_sweep,
    plot_stage_results,
    plot_timelines,
    plot_what_it_buys,
)
from .presets import Preset, preset
from .results import (
    RESULTS,
    ablation_table,
    device_table,
    load_note,
    pct_of_hf_spread_table,
    read_results,
    recorded_context_sweeps,
    recorded_results,
    recorded_runs,
    results_markdown,
    speed_of_light_table,
    stage_results,
    this_device_or_live,
    tok_s_table,
)

__all__ = [
    "CHAPTERS", "CHAPTERS_DIR", "RESULTS", "SWEEP_PHASES", "Chapter", "Preset", "StageDiff",
    "ablation_table", "chapter_of_stage", "chapter_table", "chapters_markdown", "class_diff",
    "context_phase_table", "context_sentences", "device_table", "host_split", "load_note",
    "package_map", "pct_of_hf_spread_table", "plot_by_device", "plot_context_sweep",
    "plot_stage_results", "plot_timelines", "plot_what_it_buys", "preset", "read_results",
    "recorded_context_sweeps", "recorded_results", "recorded_runs", "results_markdown",
    "show_diff", "speed_of_light_table", "stage_results", "stage_tree", "this_device_or_live",
    "tok_s_table",
]
