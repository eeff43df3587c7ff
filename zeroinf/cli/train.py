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
import signal
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch

from zeroinf.cli.train_checkpoints import (CheckpointDir, RunState, SaveClock, lock_out, parse_save_every,
                                           save_every_arg, write_run_json)
from zeroinf.cli.train_compare import COMPARE_ATOL, replay
from zeroinf.cli.train_nvme import swap_where
from zeroinf.cli.train_plain import PlainEngine
from zeroinf.cli.train_report import engine_stats, loss_label, loss_windows, profiler, short_count, summarize, tiers, write_trace
from zeroinf.cli.train_setup import DEFAULT_OFFLOAD, OFFLOADS, RunSetup, TrainError, _Dist, _one_line, model_name
from zeroinf.io.atomic import write_text_then_rename, write_then_rename

# the set-up's names that callers import from this module
from zeroinf.cli.train_nvme import PRIVATE_PREFIX, make_private_dir, remove_stale_private_dirs  # noqa: F401,E402
from zeroinf.cli.train_setup import PRESET_DIR  # noqa: F401,E402

__all__ = ["add_arguments", "main", "TrainError", "LOG_FIELDS", "COMPARE_ATOL", "PlainEngine", "loss_windows", "loss_label"]

#: every record of log.jsonl has these keys (units in the name: _s seconds, _bytes bytes)
LOG_FIELDS = (
    "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s", "compute_s", "io_wait_s",
    "optimizer_s", "device_bytes", "pinned_cpu_bytes", "nvme_bytes", "rss_bytes", "engine",
)


EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 4, 130


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


class _Run(RunSetup):
    """One ``zeroinf train`` run: :class:`RunSetup`'s set-up, then the loop, its checkpoints and
    the files of ``--out`` (this class writes them all)."""

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
                      f"seq {a.seq_len}, {short_count(tokens.numel())} tokens of "
                      f"{a.data or 'Python standard library'}; out {out}"
                      + (f"; resumed after step {self.start_step - 1}" if self.resume_from is not None else "")
                      + swap_where(self.zcfg, self.dist.world_size, self.tmp_nvme is not None),
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
                    prof = profiler() if step == trace_step else contextlib.nullcontext()
                    with prof as p:
                        rec = self._one_step(engine, batches, step, grad_accum, device)
                    if step == trace_step and rank0:
                        self.trace_files = ", ".join(map(str, write_trace(engine, p, out)))
                    rec.update(tiers(engine, engine_stats(engine), rec))
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

    def _summary(self, a, records: List[dict], n_params: int, dtype: str, out: Path) -> str:
        """Write summary.json and summary.txt (:func:`summarize`); returns the text."""
        s, text = summarize(a, records, n_params, dtype, out, model=self.model_name, config=self.config_source,
                            ranks=self.dist.world_size, trace_files=self.trace_files)
        if s is not None:
            _write_out(out / "summary.json", json.dumps(s, indent=1) + "\n")
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
        found = replay(a, mcfg, batches, grad_accum, self.dist.world_size, records, dtype,
                       self._reference_params(self.zcfg), out)
        if found is None:
            return EXIT_INTERRUPTED
        ok, result, ref = found
        _write_out(out / "compare.json", json.dumps(result))
        if not a.no_plot:
            self._plot(records, out, title="this run vs no offload", reference=ref)
        return 0 if ok else EXIT_MISMATCH
