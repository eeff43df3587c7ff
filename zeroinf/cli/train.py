"""``zeroinf train``: train a decoder-only transformer on real text with ZeRO-Infinity offload.

One command, no download: by default a tiny Llama-style model on the bytes of the Python standard
library found on this machine, with the offload preset ``--offload`` (a DeepSpeed-format config
shipped in ``zeroinf/presets``) or ``--config FILE.json``. The loop is the DeepSpeed one::

    engine, *_ = zeroinf.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step: for micro-batch: loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()

Outputs under ``--out`` (rank 0 writes them): ``log.jsonl`` (one record per optimizer step, fields in
:data:`LOG_FIELDS`), ``loss.png`` (loss curve and memory per tier), ``summary.json`` /
``summary.txt``, ``run.json`` (the run's arguments and state, for ``--resume``; written as the first
step starts), ``checkpoint/`` (periodic checkpoints, ``--save-every``, and one on Ctrl-C / SIGTERM;
removed when the run completes: :mod:`zeroinf.cli.train_checkpoints`), ``trace.json`` (``--trace``).

``--compare`` trains the same steps again with plain PyTorch (``torch.optim.AdamW``, fp32 master
weights when the run is bf16/fp16, same clipping, same learning rate per step, all ranks' rows in one
process) and fails (exit 3) when the two loss curves differ by more than :data:`COMPARE_ATOL`.

Exit codes: 0 done; 2 bad input (one line on stderr naming the culprit); 3 ``--compare`` mismatch;
4 the loss became NaN or infinite (the step is named on stderr; outputs are written);
130 interrupted (checkpoint saved; ``--resume OUT`` continues).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zeroinf.checkpoint import save_atomically, write_latest
from zeroinf.io.atomic import write_text_then_rename, write_then_rename
from zeroinf.cli.train_checkpoints import (CheckpointDir, RunState, SaveClock, lock_out, parse_save_every,
                                           read_run_state, save_every_arg, write_run_json)

__all__ = ["add_arguments", "main", "TrainError", "LOG_FIELDS", "COMPARE_ATOL", "PlainEngine", "loss_windows", "loss_label"]

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
OFFLOADS = ("none", "cpu", "nvme-optimizer", "infinity")
#: the offload used when --offload and --config are both absent
DEFAULT_OFFLOAD = "infinity"

#: every record of log.jsonl has these keys (units in the name: _s seconds, _bytes bytes)
LOG_FIELDS = (
    "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s", "compute_s", "io_wait_s",
    "optimizer_s", "device_bytes", "pinned_cpu_bytes", "nvme_bytes", "rss_bytes", "engine",
)

#: largest allowed |loss(offload) - loss(reference)| per step for --compare, by training dtype.
#: fp32: both runs do the same fp32 math in a different order, so rounding differences only
#: (grown over 20-40 steps of a chaotic optimisation); bf16/fp16: the offloaded model computes in
#: 16 bits like the reference, but reductions and casts may differ in order (measured: 1e-3 over
#: 20 steps of the tiny model in bf16).
COMPARE_ATOL = {"fp32": 2e-3, "bf16": 0.03, "fp16": 0.03}

EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 4, 130
#: path arguments stored absolute in run.json, so ``--resume`` from another directory reads the
#: same files
_PATH_ARGS = ("data", "config", "init", "tokenizer", "nvme_path", "out")


class TrainError(ValueError):
    """Bad input to ``zeroinf train``; the message starts with the offending option or path."""


def _append_record(log, path: Path, rec: dict) -> None:
    """Append one record to ``log.jsonl`` and flush it.

    Raises:
        TrainError: the write failed (e.g. a full ``--out`` disk); names the file, which a bare
            "[Errno 28] No space left on device" does not.
    """
    try:
        log.write(json.dumps(rec) + "\n")
        log.flush()
    except OSError as exc:
        raise TrainError(f"--out: writing {path} failed at step {rec.get('step')} ({exc.strerror or exc}); free "
                         "space there or give --out on another disk") from exc


def _write_out(path: Path, content: "str | Callable[[str], None]") -> None:
    """Write one of ``--out``'s files whole, through a temporary file and a rename: a failed
    write leaves the old file or none, not an empty one. ``content``: the text, or a function
    that writes the file to the name it is given (``loss.png``: matplotlib's ``savefig``).

    Raises:
        TrainError: the write failed (e.g. a full disk); names the file, and no empty
            summary.json is left as if it were one.
    """
    try:
        if isinstance(content, str):
            write_text_then_rename(path, content)
        else:
            write_then_rename(path, content)
    except OSError as exc:
        raise TrainError(f"--out: writing {path} failed ({exc.strerror or exc}); free space there or give --out "
                         "on another disk") from exc


# ----------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``zeroinf train``'s options to ``p``."""
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="llama (default), gpt2, or path/to/config.json")
    g.add_argument("--size", default=None, help="size preset: tiny (default), yardstick, 125m, 350m, 1b, 3b")
    g.add_argument("--init", default=None, metavar="PATH",
                   help="initial weights: a local .safetensors file or Hugging Face model folder (default: random)")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="a .txt file, a folder of text files, or a .jsonl with a 'text' field "
                        "(default: the Python standard library's .py and doc files on this machine)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local Hugging Face tokenizer folder (default: bytes, vocabulary 256)")
    g = p.add_argument_group("offload")
    g.add_argument("--offload", choices=OFFLOADS, default=None,
                   help=f"shipped DeepSpeed-format preset (default {DEFAULT_OFFLOAD}: params and optimizer on NVMe)")
    g.add_argument("--config", default=None, metavar="FILE.json", help="your own DeepSpeed-format config instead")
    g.add_argument("--nvme-path", default=None, metavar="DIR",
                   help="swap directory (default: a private temp dir under the working directory, removed "
                        "at the end unless --keep)")
    g.add_argument("--keep", action="store_true", help="keep the default swap directory")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="training precision (default: the config's; fp32 for the presets)")
    g.add_argument("--engine", choices=("zeroinf", "torch"), default=None,
                   help="torch = plain PyTorch + torch.optim.AdamW, no offload (a baseline)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40)")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128)")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per micro-step (default: the config's; 8 for the presets)")
    g.add_argument("--grad-accum", type=int, default=None, help="micro-steps per optimizer step (default: the config's, else 1)")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    g.add_argument("--seed", type=int, default=None, help="model init and batch order (default 0)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="DIR", help="log, plot and summary (default ./zeroinf-train)")
    g.add_argument("--trace", action="store_true", help="write the Perfetto trace of one step to OUT/trace.json")
    g.add_argument("--compare", action="store_true",
                   help="also train without offload (plain PyTorch) and check both loss curves agree")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run whose --out was DIR from its newest complete checkpoint")
    g.add_argument("--save-every", type=save_every_arg, default=None, metavar="N|Nm|Ns|auto",
                   help="checkpoint to OUT/checkpoint every N steps, N minutes or seconds, or 0 for never (default "
                        "auto: as often as keeps saving under 5%% of the run's time)")
    g.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                   help="keep the newest K checkpoints (default 2)")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")


