"""What the engine reports of itself: DeepSpeed's accessors (batch sizes, stage, precision,
ranks, learning rates), the ``nn.Module``-like view of the wrapped model, :meth:`EngineInfo.stats`,
:meth:`EngineInfo.trace`, the swap files, and the ``steps_per_print`` lines. :class:`EngineInfo`
is a part of :class:`zeroinf.runtime.engine.ZeroEngine`.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

if TYPE_CHECKING:  # annotations only: engine.py imports this module
    from .engine import ZeroEngine

__all__ = ["EngineInfo"]

_log = logging.getLogger("zeroinf")


def _progress(msg: str, *args) -> None:
    """A ``steps_per_print`` line: to the ``zeroinf`` logger at INFO once logging is configured
    (a handler on that logger or above it; its level decides), else to stderr as
    ``[zeroinf] ...`` through ``tqdm.write``, so a progress bar stays whole. DeepSpeed's logger
    prints these by default; through logging alone they stayed invisible until the user set
    logging up, and the config key looked ignored."""
    if _log.hasHandlers():
        _log.info(msg, *args)
    else:
        from tqdm import tqdm
        tqdm.write("[zeroinf] " + msg % args, file=sys.stderr)


class EngineInfo:
    """Accessors, statistics and reports of :class:`~zeroinf.runtime.engine.ZeroEngine`."""

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        self.module.eval()
        return self

    # what scripts written for DeepSpeedEngine (an nn.Module around the model) ask of it
    @property
    def training(self) -> bool:
        """The module's ``training`` flag."""
        return self.module.training

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The module's parameters (at stage 3 released ones are placeholders: see ``ds_shape``)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """The module's named parameters, as :meth:`parameters`."""
        return self.module.named_parameters(prefix, recurse)

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """DeepSpeed's name: the module's ``state_dict()`` (full tensors; at stage 3 gathered, so
        collective), without parameters that have ``requires_grad=False`` if asked."""
        sd = self.module.state_dict()
        if exclude_frozen_parameters:
            from zeroinf.checkpoint import frozen_names
            frozen = set(frozen_names(self.module))  # a tied one under each of its names
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: a model save gathers the full weights at every stage (DeepSpeed's question, asked
        by Accelerate and transformers before :meth:`_zero3_consolidated_16bit_state_dict`)."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """DeepSpeed's name for the full state dict at stage 3: :meth:`module_state_dict`
        (the model's dtype; collective with several ranks)."""
        return self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    # DeepSpeed's accessors
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
        return self.gas

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch per rank, from the config."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (micro-batch x accumulation x ranks)."""
        return self.config.train_micro_batch_size_per_gpu * self.gas * self.world_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.config.zero_optimization.stage

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False when an fp16 overflow
        skipped it, or before any step)."""
        return self._step_applied

    @property
    def global_samples(self) -> int:
        """Samples consumed by optimizer steps so far, counted at each step as DeepSpeed counts
        them (see :meth:`_count_samples`) and restored by ``load_checkpoint``: it stays right
        across a change of batch size on resume (it was ``global_steps x train_batch_size()``,
        which rewrote the past)."""
        return self._global_samples

    @property
    def device(self) -> torch.device:
        """The compute device of the model's parameters."""
        return torch.device(self.params.device)

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK`` from torchrun; 0 without it)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def get_global_grad_norm(self) -> Optional[float]:
        """The (unscaled) global gradient norm of the last boundary, before clipping; None before
        the first step; inf/nan when that step was skipped."""
        return self._grad_norm

    def get_lr(self) -> List[float]:
        """The lr of each param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> List[Tuple[float, float]]:
        """Adam's ``betas`` of each param group, as DeepSpeed's ``get_mom`` gives them."""
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    # what DeepSpeed's example scripts read of the engine
    @property
    def global_rank(self) -> int:
        """This process's rank in the data-parallel world (``torch.distributed`` rank)."""
        return self.rank

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (all ranks: zeroinf has no model or pipeline parallelism)."""
        return self.world_size

    def get_data_parallel_world_size(self) -> int:
        """Same as :attr:`dp_world_size`."""
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        """Same as :attr:`global_rank`."""
        return self.rank

    def fp16_enabled(self) -> bool:
        """Whether the config trains in fp16 (``fp16.enabled``)."""
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        """Whether the config trains in bf16 (``bf16.enabled``)."""
        return self.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        """The config's ``gradient_clipping`` (max global gradient norm; 0: no clipping)."""
        return self.config.gradient_clipping

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage 1-3), as DeepSpeed answers it."""
        return self.config.zero_optimization.stage > 0

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to CPU memory (``offload_optimizer.device`` cpu)."""
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_offload_optimizer(self):
        """The config's ``zero_optimization.offload_optimizer`` block (device, nvme_path, buffers),
        or None without optimizer offload (device none), as DeepSpeed answers it."""
        off = self.config.zero_optimization.offload_optimizer
        return None if off.device == "none" else off

    def zero_offload_param(self):
        """The config's ``zero_optimization.offload_param`` block (device, nvme_path, buffers),
        or None without parameter offload (device none), as DeepSpeed answers it."""
        off = self.config.zero_optimization.offload_param
        return None if off.device == "none" else off

    def steps_per_print(self) -> int:
        """The config's ``steps_per_print`` (0: never)."""
        return self.config.steps_per_print

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16 training scales the loss dynamically (``fp16.loss_scale`` 0)."""
        return self.config.precision == "fp16" and self.config.fp16.loss_scale == 0

    def get_batch_info(self) -> Tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.config.train_micro_batch_size_per_gpu, self.gas

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: 1 (zeroinf has no tensor or pipeline parallelism)."""
        return 1

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16); a property: ``engine.loss_scale``, not
        ``engine.loss_scale()``."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def swap_files(self) -> List[str]:
        """Paths of this engine's NVMe swap and manifest files on this rank: the optimizer's
        and (stage 3) the parameter manager's swappers' registered keys. Other files in the
        ``nvme_path`` folders (an earlier run's, left there: swap files outlive ``close``) are not
        included. Empty without NVMe offload or after ``close``."""
        files = set(self.params.swap_files())
        swapper = getattr(self.sub_optimizer, "_swapper", None)
        if swapper is not None:
            files |= {str(p) for p in swapper.files()}
        return sorted(files)

    def stats(self) -> Dict[str, Any]:
        """Counters of the last optimizer step: seconds in backward, gradient reduction, optimizer
        (of which Adam compute and waiting on NVMe I/O) and all-gather; elements communicated;
        NVMe bytes read/written; ``pinned_bytes``, the page-locked host memory held now (the
        optimizer's swap buffers and stage 3's parameter staging pool, locked on any host; with
        CUDA also the gradient accumulation, parameter copies, staging buffers and CPU-resident
        optimizer state torch pins), as the engine's :class:`~zeroinf.runtime.host_memory.HostMemory`
        counts it; plus step counters and the loss scale.

        With a background step (stage 3, ``zeroinf.overlap_step`` or
        ``zeroinf.optimizer_in_backward``) a step's Adam time and optimizer NVMe bytes land in the
        counters of the next step (they are added when the next backward joins the step), and
        ``io_wait_s`` counts the time the forward waited for its updates."""
        out = dict(self._stats)
        out.update(global_steps=self.global_steps, skipped_steps=self.skipped_steps, loss_scale=self.loss_scale,
                   pinned_bytes=self.host.nbytes,
                   grad_norm=self._grad_norm)
        stage = self.params.stats()  # stage 3: transfer counters of the last optimizer step
        if stage is not None:
            out["stage3"] = stage
        return out

    def trace(self, path) -> int:
        """Stage 3: write the last iteration's transfers and unit executions as Chrome/Perfetto
        JSON to ``path``; returns the number of events. Raises NotImplementedError below stage 3."""
        return self.params.trace(path)

    def _log_step(self) -> None:
        """Every ``steps_per_print`` optimizer steps, rank 0 reports the step count, skipped
        steps and learning rates, as DeepSpeed prints them; with ``wall_clock_breakdown`` also
        the last step's seconds per phase (see :func:`_progress` for where they go)."""
        n = self.config.steps_per_print
        if self.rank != 0 or not n or self.global_steps % n:
            return
        _progress("step=%d, skipped=%d, lr=%s", self.global_steps, self.skipped_steps, self.get_lr())
        if self.config.wall_clock_breakdown:
            st = self._stats
            _progress("step=%d time (s): backward %.4f, reduce %.4f, optimizer %.4f (adam %.4f, I/O wait %.4f)",
                      self.global_steps, st.get("backward_s", 0.0), st.get("reduce_s", 0.0), st.get("optimizer_s", 0.0),
                      st.get("adam_s", 0.0), st.get("io_wait_s", 0.0))

    def _new_step_stats(self) -> Dict[str, Any]:
        return {"backward_s": 0.0, "reduce_s": 0.0, "comm_elements": 0, "optimizer_s": 0.0, "adam_s": 0.0,
                "io_wait_s": 0.0, "nvme_read_bytes": 0, "nvme_write_bytes": 0, "gather_s": 0.0}
