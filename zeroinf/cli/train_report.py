"""``zeroinf train``'s measurements and reports: time and memory per tier of one step, the
summary, the trace of one step, and the loss windows the summary compares. Nothing here writes
``--out``'s files: the run writes what these functions return."""
from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path
from typing import List, Optional, Tuple

import torch

__all__ = ["loss_windows", "loss_label", "tiers", "summarize", "write_trace", "profiler", "engine_stats",
           "short_count"]


def loss_windows(losses: List[float]) -> Tuple[int, float, float]:
    """``(k, mean of the first k losses, mean of the last k)`` with ``k = min(5, n // 2)``, so
    the two windows never share a step (``k = 1`` and the same single step when ``n == 1``).

    Raises:
        ValueError: ``losses`` is empty.
    """
    n = len(losses)
    if n == 0:
        raise ValueError("loss_windows: no losses")
    k = max(1, min(5, n // 2))
    return k, sum(losses[:k]) / k, sum(losses[-k:]) / k


def loss_label(k: int, n: int) -> str:
    """The summary's label for :func:`loss_windows` over ``n`` steps."""
    return "loss (1 step)" if n == 1 else f"loss first {k} -> last {k}"


def tiers(engine, stats: dict, rec: dict) -> dict:
    """Time split and memory per tier for one step (see LOG_FIELDS).

    ``stats`` is ``engine.stats()``: counters of the last optimizer step. ``io_wait_s`` is the
    engine's time waiting on I/O (optimizer swaps, and parameter fetches with stage 3);
    ``optimizer_s`` the optimizer step (the engine's ``optimizer_s``, else the wall time of the
    boundary ``engine.step()``) less the I/O waits inside it; ``compute_s`` the rest of the step.
    """
    import psutil
    s3 = stats.get("stage3") or {}
    opt_total = _pick(stats, ("optimizer_s",))
    opt_total = rec["optimizer_s"] if opt_total is None else opt_total
    opt_wait = min(_pick(stats, ("io_wait_s",)) or 0.0, opt_total)
    io_wait = opt_wait + (_pick(s3, ("wait_io_s",)) or 0.0)
    optimizer_s = opt_total - opt_wait
    module = getattr(engine, "module", None)
    device_bytes = 0
    if module is not None:
        seen = set()
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            device_bytes += p.numel() * p.element_size()
            if p.grad is not None:
                device_bytes += p.grad.numel() * p.grad.element_size()
    pinned = _pick(stats, ("pinned_bytes",)) or 0  # the engine counts stage 3's staging pool
    return {"compute_s": max(0.0, rec["step_s"] - optimizer_s - io_wait), "io_wait_s": io_wait,
            "optimizer_s": optimizer_s, "device_bytes": device_bytes,
            "pinned_cpu_bytes": int(pinned or 0), "nvme_bytes": _files_bytes(engine.swap_files() if hasattr(engine, "swap_files") else []),
            "rss_bytes": psutil.Process().memory_info().rss, "engine": stats}


def summarize(a, records: List[dict], n_params: int, dtype: str, out: Path, *, model: str, config: str,
              ranks: int, trace_files: str) -> Tuple[Optional[dict], str]:
    """The run's summary: ``(summary.json's dict, summary.txt's text)`` over the log ``records``
    of ``model`` (``n_params`` parameters, trained in ``dtype`` with the config ``config`` on
    ``ranks`` ranks); ``(None, one line)`` when no step completed. Times in seconds, memory in
    bytes (MiB in the text); the files it names as written lie in ``out``."""
    if not records:
        return None, "zeroinf train: no step completed"
    timed = records[1:] if len(records) > 1 else records
    med = sorted(r["step_s"] for r in timed)[len(timed) // 2]
    mean = lambda k: sum(r[k] for r in timed) / len(timed)  # noqa: E731
    k, loss_first, loss_last = loss_windows([r["loss"] for r in records])
    # the kernel's high-water mark can lag a sample taken after it (below a step's rss_bytes)
    peak_rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, max(r["rss_bytes"] for r in records))
    s = {
        "model": model, "params": n_params, "dtype": dtype, "config": config, "ranks": ranks,
        "steps": len(records), "tokens_per_step": records[-1]["tokens"],
        "median_step_s": med, "tokens_per_s": records[-1]["tokens"] / med,
        "compute_s": mean("compute_s"), "io_wait_s": mean("io_wait_s"), "optimizer_s": mean("optimizer_s"),
        "loss_window": k, "loss_first": loss_first, "loss_last": loss_last,
        "peak_rss_bytes": peak_rss,
        # the accelerator's high-water mark (activations and buffers included); None on a CPU run
        "peak_device_bytes": _device_peak_bytes(),
        "params_grads_on_device_bytes": max(r["device_bytes"] for r in records),
        "peak_pinned_cpu_bytes": max(r["pinned_cpu_bytes"] for r in records),
        "peak_nvme_bytes": max(r["nvme_bytes"] for r in records),
    }
    mib = 2 ** 20
    lines = [
        f"{'model':<26}{model}",
        f"{'params':<26}{n_params:,} ({dtype}, {config}, {ranks} rank(s))",
        f"{'steps':<26}{len(records)} x {records[-1]['tokens']} tokens",
        f"{loss_label(k, len(records)):<26}{loss_first:.4f} -> {loss_last:.4f}",
        f"{'step time (median)':<26}{med:.3f} s   {s['tokens_per_s']:.0f} tokens/s",
        f"{'  compute / io wait / opt':<26}{s['compute_s']:.3f} / {s['io_wait_s']:.3f} / {s['optimizer_s']:.3f} s (mean)",
        # true peaks: the process's resident high-water mark (getrusage) and, on an accelerator, its
        # allocator's; pinned buffers and swap files are held for the run, so their largest sample is theirs
        f"{'peak memory (MiB)':<26}RSS {peak_rss / mib:.1f}  "
        + ("device: none (CPU run)" if s["peak_device_bytes"] is None else f"device {s['peak_device_bytes'] / mib:.1f}")
        + f"  pinned CPU {s['peak_pinned_cpu_bytes'] / mib:.1f}  NVMe files {s['peak_nvme_bytes'] / mib:.1f}",
        f"{'written':<26}{out / 'log.jsonl'}" + ("" if a.no_plot else f", {out / 'loss.png'}")
        + f", {out / 'summary.json'}" + (f", {trace_files}" if a.trace and trace_files else ""),
    ]
    return s, "\n".join(lines)


def write_trace(engine, prof, out: Path) -> List[Path]:
    """Perfetto/Chrome JSON of one step: the engine's own transfer trace with stage 3
    (``engine.trace``) as ``trace.json``, and torch.profiler's operator trace as
    ``trace_ops.json`` (``trace.json`` when the engine records none). Returns the files."""
    has_engine_trace = False
    if hasattr(engine, "trace"):
        try:
            engine.trace(str(out / "trace.json"))
            has_engine_trace = True
        except NotImplementedError:
            pass
    ops = out / ("trace_ops.json" if has_engine_trace else "trace.json")
    prof.export_chrome_trace(str(ops))
    return [out / "trace.json", ops] if has_engine_trace else [ops]


def profiler():
    """A ``torch.profiler.profile`` of the CPU, and of CUDA where there is a GPU."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=acts)


def _device_peak_bytes() -> Optional[int]:
    """Bytes at the accelerator allocator's high-water mark in this process (``torch.cuda.
    max_memory_allocated``), or None when no CUDA device was used (a CPU run has no device tier)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def engine_stats(engine) -> dict:
    """``engine.stats()`` as JSON-ready numbers (one level of nested dicts, e.g. ``stage3``)."""
    fn = getattr(engine, "stats", None)
    if fn is None:
        return {}

    def plain(d):
        return {k: v for k, v in dict(d).items() if isinstance(v, (int, float, str, bool)) or v is None}
    return {k: (plain(v) if isinstance(v, dict) else v) for k, v in fn().items()
            if isinstance(v, (int, float, str, bool, dict)) or v is None}


def short_count(n: int) -> str:
    """``n`` as 32.0M, 41.5k or 812 (a small corpus is not "0.0M")."""
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.1f}k" if n >= 1000 else str(n)


def _pick(d: dict, names) -> Optional[float]:
    for n in names:
        if n in d and isinstance(d[n], (int, float)):
            return float(d[n])
    return None


def _files_bytes(paths: List[str]) -> int:
    """Bytes allocated on disk (st_blocks * 512) by the files ``paths`` (the engine's swap files:
    not the whole swap folders, which can hold an earlier run's files too)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):  # not written yet
            total += os.stat(path).st_blocks * 512
    return total

