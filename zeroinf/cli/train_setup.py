"""``zeroinf train``'s set-up: its options resolved (defaults, and a ``--resume``'s saved ones),
the DeepSpeed-format config, the ranks, the model and the engine built, and the batch checked
against the corpus and the free memory before anything is written."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from zeroinf.cli.train_checkpoints import CheckpointDir, RunState, read_run_state
from zeroinf.cli.train_nvme import make_private_dir, remove_stale_private_dirs
from zeroinf.cli.train_plain import PlainEngine

__all__ = ["TrainError", "RunSetup", "model_name", "PRESET_DIR", "OFFLOADS", "DEFAULT_OFFLOAD"]

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
OFFLOADS = ("none", "cpu", "nvme-optimizer", "infinity")
#: the offload used when --offload and --config are both absent
DEFAULT_OFFLOAD = "infinity"

#: path arguments stored absolute in run.json, so ``--resume`` from another directory reads the
#: same files
_PATH_ARGS = ("data", "config", "init", "tokenizer", "nvme_path", "out")

#: options a --resume may change; everything else is taken from the interrupted run
_RESUME_OVERRIDABLE = ("steps", "compare", "trace", "keep", "no_plot", "nvme_path", "save_every", "keep_checkpoints")

_DEFAULTS = dict(model="llama", size="tiny", steps=40, seq_len=128, seed=0, out="zeroinf-train", engine="zeroinf",
                 save_every="auto", keep_checkpoints=2)


class TrainError(ValueError):
    """Bad input to ``zeroinf train``; the message starts with the offending option or path."""


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (white space folded), for a one-line error on stderr."""
    return " ".join(str(exc).split())


def stop_with_launcher() -> bool:
    """Ask Linux to send this process SIGTERM when its parent (torchrun's agent) dies.

    torchrun forwards SIGINT and SIGTERM to its workers, but a SIGKILL of torchrun itself (an
    out-of-memory kill, ``kill -9``, a scheduler's hard stop) reaches nobody, and the workers
    trained on as orphans. With this, each worker gets SIGTERM instead, which ``zeroinf train``
    turns into a stop after the current step. Returns True where it is set (Linux with a C
    library); False elsewhere, where nothing changes. A parent that died before the call is not
    seen by the kernel, so that case sends the signal here at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher is gone already: re-parented before the call
        os.kill(os.getpid(), signal.SIGTERM)
    return True


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
        if world > 1:
            stop_with_launcher()
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


class RunSetup:
    """The state of one ``zeroinf train`` run and its set-up steps; :class:`zeroinf.cli.train._Run`
    adds the training loop and the outputs."""

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
        self._refuse_batch(a, cfg, windows // ws,
                           f"{mbs * ws:,} rows per micro-step over {ws} rank(s), but "
                           f"{a.data or 'the standard library corpus'} has {windows:,} distinct {a.seq_len}-token "
                           f"sequence{'' if windows == 1 else 's'} ({n_tokens:,} tokens)")

    def _refuse_batch(self, a, cfg: dict, most: int, why: str, note: str = "") -> None:
        """Raise TrainError ``"<how the user set the micro-batch>: <why>; <advice><note>"``: the
        micro-batch named as the user set it (``--micro-batch``, or the config's key), and the
        advice to give at most ``most`` rows per rank, in the same terms."""
        mbs, ws = self.zcfg.train_micro_batch_size_per_gpu, self.dist.world_size
        if a.micro_batch is not None:
            name = f"--micro-batch {mbs}"
        elif "train_micro_batch_size_per_gpu" in cfg:
            name = f"{self.config_source}: train_micro_batch_size_per_gpu {mbs}"
        else:
            raise TrainError(f"{self.config_source}: train_batch_size {self.zcfg.train_batch_size} "
                             f"(train_micro_batch_size_per_gpu {mbs}): {why}; give train_batch_size at most "
                             f"{most * ws * self.zcfg.gradient_accumulation_steps:,}{note}")
        raise TrainError(f"{name}: {why}; give at most {most:,} rows per rank{note}")

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
        self._refuse_batch(a, cfg, free // per_row,
                           f"the logits alone ({mbs:,} x {a.seq_len} tokens x vocabulary {vocab:,}, fp32, and their "
                           f"gradient) take {mbs * per_row / 2**30:,.1f} GiB, but {where} {free / 2**30:,.1f} GiB free",
                           " (activations come on top)")


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

