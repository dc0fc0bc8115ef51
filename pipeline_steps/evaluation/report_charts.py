"""The run report's training curves: which metrics are drawn, and one PNG per curve (matplotlib's Agg canvas)."""

from __future__ import annotations

import re
from pathlib import Path

# (file name, metric key, title, y label); the order is the order on the page
CURVES = (
    ("reward.png", "critic/score/mean", "Reward (critic/score/mean)", "mean score"),
    ("entropy.png", "actor/entropy", "Policy entropy (actor/entropy)", "entropy"),
    ("response_length.png", "response_length/mean", "Response length (response_length/mean)", "tokens"),
    ("throughput.png", "perf/throughput", "Throughput (perf/throughput)", "tokens / s / GPU"),
)
# Plotted only when the metrics carry them (verl logs them on the cluster; the CPU trainer logs all but memory):
# (file name, metric key, title, y label, companion series drawn on the same axes)
OPTIONAL_CURVES = (
    ("grad_norm.png", "actor/grad_norm", "Gradient norm (actor/grad_norm)", "norm", ()),
    ("lr.png", "actor/lr", "Learning rate (actor/lr)", "rate", ()),
    ("mfu.png", "perf/mfu/actor", "Model FLOPs utilisation (perf/mfu/actor)", "fraction of peak", ()),
    (
        "memory.png",
        "perf/max_memory_allocated_gb",
        "Peak memory (perf/max_memory_allocated_gb)",
        "GB",
        ("perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb"),
    ),
    (
        "step_timing.png",
        "timing_s/step",
        "Step time (timing_s/step)",
        "seconds",
        ("timing_s/gen", "timing_s/update_actor", "timing_s/old_log_prob", "timing_s/save_checkpoint"),
    ),
)
TABLE_KEYS = [k for _, k, _, _ in CURVES] + ["timing_s/step"]
# verl's headline validation means, per data source: val-core/<source>/acc/mean@N (the naive reward manager adds acc),
# or .../reward/mean@N when a custom reward reports no acc; the std/best/maj companions stay in the table only
VAL_RE = re.compile(r"^val-core/(.+)/(?:acc|reward)/mean@\d+$")


def plot(path: Path, xs: list[int], ys: list[float], title: str, ylabel: str, extra: list | None = None) -> None:
    """One PNG line chart; ``extra`` adds (label, xs, ys, style) series (the validation reward)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label="train")
    for label, ex, ey, style in extra or []:
        ax.plot(ex, ey, style, markersize=6, label=label)
    if extra:
        ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})  # no version stamp: same input, same bytes
