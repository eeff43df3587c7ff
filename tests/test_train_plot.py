"""loss.png of zeroinf train: the smoothing and the four panels."""
import math

import pytest

from zeroinf.cli.train_plot import draw, smoothed, smoothing_window


def test_smoothed_is_a_centred_mean_narrowed_at_the_ends():
    v = [1.0, 4.0, 2.0, 8.0, 5.0, 7.0, 3.0]
    got = smoothed(v, window=5)
    want = [1.0, (1 + 4 + 2) / 3, (1 + 4 + 2 + 8 + 5) / 5, (4 + 2 + 8 + 5 + 7) / 5, (2 + 8 + 5 + 7 + 3) / 5,
            (5 + 7 + 3) / 3, 3.0]
    assert got == pytest.approx(want, rel=0, abs=1e-12)
    line = [10.0 - 0.5 * i for i in range(40)]   # a straight line: a centred mean does not lag it
    assert smoothed(line, window=7) == pytest.approx(line, abs=1e-12)


def test_smoothed_leaves_non_finite_points_out():
    got = smoothed([1.0, math.nan, 3.0], window=3)
    assert got[1] == 2.0 and got[0] == 1.0 and got[2] == 3.0
    assert math.isinf(smoothed([math.inf], window=3)[0])


def test_window_is_odd_and_bounded():
    assert [smoothing_window(n) for n in (1, 30, 60, 10_000)] == [1, 3, 5, 51]


def test_draw_has_loss_speed_lr_and_memory_panels(tmp_path):
    import matplotlib.pyplot as plt

    recs = [{"step": s, "loss": 5.0 / s, "lr": 1e-3 * s, "step_s": 0.5, "tokens_per_s": 2000.0,
             "device_bytes": 0, "pinned_cpu_bytes": 2 ** 20, "nvme_bytes": 3 * 2 ** 20, "rss_bytes": 2 ** 29}
            for s in range(1, 21)]
    seen = {}

    def save(fig):
        seen["titles"] = [ax.get_title() for ax in fig.axes]
        seen["lines"] = {ax.get_title(): [ln.get_label() for ln in ax.get_lines()] for ax in fig.axes}
        seen["lr"] = list(fig.axes[2].get_lines()[0].get_ydata())
        fig.savefig(tmp_path / "loss.png")

    draw(recs, save, "title", reference=[r["loss"] for r in recs])
    assert seen["titles"][0] == "loss" and seen["titles"][1].startswith("speed: median 0.5 s/step, 2,000 tokens/s")
    assert seen["titles"][2:] == ["learning rate", "memory per tier"]
    assert seen["lines"]["loss"] == ["loss", "smoothed (1-step mean)", "no offload (PyTorch)"]
    assert seen["lr"] == pytest.approx([1e-3 * s for s in range(1, 21)])
    assert seen["lines"]["memory per tier"] == ["pinned CPU", "NVMe files", "process RSS"]  # no device tier
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.get_fignums()   # closed after saving
