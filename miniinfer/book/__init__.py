"""What the chapter notebooks share: the chapter registry, the run preset, the recorded results
of every device, the analysis and figures drawn from them, and each stage as a diff."""

from .analysis import (
    SWEEP_PHASES,
    hf_ratio_table,
    host_split,
)
from .chapters import CHAPTERS, Chapter, chapter_of_stage, chapters_markdown
from .diff import StageDiff, class_diff, show_diff
from .overview import CHAPTERS_DIR, chapter_table, package_map, stage_tree
from .plots import (
    book_style,
    plot_context_sweep,
    plot_phase_bars,
    plot_stage_results,
    plot_timelines,
    plot_what_it_buys,
    stage_color,
)
from .presets import Preset, preset
from .profiles import (
    attention_gather_ms,
    gap_table,
    host_share,
)
from .references import POSTS, cite
from .results import (
    RESULTS,
    ablation_table,
    device_table,
    pct_of_hf_spread_table,
    read_results,
    recorded_context_sweeps,
    recorded_results,
    recorded_runs,
    recorded_timelines,
    reference_files,
    results_markdown,
    speed_of_light_table,
    stage_results,
    this_device_or_live,
    your_recordings,
)
from .roofline import plot_roofline

__all__ = [
    "CHAPTERS", "CHAPTERS_DIR", "POSTS", "RESULTS", "reference_files", "SWEEP_PHASES", "Chapter", "Preset", "StageDiff",
    "ablation_table", "attention_gather_ms", "book_style", "chapter_of_stage", "chapter_table", "chapters_markdown", "cite",
    "class_diff", "device_table",
    "gap_table",
    "hf_ratio_table", "host_share", "host_split",
    "package_map", "pct_of_hf_spread_table", "plot_context_sweep",
    "plot_phase_bars", "plot_roofline", "plot_stage_results", "plot_timelines",
    "plot_what_it_buys", "preset", "read_results",
    "recorded_context_sweeps", "recorded_results", "recorded_runs", "recorded_timelines",
    "results_markdown",
    "show_diff", "speed_of_light_table", "stage_color", "stage_results",
    "stage_tree", "this_device_or_live", "your_recordings",
   
]
