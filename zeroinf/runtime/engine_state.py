"""The engine's state leaving memory and coming back: checkpoints (:mod:`zeroinf.checkpoint`),
the 16-bit model file, ``offload_states``/``reload_states``, the stage's caches, and ``close``.
:class:`EngineState` is a part of :class:`zeroinf.runtime.engine.ZeroEngine`.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from .engine_guards import release_guard_hooks, unwatch

__all__ = ["EngineState"]


class EngineState:
    """Checkpoint glue, offloading and closing of :class:`~zeroinf.runtime.engine.ZeroEngine`."""

    def empty_partition_cache(self) -> int:
        """Free the memory stage 3 keeps between steps for speed (DeepSpeed's method of the same
        name, called e.g. before generation): NVMe partitions read ahead for the next step (their
        pinned staging buffers return to the engine's pool, which stays allocated), the recycled
        unit-sized host scratch buffers (at most 512 MiB), and on CUDA the caching allocator's
        unused blocks (``torch.cuda.empty_cache``). No parameter stays gathered between
        iterations here, so none is released. The next step reads and allocates these again.

        Returns:
            Host scratch bytes freed (0 below stage 3, which keeps no such cache).

        Raises:
            RuntimeError: the engine is closed, or (stage 3) it is called inside a forward or
                backward, or while a training forward's graph waits for its backward. Below stage 3
                there is nothing to free and it may be called anywhere.
            OSError: a read-ahead had failed; its data was never used, and nothing else changed.
        """
        self._check_open()
        freed = self.params.empty_cache()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    def offload_states(self, include=None, device=None, pin_memory: bool = True, non_blocking: bool = False,
                       *, path: Optional[str] = None) -> int:
        """Move the whole state out of memory into one file under ``path`` (default: the config's
        ``nvme_path``, else the temp folder), as DeepSpeed's method of the same name (RLHF phases):
        see :mod:`zeroinf.runtime.offload_states`. Until :meth:`reload_states` the model's forward
        and ``state_dict`` raise. ``include`` must be None (all states); ``device``,
        ``pin_memory`` and ``non_blocking`` are accepted and not read.

        Returns:
            Bytes moved out of memory.

        Raises:
            NotImplementedError: ``include`` names a subset of the states.
            RuntimeError: the engine is closed or already offloaded.
            OSError: the file cannot be written (nothing was freed).
        """
        from .offload_states import Residency, offload
        if include is not None:
            raise NotImplementedError("engine.offload_states(include=...): zeroinf offloads all states together; "
                                      "pass include=None")
        self._check_open()  # also refuses a second offload
        self.synchronize()
        self.empty_partition_cache()
        self._offloaded = offload(self, path)
        self._residency = Residency.OFFLOADED
        return self._offloaded.nbytes

    def reload_states(self, non_blocking: bool = False) -> None:
        """Read back what :meth:`offload_states` moved, bit for bit, and remove its file
        (``non_blocking`` is not read). Raises RuntimeError when nothing is offloaded, OSError
        when the file cannot be read back (see :func:`zeroinf.runtime.offload_states.reload`)."""
        from .offload_states import Residency, reload
        if getattr(self, "_residency", Residency.RESIDENT) is not Residency.OFFLOADED:
            raise RuntimeError("engine.reload_states(): nothing is offloaded (call engine.offload_states() first)")
        reload(self._offloaded)
        self._offloaded, self._residency = None, Residency.RESIDENT

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_16bit_model``: the model's state dict in its training dtype (bf16 or
        fp16 parameters; fp32 when training in fp32), full tensors, written by rank 0 to
        ``save_dir/save_filename`` (``torch.save``; a ``.safetensors`` name writes safetensors).
        Collective: every rank calls it (stage 3 gathers the partitions). At stage 3 only with
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` true, as in DeepSpeed:
        otherwise nothing is written, a warning says why, and it returns False.

        Args:
            exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

        Returns:
            True when the file was written (on rank 0; the other ranks return True too).

        Raises:
            OSError: the file cannot be written (rank 0; named).
        """
        from zeroinf.checkpoint import save_atomically
        self._check_open()
        if not self.params.saves_16bit_model:
            warnings.warn("save_16bit_model: nothing saved; at stage 3 set zero_optimization."
                          "stage3_gather_16bit_weights_on_model_save to true (or use zeroinf.checkpoint.consolidate "
                          "on a checkpoint for fp32 weights)", RuntimeWarning, stacklevel=2)
            return False
        self.synchronize()  # a background step's updates are in the partitions
        sd = self.module_state_dict(exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                save_atomically({k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}, path)
            else:
                save_atomically({k: v.detach().to("cpu") for k, v in sd.items()}, path)
        return True

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Save to ``save_dir/tag`` (tag default ``global_step{N}``); see :mod:`zeroinf.checkpoint`.
        ``save_latest``: point ``save_dir/latest`` at it; ``exclude_frozen_parameters``: leave the
        ``requires_grad=False`` parameters out (a LoRA checkpoint without its base; a load keeps
        the model's values for them). DeepSpeed's keywords. Returns the checkpoint folder.

        Raises:
            RuntimeError: between engine.backward and engine.step with
                ``zeroinf.optimizer_in_backward`` (see :meth:`_check_step_closed`).
        """
        from zeroinf import checkpoint
        self._check_open()
        self._check_step_closed("save_checkpoint")
        # stages 0-2: the weights the module holds now are the ones to save
        self.params.adopt_replaced_data()
        with torch.no_grad():
            self.params.adopt_changed_weights(self.sub_optimizer)
        return checkpoint.save(self, save_dir, tag, client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load from ``load_dir/tag`` (tag default: the ``latest`` file). Returns
        ``(path, client_state)`` like DeepSpeed, and ``(None, None)`` with a warning when tag is
        None and there is no ``latest`` file (a first run). By default the whole state, bit-exactly
        (:func:`zeroinf.checkpoint.load`); ``load_lr_scheduler_states=False`` keeps the scheduler's.
        DeepSpeed's partial loads (:func:`zeroinf.checkpoint.load_weights`):
        ``load_module_only=True`` takes the weights alone (fine-tuning from a checkpoint: the
        Adam moments, steps and schedule stay this engine's; another world size or stage loads
        too), ``load_optimizer_states=False`` the weights, step counters and (unless
        ``load_lr_scheduler_states=False``) the schedule; ``load_module_strict=False`` lets their
        keys differ from the model's.

        Raises:
            CheckpointError: see :func:`zeroinf.checkpoint.load`.
            RuntimeError: between engine.backward and engine.step with ``zeroinf.optimizer_in_backward``.
        """
        from zeroinf import checkpoint
        partial = bool(load_module_only) or not load_optimizer_states
        self._check_open(loading=not partial)  # a partial load does not mend a state left half-loaded
        self._check_step_closed("load_checkpoint")
        if partial:
            return checkpoint.load_weights(self, load_dir, tag, strict=bool(load_module_strict),
                                           counters=not load_module_only,
                                           load_lr_scheduler_states=bool(load_lr_scheduler_states))
        return checkpoint.load(self, load_dir, tag, load_lr_scheduler_states=bool(load_lr_scheduler_states))

    def _check_step_closed(self, what: str) -> None:
        """Raise RuntimeError between engine.backward and engine.step with
        ``zeroinf.optimizer_in_backward``: the weights and Adam moments are already those of the
        next step while the step counter is not, so a checkpoint would be neither step."""
        if self._step.uncounted:
            raise RuntimeError(f"zeroinf.optimizer_in_backward: {what} between engine.backward() and engine.step(): "
                               "the backward already applied the update but the step is not counted yet; call "
                               "engine.step() first")

    def close(self) -> None:
        """Wait for a background step, then release swap buffers, pinned memory, I/O threads and
        file handles, the optimizer's and (stage 3) the parameter manager's (idempotent). A stage-3
        model cannot run a forward afterwards (RuntimeError). Raises the background step's
        failure after releasing them."""
        self._closed = True
        unwatch(self)
        release_guard_hooks(self.module, self._guard_hooks)
        if self._in_bwd and self.params.in_backward_step():  # inside engine.backward (a signal handler)
            self.params.abort_backward_step(RuntimeError("engine.close() was called inside engine.backward"))
        try:
            self.synchronize()
        finally:
            try:
                self.sub_optimizer.close()
            finally:
                self.params.close()

    def _check_open(self, loading: bool = False) -> None:
        """Raise RuntimeError once :meth:`close` ran, while :meth:`offload_states` holds the state
        in its file, or (unless ``loading``) while a :meth:`load_checkpoint` that failed part-way
        left the state a mix of two."""
        if self._closed:
            raise RuntimeError("zeroinf: this engine was closed (engine.close()); its optimizer state and swap "
                               "buffers are released. Build a new engine with zeroinf.initialize (at stage 3 on a newly "
                               "built model), and save a checkpoint before closing to carry the state over.")
        if not loading:
            self.state_guard.check()
        from .offload_states import Residency
        if getattr(self, "_residency", Residency.RESIDENT) is Residency.OFFLOADED:
            raise RuntimeError("zeroinf: the engine's states are offloaded (engine.offload_states()); call "
                               "engine.reload_states() first")

    def destroy(self) -> None:
        """Alias of :meth:`close` (DeepSpeed's name)."""
        self.close()
