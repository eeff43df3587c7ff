"""bench/scale.py at a tiny size: the JSON it writes holds the keys the issue names, with values
consistent with each other, with the model it built and with the bytes the state must move."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import scale  # noqa: E402


@pytest.mark.parametrize("text,value", [("1e9", 10**9), ("1B", 10**9), ("300M", 300 * 10**6), ("5m", 5 * 10**6),
                                        ("1.5B", 1_500_000_000), ("64MiB", 64 << 20), ("2GiB", 2 << 30)])
def test_parse_count(text, value):
    assert scale.parse_count(text) == value


@pytest.mark.parametrize("text", ["", "1X", "-5M", "0", "M"])
def test_parse_count_refuses(text):
    with pytest.raises(Exception, match="count|positive"):
        scale.parse_count(text)


@pytest.mark.parametrize("params", [5e6, 50e6, 300e6, 1e9, 3e9])
def test_shape_is_near_the_size_asked(params):
    blocks, width = scale.shape_for(int(params), 256)
    n = sum(p.numel() for p in scale.GPT(blocks, width, 256).parameters()) if params < 1e8 else \
        blocks * scale.block_params(width) + scale.other_params(width, 256)
    assert width % 64 == 0 and blocks >= 1
    assert abs(n - params) <= 0.5 * scale.block_params(width) + 1, (blocks, width, n)


def test_block_and_other_params_count_the_real_modules():
    width, seq = 128, 32
    m = scale.GPT(3, width, seq)
    assert sum(p.numel() for p in m.blocks[0].parameters()) == scale.block_params(width)
    assert sum(p.numel() for p in m.parameters()) == 3 * scale.block_params(width) + scale.other_params(width, seq)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_scale_json_tiny(tmp_path, state_dtype):
    out = tmp_path / "scale.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--params", "5M", "--steps", "2",
                           "--seq", "32", "--disk-bytes", "32MiB", "--floor-repeat", "1",
                           "--nvme-path", str(tmp_path / "nvme"), "--json", str(out), "--state-dtype", state_dtype],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    for key in ("step_s", "io_floor_s", "compute_floor_s", "ratio", "read_bytes", "write_bytes", "disk_gbps",
                "peak_rss_bytes"):
        assert isinstance(d[key], (int, float)) and d[key] > 0 and math.isfinite(d[key]), key
    n = sum(p.numel() for p in scale.GPT(d["blocks"], d["width"], 32).parameters())  # plain PyTorch count
    assert n == d["params"] and abs(n - 5e6) < 0.1 * 5e6
    # every step reads the fp32 master and both moments (12 bytes/param; 8 with bf16 moments) and
    # writes them back with the new bf16 parameters (2 bytes/param), plus the gradients and the
    # parameters the forward and backward read: bf16 moments take 4 bytes/param off each direction
    state = {"fp32": 12, "bf16": 8}[state_dtype]
    assert d["state_dtype"] == state_dtype
    assert state * n <= d["read_bytes"] < (state + 4) * n
    assert (state + 2) * n <= d["write_bytes"] < (state + 6) * n
    # the kernel counted the same block I/O for the process as the engine (4 MiB for the rest)
    for k in ("read_bytes", "write_bytes"):
        assert abs(d["proc_" + k] - d[k]) <= 0.1 * d[k] + (4 << 20), (k, d["proc_" + k], d[k])
    floor = d["read_bytes"] / (d["disk_read_gbps"] * 1e9) + d["write_bytes"] / (d["disk_write_gbps"] * 1e9)
    assert d["io_floor_s"] == pytest.approx(floor, rel=1e-9)
    assert d["disk_gbps"] == pytest.approx((d["read_bytes"] + d["write_bytes"]) / floor / 1e9, rel=1e-9)
    assert d["ratio"] == pytest.approx(d["step_s"] / max(d["io_floor_s"], d["compute_floor_s"]), rel=1e-9)
    trace = d["last_step_trace_s"]  # the last step's engine trace, summed per thread and kind
    assert trace["compute forward"] > 0 and trace["compute backward"] > 0 and trace["io grad"] > 0, trace
    assert len(d["losses"]) == 2 and all(math.isfinite(v) for v in d["losses"])
    assert not any((tmp_path / "nvme").iterdir())  # the swap folder is removed
    assert "ratio" in proc.stdout and "io floor" in proc.stdout


def test_scale_paired_floor_tiny(tmp_path):
    """--paired-floor: a floor timed after each timed step; step, floor and ratio medians agree
    with the per-step lists, and the step time is the steps' own windows."""
    out = tmp_path / "scale.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--params", "5M", "--steps", "4",
                           "--seq", "32", "--disk-bytes", "32MiB", "--floor-repeat", "1", "--paired-floor",
                           "--nvme-path", str(tmp_path / "nvme"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert d["paired_floor"] is True
    steps, floors, ratios = d["per_step_s"], d["per_step_compute_floor_s"], d["per_step_ratio"]
    assert len(steps) == len(floors) == len(ratios) == 3
    assert all(f > 0 for f in floors)
    for s, f, r in zip(steps, floors, ratios):
        assert r == pytest.approx(s / max(d["io_floor_s"], f), rel=1e-9)
    assert d["ratio"] == pytest.approx(sorted(ratios)[1], rel=1e-9)
    assert d["compute_floor_s"] == pytest.approx(sorted(floors)[1], rel=1e-9)
    assert d["step_s"] == pytest.approx(sum(steps) / 3, rel=1e-9)
    # each step's window holds its own optimizer work: the forward, backward, step() and the wait
    for s, p in zip(steps, d["per_step"][1:]):
        assert s >= p["forward_s"] + p["backward_call_s"] + p["step_call_s"] + p["synchronize_s"] - 1e-6
    assert 0 < d["peak_rss_bytes"] < 4 << 30
    assert "paired, per timed step" in proc.stdout
