"""The figure ``zeroinf train`` writes as ``loss.png``: four panels read at a glance.

* loss per step, raw (thin) and smoothed (a centred moving average, thick), with the plain
  PyTorch replay of ``--compare`` when there is one;
* step time (seconds), raw and smoothed, with the median step time and tokens/s in its title;
* the learning rate each step applied;
* memory per tier (MiB): parameters and gradients on the device, pinned CPU buffers, NVMe swap
  files, and the process's resident set.

Legends sit outside the data (below each panel's title row), so no curve is hidden.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

MEMORY_TIERS = (("device_bytes", "device (params+grads)"), ("pinned_cpu_bytes", "pinned CPU"),
                ("nvme_bytes", "NVMe files"), ("rss_bytes", "process RSS"))


def smoothing_window(n: int) -> int:
    """Points averaged for each smoothed point of an ``n``-point curve: about n/15, odd, 1..51."""
    w = max(1, min(51, n // 15))
    return w if w % 2 else w + 1


def smoothed(values: Sequence[float], window: Optional[int] = None) -> List[float]:
    """Centred moving average of ``values`` over ``window`` points (default
    :func:`smoothing_window`), narrowed symmetrically at both ends. Centred, so a steadily
    falling loss is not drawn late (an exponential average trails it by ~1/alpha steps).
    Non-finite values are left out of every mean; a point whose window holds none stays as it is."""
    n = len(values)
    half = (window or smoothing_window(n)) // 2
    finite = [x == x and abs(x) != float("inf") for x in values]
    out = []
    for i, x in enumerate(values):
        h = min(half, i, n - 1 - i)
        part = [values[j] for j in range(i - h, i + h + 1) if finite[j]]
        out.append(sum(part) / len(part) if part else x)
    return out


def draw(records: List[dict], save: Callable[[object], None], title: str,
         reference: Optional[List[float]] = None) -> None:
    """Draw ``records`` (log.jsonl rows: ``step``, ``loss``, ``lr``, ``step_s``, ``tokens_per_s``
    and the byte counts of :data:`MEMORY_TIERS`) and hand the figure to ``save`` (which writes it);
    the figure is closed however ``save`` ends."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (ax_loss, ax_time), (ax_lr, ax_mem) = axes
    fig.suptitle(title, fontsize=9)

    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.45, linewidth=1, label="loss")
    ax_loss.plot(steps, smoothed(losses), color="tab:blue", linewidth=2, label=f"smoothed ({smoothing_window(len(losses))}-step mean)")
    if reference is not None:
        ax_loss.plot(steps[:len(reference)], reference, "--", color="tab:orange", linewidth=1,
                     label="no offload (PyTorch)")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")

    times = [r["step_s"] for r in records]
    median_s = sorted(times)[len(times) // 2]
    median_tok = sorted(r.get("tokens_per_s", 0.0) for r in records)[len(records) // 2]
    ax_time.plot(steps, times, color="tab:green", alpha=0.45, linewidth=1, label="step time")
    ax_time.plot(steps, smoothed(times), color="tab:green", linewidth=2, label="smoothed")
    ax_time.set(xlabel="step", ylabel="seconds per step",
                title=f"speed: median {median_s:.3g} s/step, {median_tok:,.0f} tokens/s")
    ax_time.set_ylim(bottom=0)

    ax_lr.plot(steps, [r["lr"] for r in records], color="tab:red", label="learning rate")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    for key, label in MEMORY_TIERS:
        mib = [r.get(key, 0) / 2 ** 20 for r in records]
        if any(mib):  # a tier this run does not use (the device on a CPU run) is left out, not drawn at 0
            ax_mem.plot(steps, mib, label=label)
    ax_mem.set_yscale("symlog", linthresh=1.0)
    ax_mem.set(xlabel="step", ylabel="MiB (log scale above 1)", title="memory per tier")

    for ax in (ax_loss, ax_time, ax_lr, ax_mem):
        if not ax.get_legend_handles_labels()[1]:  # a memory panel with no tier in use has no curve
            ax.grid(alpha=0.3)
            continue
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.08), ncol=4,
                  fontsize=7, frameon=False, borderaxespad=0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        save(fig)
    finally:
        plt.close(fig)