#: options a --resume may change; everything else is taken from the interrupted run
_RESUME_OVERRIDABLE = ("steps", "compare", "trace", "keep", "no_plot", "nvme_path", "save_every", "keep_checkpoints")
_DEFAULTS = dict(model="llama", size="tiny", steps=40, seq_len=128, seed=0, out="zeroinf-train", engine="zeroinf",
                 save_every="auto", keep_checkpoints=2)


def main(args: argparse.Namespace) -> int:
    """Run ``zeroinf train``; returns the exit code (see the module docstring)."""
    from zeroinf.config import ConfigError
    from zeroinf.data import DataError
    from zeroinf.io.errors import DiskFullError
    from zeroinf.memcheck import InsufficientMemoryError
    from zeroinf.models import ModelError
    run = _Run(args)
    try:
        return run.run()
    except KeyboardInterrupt:  # outside the training loop's handler, or a second Ctrl-C
        print(f"zeroinf train: interrupted{run.resume_hint()}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except InsufficientMemoryError as exc:  # a headline and one line per figure
        print(f"zeroinf train: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ConfigError, DataError, ModelError, TrainError) as exc:
        print(f"zeroinf train: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DiskFullError as exc:  # e.g. swap files made by zeroinf.Init: one line, no traceback
        # strerror already names the file; str(exc) adds it a second time
        print(f"zeroinf train: error: {_one_line(exc.strerror or exc)}; free space there or give --nvme-path on a "
              "larger disk", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        run.remove_tmp_nvme()


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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------- distributed bits
@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @classmethod
    def from_env(cls) -> "_Dist":
        """Ranks from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); gloo on CPU, NCCL on CUDA."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        d = cls(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
        if world > 1 and not torch.distributed.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(backend=backend)
            d.initialized_here = True
        return d

    def all_max(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    def all_mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item()) / self.world_size

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


# ------------------------------------------------------------------------- the reference engine
class PlainEngine:
    """Plain PyTorch with the engine's interface: the ``--engine torch`` baseline and the
    ``--compare`` reference.

    ``torch.optim.AdamW(foreach=False)`` (``Adam`` with L2 decay when ``adamw`` is false) over fp32
    parameters. In ``bf16``/``fp16`` the model is
    cast to that dtype and the optimizer steps fp32 master copies, written back with ``.to(dtype)``
    (the mixed-precision recipe of the ZeRO paper, without loss scaling: fp16 here is for
    comparison on short runs only). ``backward`` divides the loss by ``grad_accum`` as DeepSpeed
    does; ``step`` updates at every ``grad_accum``-th call, after clipping the global gradient norm
    to ``clip`` (``torch.nn.utils.clip_grad_norm_``, 0 = off). Under ``torch.distributed`` with
    ``data_parallel`` it is plain data parallel: each gradient is all-reduced and divided by the
    world size before clipping (the ``--compare`` reference runs on rank 0 alone, without).
    """

    def __init__(self, model: torch.nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, clip: float = 0.0, norm_type: float = 2.0,
                 grad_accum: int = 1, dtype: str = "fp32", device: str = "cpu", data_parallel: bool = True):
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        trainable = [p for p in model.parameters() if p.requires_grad]
        # master weights are fp32 copies taken before the cast, so they start exact
        master = [p.detach().to(device=device, dtype=torch.float32, copy=True) for p in trainable]
        self.module = model.to(device=device, dtype=self.dtype)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if self.dtype == torch.float32:
            self.master = self.params
        else:
            self.master = [m.requires_grad_(True) for m in master]
        del master
        opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
        self.optimizer = opt_cls(self.master, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                 foreach=False)
        self.clip, self.norm_type, self.grad_accum, self.data_parallel = clip, norm_type, grad_accum, data_parallel
        self.device = torch.device(device)
        self.global_steps, self.micro_steps, self._norm = 0, 0, None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return
        if self.data_parallel and torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            for p in self.params:             # plain data parallel: average the gradients
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)
        if self.master is not self.params:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.clip if self.clip > 0 else float("inf"),
                                              norm_type=self.norm_type)
        self._norm = float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
                    p.grad = None
        self.global_steps += 1

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def get_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self._norm

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def stats(self) -> Dict[str, float]:
        return {}

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> None:
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        state = {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "master": [m.detach() for m in self.master] if self.master is not self.params else [],
                 "global_steps": self.global_steps, "micro_steps": self.micro_steps}
        save_atomically(state, str(path / "plain_engine.pt"))
        if save_latest:
            write_latest(str(save_dir), tag)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None) -> None:
        """Load ``load_dir/tag`` (``tag`` None: the one named in ``load_dir/latest``, as DeepSpeed)."""
        tag = tag or (Path(load_dir) / "latest").read_text().strip()
        state = torch.load(Path(load_dir) / tag / "plain_engine.pt", weights_only=True)
        self.module.load_state_dict(state["module"])
        with torch.no_grad():
            for m, saved in zip(self.master if self.master is not self.params else [], state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_steps, self.micro_steps = state["global_steps"], state["micro_steps"]


def _swap_where(zcfg, world_size: int = 1, private: bool = False) -> str:
    """``"; swap files in DIR[, DIR]"`` for rank 0's header, or ``""`` without NVMe: a config's own
    nvme_path (the presets' /local_nvme) is created if missing, so say where the files go.
    With ``private`` folders over several ranks, rank 0's is named and the others' are said to lie
    beside it."""
    z = zcfg.zero_optimization
    dirs = dict.fromkeys(b.nvme_path for b in (z.offload_param, z.offload_optimizer) if b.device == "nvme")
    if not dirs:
        return ""
    others = "rank 1 has its own" if world_size == 2 else f"ranks 1-{world_size - 1} have their own"
    more = f" (rank 0's; {others} {PRIVATE_PREFIX}N- beside it)" if private and world_size > 1 else ""
    return f"; swap files in {', '.join(dirs)}{more}"


# ---------------------------------------------------------------------------- the private swap folder
# [Note: private swap folders] Without --nvme-path each rank swaps into a folder of its own,
# .zeroinf-nvme-r{rank}-XXXXXXXX under the working directory, removed when the run ends. A run
# killed outright (a second Ctrl-C or SIGTERM gets the default action, SIGKILL, OOM) cannot
# remove it, and its swap files can be gigabytes in a hidden folder. So the folder is flock()ed
# for the run's lifetime (the kernel drops the lock when the process dies however it dies), and
# a later run in the same directory, of any rank, removes such folders that nobody holds. Only
# folders this scheme made are candidates: the name as mkdtemp makes it, owned by this user, and
# holding the OWNER file (a regular file naming this host) written under the lock. So an older
# version's folders (never locked, possibly a --keep run's or a live run's), another
# user's, another host's (a shared file system whose flock may be local to each host) and
# names a person chose are left alone. A folder is made under another prefix and renamed once locked and
# marked, so no scan sees it unlocked; a --keep run's folder carries a KEPT file and stays; where
# flock is not supported nothing is removed. A made-but-unmarked folder left by a run killed between
# those steps is empty; it is removed once an hour old (no run is that long between two calls).
PRIVATE_PREFIX = ".zeroinf-nvme-r"
_NEW_PREFIX = ".zeroinf-new-r"
_OWNER = "OWNER"
_KEPT = "KEPT"
_NEW_STALE_S = 3600  # an empty .zeroinf-new-r folder this old was left by a run killed while making it
_PRIVATE_NAME = re.compile(r"\.zeroinf-(nvme|new)-r[0-9]+-[a-z0-9_]{8}")  # fullmatch: no trailing newline


def make_private_dir(parent: Path, rank: int, keep: bool = False) -> Tuple[Path, int]:
    """Create rank ``rank``'s private swap folder under ``parent``, lock and mark it ([Note:
    private swap folders]). Returns ``(folder, fd)``; the lock holds until ``fd`` is closed.

    Raises:
        OSError: the folder cannot be created, opened or marked in ``parent``.
    """
    import fcntl
    d = Path(tempfile.mkdtemp(prefix=f"{_NEW_PREFIX}{rank}-", dir=parent))
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock on this file system: remove_stale_private_dirs cannot take it either
        if keep:
            (d / _KEPT).write_text("written by zeroinf train --keep: a later run leaves this folder alone\n")
        (d / _OWNER).write_text(f"{socket.gethostname()}\nzeroinf train, pid {os.getpid()}: a later run on this host "
                                "removes this folder once no process holds its lock\n")
        final = parent / (PRIVATE_PREFIX + f"{rank}-" + d.name.rsplit("-", 1)[1])
        os.rename(d, final)
    except BaseException:
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        raise
    return final, fd


def remove_stale_private_dirs(parent: Path) -> List[Tuple[Path, int]]:
    """Remove the private swap folders under ``parent`` (of any rank) that this scheme made, that
    belong to this user, and that no live run holds or a --keep run left ([Note: private swap
    folders]). Returns ``(folder, bytes of its files)`` for each one removed; a folder that
    cannot be inspected, opened or locked is left as it is. Never raises for a folder."""
    import fcntl
    removed = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not _PRIVATE_NAME.fullmatch(d.name):
            continue
        try:
            st = d.lstat()
            if (d.name.startswith(_NEW_PREFIX) and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                    and time.time() - st.st_mtime > _NEW_STALE_S and not any(d.iterdir())):
                # killed between mkdtemp and writing OWNER: empty, and old enough that no run is
                # still between those two calls; rmdir takes only an empty folder
                os.rmdir(d)
                removed.append((d, 0))
                continue
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.lexists(d / _KEPT)
                    or not stat.S_ISREG((d / _OWNER).lstat().st_mode)
                    or (d / _OWNER).read_text().split("\n", 1)[0] != socket.gethostname()):
                continue  # a link as OWNER; another host's run over a shared file system
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # another user's 0700 folder (Path.exists raised EACCES)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live run (EWOULDBLOCK), or no flock here
            os.close(fd)
            continue
        try:
            nbytes = sum(f.lstat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(d)
            removed.append((d, nbytes))
        except OSError:
            pass  # removed by hand meanwhile, or a file we may not delete: not ours to force
        finally:
            os.close(fd)
    return removed


# ---------------------------------------------------------------------------- the run itself
class _Stop:
    """SIGINT/SIGTERM -> stop after the current step.

    One process: a second signal gets the default behaviour (Ctrl-C twice kills at once). Under
    torchrun every signal only sets the flag: a worker receives Ctrl-C's SIGINT from the terminal
    and again from torchrun, and dying in the middle of the checkpoint's collectives would leave
    the other ranks waiting forever.
    """

    def __init__(self, keep_handler: bool = False):
        self.requested = False
        self.keep_handler = keep_handler
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        if not self.keep_handler:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dist = _Dist()
        self.tmp_nvme: Optional[Path] = None
        self._tmp_lock: Optional[int] = None  # the fd whose flock marks tmp_nvme as in use
        self.trace_files = ""  # the --trace files written, for the summary
        self.out: Optional[Path] = None  # --out, once resolved
        self.resume_from: Optional[Tuple[str, int]] = None  # (tag, step) a --resume loads; None: from step 1

    def resume_hint(self) -> str:
        """``"; continue with: zeroinf train --resume OUT"`` when OUT holds a complete checkpoint, else ``""``."""
        try:
            found = self.out is not None and CheckpointDir(self.out / "checkpoint").newest_complete()
        except (OSError, ValueError):
            found = None
        if not found:
            return ""
        return f" (checkpoint of step {found[1]} in {self.out / 'checkpoint'}); continue with: zeroinf train --resume {self.out}"

    def remove_tmp_nvme(self) -> None:
        """Remove the default private swap directory (not a user's --nvme-path), unless --keep."""
        if self.tmp_nvme is not None and not getattr(self.args, "keep", False):
            shutil.rmtree(self.tmp_nvme, ignore_errors=True)
            self.tmp_nvme = None
        if self._tmp_lock is not None:
            os.close(self._tmp_lock)
            self._tmp_lock = None

    # ---- set-up ----------------------------------------------------------------------------
    def _resolve_args(self) -> argparse.Namespace:
        a = argparse.Namespace(**vars(self.args))
        self.start_step = 1
        if a.out is not None and not str(a.out).strip():
            raise TrainError("--out '': give a folder (it held the outputs in the working directory)")
        for k in _PATH_ARGS:
            if getattr(a, k, None) is not None:
                setattr(a, k, os.path.abspath(os.path.expanduser(getattr(a, k))))  # --nvme-path=~/x: no shell expands it
        if a.seed is not None and not 0 <= a.seed < 2**32:
            raise TrainError(f"--seed {a.seed}: must be in [0, 2**32)")
        if a.resume:
            run_json = Path(a.resume) / "run.json"
            if not run_json.is_file():
                raise TrainError(f"--resume {a.resume}: no run.json there (is it the --out of an earlier run?)")
            try:
                saved = json.loads(run_json.read_text())
                state = read_run_state(saved)
            except (OSError, ValueError) as exc:  # json's JSONDecodeError is a ValueError
                raise TrainError(f"--resume {a.resume}: {run_json} is unreadable ({_one_line(exc)})") from exc
            try:
                self.resume_from = CheckpointDir(Path(a.resume) / "checkpoint").newest_complete()
            except (OSError, ValueError) as exc:
                raise TrainError(f"--resume {a.resume}: {_one_line(exc)}") from exc
            if state is RunState.COMPLETED:
                raise TrainError(f"--resume {a.resume}: the run completed its {saved.get('completed_steps')} steps; "
                                 "nothing to resume (its checkpoints were removed)")
            saved_args = _absolute_saved_args(a.resume, saved["args"])
            changed = [f"--{k.replace('_', '-')} {getattr(a, k)!r} (the run has "
                       f"{'its default' if v is None else repr(v)})" for k, v in saved_args.items()
                       if k not in _RESUME_OVERRIDABLE and k != "out" and getattr(a, k, None) not in (None, False)
                       and not _same_arg(k, getattr(a, k), v)]
            if a.out is not None and Path(a.out).resolve() != Path(a.resume).resolve():
                changed.append(f"--out {a.out!r} (a resumed run writes to its own folder, {a.resume!r})")
            if changed:  # they were dropped silently: the run went on with its own settings
                raise TrainError(f"--resume {a.resume}: {', '.join(changed)}: a resumed run keeps the settings of the "
                                 f"run it continues; only --{', --'.join(k.replace('_', '-') for k in _RESUME_OVERRIDABLE)} "
                                 "may change")
            for k, v in saved_args.items():
                if k not in _RESUME_OVERRIDABLE or getattr(a, k, None) is None:
                    setattr(a, k, v)
            a.out = os.path.abspath(a.resume)
            self.start_step = 1 if self.resume_from is None else self.resume_from[1] + 1
            if a.steps is not None and a.steps < self.start_step:
                # it ran no step and dropped checkpoint/latest as a completed run does: the resume point was lost
                raise TrainError(f"--resume {a.resume} --steps {a.steps}: the run has completed {self.start_step - 1} "
                                 f"steps already; give --steps above that (or leave it out: {saved['args'].get('steps')})")
        for k, v in _DEFAULTS.items():
            if getattr(a, k) is None:
                setattr(a, k, os.path.abspath(v) if k in _PATH_ARGS else v)
        out = self.out = Path(a.out)
        if not a.resume and (out / "checkpoint" / "latest").exists():
            # a fresh run there keeps the old run.json and checkpoint until it ends: killed before,
            # a --resume would go on from the old checkpoint with the new run's log
            raise TrainError(f"--out {out}: holds an interrupted run (its checkpoint); continue it with "
                             f"zeroinf train --resume {out}, or give another --out")
        if out.exists() and not out.is_dir():
            raise TrainError(f"--out {out}: exists and is not a folder")
        for name in ("steps", "seq_len", "micro_batch", "grad_accum", "keep_checkpoints"):
            v = getattr(a, name)
            if v is not None and v < 1:
                raise TrainError(f"--{name.replace('_', '-')} {v}: must be >= 1")
        if a.lr is not None and not (a.lr > 0 and math.isfinite(a.lr)):
            raise TrainError(f"--lr {a.lr}: must be a positive number")
        if a.config is not None and a.offload is not None:
            raise TrainError("--config and --offload: give one of them, not both")
        if a.engine == "torch" and (a.offload not in (None, "none") or a.config is not None):
            raise TrainError("--engine torch: trains without offload; drop --offload/--config")
        return a

    def _nvme_dir(self, a) -> Path:
        if a.nvme_path is None:
            here = Path(os.getcwd())
            for d, nbytes in remove_stale_private_dirs(here):
                print(f"zeroinf train: removed {d.name} ({nbytes / 2**20:.1f} MiB), the private swap folder of a "
                      "run that ended without removing it (killed)", file=sys.stderr)
            try:
                self.tmp_nvme, self._tmp_lock = make_private_dir(here, self.dist.rank, keep=a.keep)
            except OSError as exc:
                from zeroinf.io.probe import dir_problem
                why = dir_problem(str(here)) or (exc.strerror or str(exc))
                raise TrainError(f"the working directory {here} {why}, so it cannot hold the private swap folder; "
                                 "give --nvme-path DIR") from exc
            return self.tmp_nvme
        from zeroinf.io.probe import dir_problem
        path = Path(a.nvme_path)
        why = dir_problem(str(path), create=True)
        if why is not None:
            raise TrainError(f"--nvme-path {a.nvme_path}: {why}")
        return path

    def _build_config(self, a) -> dict:
        if a.engine == "torch":
            cfg = json.loads((PRESET_DIR / "none.json").read_text())
            where = "preset none"
        elif a.config is not None:
            try:
                cfg = json.loads(Path(a.config).read_text())
            except OSError as exc:
                raise TrainError(f"--config {a.config}: cannot read ({exc.strerror})") from exc
            except json.JSONDecodeError as exc:
                raise TrainError(f"--config {a.config}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc
            if not isinstance(cfg, dict):
                raise TrainError(f"--config {a.config}: the top level must be a JSON object")
            where = a.config
        else:
            a.offload = a.offload or DEFAULT_OFFLOAD
            cfg = json.loads((PRESET_DIR / f"{a.offload}.json").read_text())
            where = f"preset {a.offload}"
        self.config_source = where
        if a.micro_batch is not None or a.grad_accum is not None:
            cfg.pop("train_batch_size", None)
        if a.micro_batch is not None or not ({"train_micro_batch_size_per_gpu", "train_batch_size"} & set(cfg)):
            cfg["train_micro_batch_size_per_gpu"] = a.micro_batch or 8
        if a.grad_accum is not None:
            cfg["gradient_accumulation_steps"] = a.grad_accum
        cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
        if a.lr is not None and isinstance(cfg["optimizer"], dict):
            cfg["optimizer"].setdefault("params", {})["lr"] = a.lr
        if a.dtype is not None:
            # the blocks' other keys stay (loss scaling); DeepSpeed's "bfloat16" alias
            # is the bf16 block (the config check refuses both at once)
            bf16 = cfg.pop("bfloat16", None) if "bf16" not in cfg else cfg.get("bf16")
            cfg["bf16"] = {**(bf16 if isinstance(bf16, dict) else {}), "enabled": a.dtype == "bf16"}
            if a.dtype == "fp16":
                fp16 = cfg.get("fp16")
                cfg["fp16"] = {**(fp16 if isinstance(fp16, dict) else {}), "enabled": True}
            else:
                cfg.pop("fp16", None)
        zo = cfg.get("zero_optimization", {})
        # the config check takes the device in any case, so "NVMe" honours --nvme-path too
        on_nvme = [k for k in ("offload_param", "offload_optimizer")
                   if isinstance(zo.get(k), dict) and str(zo[k].get("device", "")).lower() == "nvme"]
        if on_nvme and (a.nvme_path is not None or a.config is None):
            nvme = str(self._nvme_dir(a))
            for k in on_nvme:
                zo[k]["nvme_path"] = nvme
        return cfg

    def _build_model(self, a, mcfg, cfg: dict):
        """The model, and the true shapes of parameters already partitioned away.

        With parameters on NVMe (stage 3, ``offload_param.device`` nvme) and random init, the
        model is built inside ``zeroinf.Init``, which moves each parameter to its swap file as its
        module is constructed, so a model larger than CPU memory can be built; the values are those
        of a plain build with the same seed (``--compare`` checks it). Otherwise a plain build. In
        bf16/fp16 the fp32 master weights come from the values as built, not their rounding
        (stage 3's [Note: Init masters]).
        """
        from zeroinf.models import build_model
        zo = self.zcfg.zero_optimization
        if a.engine != "zeroinf" or a.init is not None or zo.stage != 3 or zo.offload_param.device != "nvme":
            return build_model(mcfg, a.seed, a.init), {}
        import zeroinf
        from zeroinf.runtime.stage3.init import init_shapes
        with zeroinf.Init(config=cfg):
            model = build_model(mcfg, a.seed)
        return model, init_shapes(model)

    @staticmethod
    def _reference_params(zcfg) -> dict:
        """:class:`PlainEngine` keyword arguments for the same optimizer, clipping and precision."""
        o = zcfg.optimizer
        if not o.bias_correction:
            raise TrainError("optimizer.params.bias_correction false: torch.optim.AdamW has no such "
                             "option, so --engine torch / --compare cannot follow this config")
        return dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, adamw=o.adam_w_mode,
                    clip=zcfg.gradient_clipping, norm_type=zcfg.zeroinf.grad_norm_type,
                    grad_accum=zcfg.gradient_accumulation_steps, dtype=zcfg.precision)

    def _make_engine(self, a, cfg, model, device):
        if a.engine == "torch":
            return PlainEngine(model, device=device, **self._reference_params(self.zcfg))
        try:
            from zeroinf import initialize
        except ImportError as exc:
            raise TrainError(f"{self.config_source}: zeroinf.initialize is not in this build of zeroinf "
                             f"({exc}); use --engine torch for a run without offload") from exc
        try:
            engine, _opt, _dl, _sched = initialize(model=model, model_parameters=model.parameters(), config=cfg)
        except NotImplementedError as exc:
            if self.zcfg.zero_optimization.stage != 3:
                raise
            raise TrainError(f"{self.config_source}: zero_optimization.stage 3 (parameters offloaded, as "
                             f"--offload infinity does) needs the stage-3 runtime, which this build lacks "
                             f"({_one_line(exc)}); use --offload nvme-optimizer") from exc
        return engine

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        a = self._resolve_args()
        from zeroinf.data import Batches, ByteTokenizer, HFTokenizer, load_tokens
        from zeroinf.models import build_config

        self.dist = _Dist.from_env()
        rank0 = self.dist.rank == 0
        out = Path(a.out)
        cfg = self._build_config(a)
        from zeroinf.config import parse_config
        self.zcfg = parse_config(cfg, world_size=self.dist.world_size)
        if self.zcfg.scheduler is not None and a.engine == "torch":
            raise TrainError(f"{self.config_source}: scheduler is applied by the zeroinf engine only; "
                             "--engine torch trains at the constant optimizer.params.lr")
        tokenizer = HFTokenizer(a.tokenizer) if a.tokenizer else ByteTokenizer()
        tokens = load_tokens(a.data, tokenizer, a.seq_len + 1)
        self._check_batch_fits_corpus(a, cfg, tokens.numel())
        device = f"cuda:{self.dist.local_rank}" if torch.cuda.is_available() else "cpu"
        self._check_batch_fits_memory(a, cfg, tokenizer.vocab_size, device)
        made = []  # the folders of --out this run creates, outermost first: removed if left empty by a failure
        out_lock = None  # rank 0's flock on --out, held until the run ends
        busy = False  # a live run holds --out
        if rank0:
            made = [d for d in reversed((out, *out.parents)) if not d.exists()]
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # one line, not a traceback after the model was built
                raise TrainError(f"--out {out}: cannot be created ({exc.strerror or exc})") from exc
            try:
                out_lock = lock_out(out)
            except BlockingIOError:
                busy = True
            except OSError as exc:
                raise TrainError(f"--out {out}: cannot be opened ({exc.strerror or exc})") from exc
        if self.dist.all_max(1.0 if busy else 0.0) > 0:  # every rank stops before it clears anything there
            raise TrainError(f"--out {out}: another zeroinf train is running there; let it end (Ctrl-C saves it) "
                             "before a --resume or a new run there")
        engine = None
        ended = False  # every rank got through without an exception: the closing barrier is safe
        try:
            mcfg = build_config(a.model, a.size, tokenizer.vocab_size, a.seq_len, a.init)
            self.model_name = model_name(a.model, a.size, a.init, mcfg)
            if a.engine == "zeroinf" and self.zcfg.zeroinf.check_memory:  # before the model is built
                from zeroinf.memcheck import check_hf_config
                check_hf_config(mcfg, self.zcfg, world_size=self.dist.world_size, rank=self.dist.rank, device=device)
            model, shapes = self._build_model(a, mcfg, cfg)
            n_params = self.n_params = sum(shapes[p].numel() if p in shapes else p.numel()
                                           for p in {id(p): p for p in model.parameters()}.values())
            micro_batch, grad_accum = self.zcfg.train_micro_batch_size_per_gpu, self.zcfg.gradient_accumulation_steps
            batches = Batches(tokens, a.seq_len, micro_batch, a.seed)
            engine = self._make_engine(a, cfg, model, device)
            ckpts = CheckpointDir(out / "checkpoint", self.dist.rank, self.dist.barrier)
            # what a killed save left (and, in a fresh run, an earlier run's unfinished saves)
            ckpts.clear_partial(None if self.resume_from is None else self.resume_from[1])
            if self.resume_from is not None:
                tag, step = self.resume_from
                engine.load_checkpoint(str(out / "checkpoint"), tag)
                if engine.global_steps != step:  # the tag and the checkpoint must tell one story
                    raise TrainError(f"--resume {a.resume}: checkpoint/{tag} holds step {engine.global_steps}; "
                                     "the checkpoint folders were renamed or mixed")
            elif a.resume and rank0:
                print(f"zeroinf train: --resume {a.resume}: the run saved no checkpoint before it stopped; "
                      "starting over from step 1 with its settings", flush=True)
            dtype = self.zcfg.precision
            if rank0:
                print(f"zeroinf train: {self.model_name} {n_params / 1e6:.2f}M params, {dtype}, {self.config_source}, "
                      f"{self.dist.world_size} rank(s) x micro-batch {micro_batch} x accum {grad_accum} x "
                      f"seq {a.seq_len}, {_count(tokens.numel())} tokens of "
                      f"{a.data or 'Python standard library'}; out {out}"
                      + (f"; resumed after step {self.start_step - 1}" if self.resume_from is not None else "")
                      + _swap_where(self.zcfg, self.dist.world_size, self.tmp_nvme is not None),
                      flush=True)
            records, interrupted = self._loop(a, engine, batches, grad_accum, device, out, ckpts)
            code = 0
            if rank0:
                if not a.no_plot:  # before the summary, which names loss.png as written
                    self._plot(records, out, title=f"{self.model_name} {n_params / 1e6:.1f}M, {self.config_source}")
                summary = self._summary(a, records, n_params, dtype, out)
                if not interrupted:  # an interruption says one line (the summary is in summary.txt)
                    print(summary, flush=True)
            diverged = next((r for r in records if not math.isfinite(r["loss"])), None)
            if diverged is not None and rank0:  # also before an interruption's checkpoint
                print(f"zeroinf train: error: the loss is {diverged['loss']} from step {diverged['step']} on: "
                      "the run diverged (look at the learning rate, optimizer eps, loss scaling)"
                      + ("; --compare skipped" if a.compare and not interrupted else ""), file=sys.stderr, flush=True)
            if interrupted:
                if rank0:
                    print(f"zeroinf train: interrupted after step {self.completed}; checkpoint in "
                          f"{out / 'checkpoint' / CheckpointDir.tag(self.completed)}; continue with: "
                          f"zeroinf train --resume {out}", flush=True)
                ended = True
                return EXIT_INTERRUPTED
            if diverged is not None:  # a diverged run is a failure, never a success
                ended = True
                return EXIT_NONFINITE
            if a.compare:
                code = self._compare(a, cfg, mcfg, batches, grad_accum, out)
            ended = True
            return code
        finally:
            if engine is not None and hasattr(engine, "close"):
                engine.close()
            self.remove_tmp_nvme()
            if not ended:  # a refused or failed run leaves no empty --out behind
                for d in reversed(made):
                    try:
                        d.rmdir()  # only an empty folder: what the run wrote there stays
                    except OSError:
                        break
            if self.dist.initialized_here:
                from zeroinf.runtime.engine import destroy_process_group
                destroy_process_group(barrier=ended)
            if out_lock is not None:
                os.close(out_lock)

    def _check_batch_fits_corpus(self, a, cfg: dict, n_tokens: int) -> None:
        """Refuse a micro-batch whose rows over all ranks outnumber the corpus's distinct
        ``seq_len``-token sequences (``n_tokens - seq_len`` start offsets): every row past those
        repeats one (``train_micro_batch_size_per_gpu`` 1e11 ended in numpy's ArrayMemoryError
        traceback, after ``--out`` was made).

        Raises:
            TrainError: naming ``--micro-batch`` or the config's key, with the most the corpus allows.
        """
        mbs, ws = self.zcfg.train_micro_batch_size_per_gpu, self.dist.world_size
        windows = n_tokens - a.seq_len
        if mbs * ws <= windows:
            return
        name, advice = self._batch_name(a, cfg, windows // ws)
        raise TrainError(f"{name}: {mbs * ws:,} rows per micro-step over {ws} rank(s), but "
                         f"{a.data or 'the standard library corpus'} has {windows:,} distinct {a.seq_len}-token "
                         f"sequence{'' if windows == 1 else 's'} ({n_tokens:,} tokens); {advice}")

    def _batch_name(self, a, cfg: dict, most: int) -> Tuple[str, str]:
        """How the user set the micro-batch (``--micro-batch``, or the config's key) and the advice
        to give at most ``most`` rows per rank, in the same terms."""
        mbs, ws = self.zcfg.train_micro_batch_size_per_gpu, self.dist.world_size
        if a.micro_batch is not None:
            name = f"--micro-batch {mbs}"
        elif "train_micro_batch_size_per_gpu" in cfg:
            name = f"{self.config_source}: train_micro_batch_size_per_gpu {mbs}"
        else:
            return (f"{self.config_source}: train_batch_size {self.zcfg.train_batch_size} "
                    f"(train_micro_batch_size_per_gpu {mbs})",
                    f"give train_batch_size at most {most * ws * self.zcfg.gradient_accumulation_steps:,}")
        return name, f"give at most {most:,} rows per rank"

    def _check_batch_fits_memory(self, a, cfg: dict, vocab: int, device: str) -> None:
        """Refuse a micro-batch whose logits alone outgrow the memory free on ``device``: fp32
        logits of ``micro-batch x seq_len x vocab`` elements and as much again for their gradient
        (a lower bound of what the step needs: activations come on top), so ``--micro-batch
        10000000`` is refused here rather than by the allocator or the OOM killer after the model
        is built.

        Raises:
            TrainError: naming ``--micro-batch`` or the config's key, the bytes, and the most rows
                whose logits fit.
        """
        import psutil
        mbs = self.zcfg.train_micro_batch_size_per_gpu
        per_row = 2 * 4 * a.seq_len * vocab
        if device.startswith("cuda"):
            free, where = torch.cuda.mem_get_info(torch.device(device))[0], f"{device} has"
        else:
            free, where = psutil.virtual_memory().available, "this host has"
        if mbs * per_row <= free:
            return
        name, advice = self._batch_name(a, cfg, free // per_row)
        raise TrainError(f"{name}: the logits alone ({mbs:,} x {a.seq_len} tokens x vocabulary {vocab:,}, fp32, and "
                         f"their gradient) take {mbs * per_row / 2**30:,.1f} GiB, but {where} {free / 2**30:,.1f} GiB free; "
                         f"{advice} (activations come on top)")

    def _loop(self, a, engine, batches, grad_accum, device, out: Path, ckpts: CheckpointDir):
        """Steps ``start_step..a.steps``; returns ``(records of log.jsonl, interrupted)``.

        The log keeps the records of the steps up to the checkpoint resumed from (those a killed
        run logged after it are dropped: the steps run again), rewritten through a rename, then
        appended to. ``run.json`` is written before the first step, so a run killed from then on
        is resumable; a checkpoint follows the step after which ``--save-every`` finds one due
        (the log record is synced first, so the log holds every step the checkpoint has).
        """
        from tqdm import tqdm
        rank0 = self.dist.rank == 0
        records: List[dict] = []
        log_path = out / "log.jsonl"
        saved_args = {k: v for k, v in vars(a).items() if k != "resume"}
        log = None
        if rank0:
            if a.resume and log_path.is_file():
                records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
                records = [r for r in records if r["step"] < self.start_step]
            _write_out(log_path, "".join(json.dumps(r) + "\n" for r in records))
            self._write_run_json(out, saved_args, RunState.RUNNING, self.start_step - 1)
            log = open(log_path, "a")
        clock = SaveClock(parse_save_every(a.save_every), self.start_step)
        self.keep_checkpoints = a.keep_checkpoints
        self.completed = self.start_step - 1
        saved_step = None  # the step of this run's newest checkpoint
        tokens_per_step = batches.micro_batch * batches.seq_len * grad_accum * self.dist.world_size
        trace_step = min(self.start_step + 1, a.steps) if a.trace else None
        bar = tqdm(total=a.steps, initial=self.start_step - 1, disable=not rank0, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
        engine.train()
        interrupted = False
        try:
            with _Stop(keep_handler=self.dist.world_size > 1) as stop:
                for step in range(self.start_step, a.steps + 1):
                    prof = self._profiler() if step == trace_step else contextlib.nullcontext()
                    with prof as p:
                        rec = self._one_step(engine, batches, step, grad_accum, device)
                    if step == trace_step and rank0:
                        self.trace_files = ", ".join(map(str, self._write_trace(engine, p, out)))
                    rec.update(self._tiers(engine, _engine_stats(engine), rec))
                    rec["tokens"] = tokens_per_step
                    rec["tokens_per_s"] = tokens_per_step / rec["step_s"]
                    records.append(rec)
                    self.completed = step
                    if log is not None:
                        _append_record(log, log_path, rec)
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                    step_s=f"{rec['step_s']:.2f}")
                    bar.update(1)
                    if self.dist.all_max(1.0 if stop.requested else 0.0) > 0 and step < a.steps:
                        interrupted = True
                        break
                    # rank 0's clock decides for every rank
                    if step < a.steps and self.dist.all_max(1.0 if rank0 and clock.due(step) else 0.0) > 0:
                        clock.saved(step, self._save(ckpts, engine, step, log))
                        saved_step = step
        finally:
            bar.close()
            if log is not None:
                try:
                    log.close()
                except OSError:  # the write that failed left its bytes buffered: _append_record raised for it
                    pass
        if interrupted and saved_step != self.completed:
            self._save(ckpts, engine, self.completed, None)
        elif not interrupted and rank0:
            # completed: the checkpoints are not where the run stands any more (a later --resume
            # --steps M would take one up and number its steps from run.json)
            ckpts.drop_all()
        self.dist.barrier()
        if rank0:
            self._write_run_json(out, saved_args, RunState.INTERRUPTED if interrupted else RunState.COMPLETED,
                                 self.completed)
        return records, interrupted

    @staticmethod
    def _write_run_json(out: Path, args: dict, state: RunState, completed: int) -> None:
        """:func:`write_run_json`; raises TrainError naming the file when the write fails."""
        try:
            write_run_json(out, args, state, completed)
        except OSError as exc:
            raise TrainError(f"--out: writing {out / 'run.json'} failed ({exc.strerror or exc}); free space there "
                             "or give --out on another disk") from exc

    def _save(self, ckpts: CheckpointDir, engine, step: int, log) -> float:
        """Checkpoint after ``step`` (every rank); returns the seconds it took.

        Raises:
            TrainError: a checkpoint file cannot be written or synced (the message names it; the
                previous checkpoint stays the one ``--resume`` takes).
        """
        try:
            if log is not None:
                os.fsync(log.fileno())  # the log's records up to ``step`` outlive a crash as the checkpoint does
            return ckpts.save(engine, step, self.keep_checkpoints)
        except OSError as exc:
            raise TrainError(f"--out: checkpoint of step {step} failed ({_one_line(exc)}); the previous "
                             "checkpoint is still the one --resume takes; free space there or give --save-every 0") from exc

    @staticmethod
    def _write_trace(engine, prof, out: Path) -> List[Path]:
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

    @staticmethod
    def _profiler():
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        return profile(activities=acts)

    def _one_step(self, engine, batches, step: int, grad_accum: int, device) -> dict:
        t0 = time.perf_counter()
        losses, opt_s = [], 0.0
        for micro in range(grad_accum):
            x = batches.get(step, micro, self.dist.rank, self.dist.world_size).to(device)
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            losses.append(float(out.loss.detach().float()))
            last = micro == grad_accum - 1
            if last:  # the rate this step applies; after it, the next step's
                lr = engine.get_lr()
            t = time.perf_counter()
            engine.step()
            if last:
                opt_s = time.perf_counter() - t
        step_s = time.perf_counter() - t0
        norm = engine.get_global_grad_norm()
        return {"step": step, "loss": self.dist.all_mean(sum(losses) / len(losses)),
                "lr": float(lr[0] if isinstance(lr, (list, tuple)) else lr),
                "grad_norm": None if norm is None else float(norm), "step_s": step_s, "optimizer_s": opt_s}

    def _tiers(self, engine, stats: dict, rec: dict) -> dict:
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

    # ---- reporting -------------------------------------------------------------------------
    def _summary(self, a, records: List[dict], n_params: int, dtype: str, out: Path) -> str:
        if not records:
            return "zeroinf train: no step completed"
        timed = records[1:] if len(records) > 1 else records
        med = sorted(r["step_s"] for r in timed)[len(timed) // 2]
        mean = lambda k: sum(r[k] for r in timed) / len(timed)  # noqa: E731
        k, loss_first, loss_last = loss_windows([r["loss"] for r in records])
        # the kernel's high-water mark can lag a sample taken after it (below a step's rss_bytes)
        peak_rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, max(r["rss_bytes"] for r in records))
        s = {
            "model": self.model_name, "params": n_params, "dtype": dtype, "config": self.config_source, "ranks": self.dist.world_size,
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
        _write_out(out / "summary.json", json.dumps(s, indent=1) + "\n")
        mib = 2 ** 20
        lines = [
            f"{'model':<26}{self.model_name}",
            f"{'params':<26}{n_params:,} ({dtype}, {self.config_source}, {self.dist.world_size} rank(s))",
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
            + f", {out / 'summary.json'}" + (f", {self.trace_files}" if a.trace and self.trace_files else ""),
        ]
        text = "\n".join(lines)
        _write_out(out / "summary.txt", text + "\n")
        return text

    @staticmethod
    def _plot(records: List[dict], out: Path, title: str, reference: Optional[List[float]] = None) -> None:
        from zeroinf.cli.train_plot import draw
        # through a rename, naming the file on failure (a full disk: exit 1 with the path)
        draw(records, lambda fig: _write_out(out / "loss.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png")),
             title, reference)

    # ---- --compare ------------------------------------------------------------------------
    def _compare(self, a, cfg, mcfg, batches, grad_accum, out: Path) -> int:
        """Rank 0 replays the run with :class:`PlainEngine` (all ranks' rows in one process)."""
        import psutil
        code = 0
        if self.dist.rank == 0:
            records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
            dtype = self.zcfg.precision
            need = self.n_params * 20   # fp32 params, grads, Adam moments, and headroom
            if need > 0.8 * psutil.virtual_memory().available:
                print(f"zeroinf train: --compare skipped: training without offload needs ~{need / 2**30:.1f} GiB "
                      f"of RAM, {psutil.virtual_memory().available / 2**30:.1f} GiB available", flush=True)
            else:
                code = self._compare_rank0(a, cfg, mcfg, batches, grad_accum, out, records, dtype)
        if self.dist.world_size > 1:
            code = int(self.dist.all_max(float(code)))
        return code

    def _compare_rank0(self, a, cfg, mcfg, batches, grad_accum, out, records, dtype) -> int:
        from zeroinf.data import Batches
        from zeroinf.models import build_model
        world = self.dist.world_size
        ref_batches = Batches(batches.tokens, batches.seq_len, batches.micro_batch, batches.seed)
        engine = PlainEngine(build_model(mcfg, a.seed, a.init), data_parallel=False, **self._reference_params(self.zcfg))
        from tqdm import tqdm
        ref = []
        t0 = time.perf_counter()
        bar = tqdm(records, desc="--compare: replaying without offload", unit="step", dynamic_ncols=True,
                   file=sys.stderr)
        try:
            for r in bar:
                step = r["step"]
                engine.set_lr(r["lr"])
                losses = []
                for micro in range(grad_accum):
                    x = ref_batches.get(step, micro, world_size=world, rows=slice(None))
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                    losses.append(float(loss.detach().float()))
                ref.append(sum(losses) / len(losses))
        except KeyboardInterrupt:
            bar.close()
            print(f"zeroinf train: --compare interrupted after replaying {len(ref)} of {len(records)} steps; "
                  f"the run's own outputs in {out} are complete", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        finally:
            bar.close()
        ref_s = (time.perf_counter() - t0) / max(1, len(records))
        diffs = [abs(r["loss"] - x) for r, x in zip(records, ref)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        tol = COMPARE_ATOL[dtype]
        print(f"\n--compare: this run vs plain PyTorch (torch.optim.AdamW, {dtype}, no offload)")
        print(f"{'step':>6} {'this run':>10} {'no offload':>11} {'|diff|':>10}")
        stride = max(1, len(records) // 20)
        for i, (r, x, d) in enumerate(zip(records, ref, diffs)):
            if i % stride == 0 or i == len(records) - 1 or i == worst:
                print(f"{r['step']:6d} {r['loss']:10.5f} {x:11.5f} {d:10.2e}")
        ok = diffs[worst] <= tol
        print(f"largest difference {diffs[worst]:.3e} at step {records[worst]['step']} "
              f"(allowed {tol:g} for {dtype}): {'PASS' if ok else 'FAIL'}; "
              f"reference {ref_s:.3f} s/step", flush=True)
        _write_out(out / "compare.json", json.dumps({"dtype": dtype, "atol": tol, "max_abs_diff": diffs[worst],
                                                     "loss": [r["loss"] for r in records], "reference": ref}))
        if not a.no_plot:
            self._plot(records, out, title="this run vs no offload", reference=ref)
        return 0 if ok else EXIT_MISMATCH


def model_name(model: str, size: str, init: Optional[str], mcfg) -> str:
    """How the log and summary name the model: the ``--init`` file or folder (its base name) when
    weights come from one, else the ``--model`` config file, else the preset (``llama tiny``); with the architecture
    (``model_type`` of ``mcfg``, a transformers config) where the name alone does not give it."""
    kind = getattr(mcfg, "model_type", None) or model
    if init is not None:
        return f"{os.path.basename(os.path.normpath(init))} ({kind})"
    if model not in ("llama", "gpt2"):
        return f"{os.path.basename(model)} ({kind})"
    return f"{model} {size}"


def _device_peak_bytes() -> Optional[int]:
    """Bytes at the accelerator allocator's high-water mark in this process (``torch.cuda.
    max_memory_allocated``), or None when no CUDA device was used (a CPU run has no device tier)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def _engine_stats(engine) -> dict:
    """``engine.stats()`` as JSON-ready numbers (one level of nested dicts, e.g. ``stage3``)."""
    fn = getattr(engine, "stats", None)
    if fn is None:
        return {}

    def plain(d):
        return {k: v for k, v in dict(d).items() if isinstance(v, (int, float, str, bool)) or v is None}
    return {k: (plain(v) if isinstance(v, dict) else v) for k, v in fn().items()
            if isinstance(v, (int, float, str, bool, dict)) or v is None}


def _absolute_saved_args(run_dir: str, args: dict) -> dict:
    """``run.json``'s arguments with the path arguments absolute. Older versions stored them as
    typed, relative to a working directory they did not record: it is recovered from the stored
    relative ``out`` (the run's folder was ``cwd/out``), else the run is refused, since resolving
    against today's working directory would train on whatever file has that name there.

    Raises:
        TrainError: a relative path whose working directory cannot be told.
    """
    relative = [k for k in _PATH_ARGS if k != "out" and isinstance(args.get(k), str) and not os.path.isabs(args[k])]
    if not relative:
        return dict(args)
    here, out = Path(os.path.abspath(run_dir)), Path(args.get("out") or "")
    base = None
    if not out.is_absolute() and out.parts and ".." not in out.parts and here.parts[-len(out.parts):] == out.parts:
        base = Path(*here.parts[:len(here.parts) - len(out.parts)])
    if base is None:
        raise TrainError(f"--resume {run_dir}: run.json stores {', '.join('--' + k.replace('_', '-') for k in relative)} "
                         "relative to a working directory it does not record; edit run.json to give "
                         f"absolute paths ({', '.join(repr(args[k]) for k in relative)})")
    return {k: (os.path.normpath(base / v) if k in relative else v) for k, v in args.items()}


def _same_arg(key: str, given, saved) -> bool:
    """Whether a resumed run's ``--key given`` is the stored value (paths: the same file, through
    symlinks too)."""
    if key in _PATH_ARGS and isinstance(given, str) and isinstance(saved, str):
        return os.path.realpath(given) == os.path.realpath(saved)
    return given == saved


def _count(n: int) -> str:
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
