"""The README's results-at-a-glance figure, drawn from the reference recordings."""

from __future__ import annotations

from .chapters import REFERENCE_DEVICES
from .plots import WIDTH, batch_colors, book_style, legend_outside
from .results import RESULTS, read_results, stage_results


def save_at_a_glance(path) -> str:
    """The README's figure: every stage's % of hf on the reference CPU and GPU (chapters
    01-07's static-batch stages, batch 1, 4 and 8)."""
    import matplotlib.pyplot as plt


    names = [read_results(f).device_name.iloc[0] for kind, slug in REFERENCE_DEVICES.items()
             for f in sorted((RESULTS / "ch01").glob(f"{slug}.csv"))]
    df = stage_results()
    df = df[df.device_name.isin(names)]
    with book_style():
        fig, axes = plt.subplots(len(names), 1, figsize=(WIDTH, 3.6 * len(names)), squeeze=False)
        for ax, name in zip(axes[:, 0], names, strict=True):
            dev = df[df.device_name == name]
            colors = batch_colors(dev.batch_size.unique())
            table = dev.pivot_table(index="engine", columns="batch_size", values="pct_of_hf",
                                    sort=False).reindex(list(dict.fromkeys(dev.engine)))
            table.plot.bar(ax=ax, rot=20, width=0.8, color=[colors[b] for b in table.columns])
            ax.axhline(100, color="k", lw=0.8, ls="--")
            ax.set(title=f"{name}, {dev.model.iloc[0]} {dev.dtype.iloc[0]}: % of hf's tok/s",
                   xlabel="", ylabel="%", ylim=(0, None))
            legend_outside(ax, title="batch")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
