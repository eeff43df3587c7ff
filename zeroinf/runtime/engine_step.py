"""The engine's training loop: ``forward``, ``backward`` and ``step`` with the gradient
accumulation window, the global gradient norm and the optimizer step (synchronous, overlapped
with the next forward, or run inside the backward), and the checks that refuse a loop the
engine would train wrongly. :class:`StepDriver` is a part of
:class:`zeroinf.runtime.engine.ZeroEngine`, whose constructor sets the attributes it uses; the
stage is reached through :class:`zeroinf.runtime.stage_api.StageParams` (``self.params``).
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Dict, Iterator, Optional

import torch

from . import grad_norm

__all__ = ["StepDriver"]


class StepDriver:
    """Forward, backward and step of :class:`~zeroinf.runtime.engine.ZeroEngine`."""

    def forward(self, *args, **kwargs):
        """Run the wrapped module.

        Raises:
            RuntimeError: a parameter's ``requires_grad`` changed since :func:`initialize`, or
                a trainable parameter was put into the model after it (both checked with grad
                enabled; a forward under ``torch.no_grad`` is not checked); or, at stage 3, the
                forward gave a parameter data of another shape, dtype or device
                (``p.data = t``), which stage 3 cannot keep (raised at the end of any forward
                of the model, through the engine or not).
        """
        self._check_open()
        if torch.is_grad_enabled():
            self._check_requires_grad()
            self._check_added()
        try:
            return self.module(*args, **kwargs)  # stage 3 checks dropped data at the forward's end
        except Exception:
            raise  # the forward hooks ran (always_call)
        except BaseException:  # KeyboardInterrupt, SystemExit: torch skips always_call hooks
            self.params.abort_iteration(keep_changes=True)  # [Note: interrupted forward]
            raise

    def _check_no_held_units(self, what: str = "engine.step()") -> None:
        """Raise RuntimeError, before anything is stepped, when a ``gathered_parameters`` block
        holds stage-3 units: the step (``what``: ``engine.step()``, or ``engine.backward()``
        with the optimizer in backward) updates their partitions but not the block's gathered
        copy, which the block's exit then wrote back over the update (``modifier_rank``) or the
        forwards left in the block computed with (a whole unit's
        step lost)."""
        names = self.params.held_parameter_names()
        if names:
            raise RuntimeError(
                f"zeroinf stage 3: {what} inside `with zeroinf.gathered_parameters(...)`, which holds "
                f"{', '.join(repr(n) for n in names[:5])}{', ...' if len(names) > 5 else ''} gathered: the step would "
                "update their partitions but not the block's copy, which the block's end writes back (modifier_rank) "
                "or later forwards in the block compute with. Nothing was stepped; step after the block ends")

    def _check_dropped_data(self) -> None:
        """At the step: raise RuntimeError naming the stage-3 parameters of units held on into
        the backward that a forward gave data which cannot go into their partitions
        (``p.data = t`` of another shape, dtype or device; :meth:`Stage3ParameterManager.check_dropped_data`,
        which raises for released units at the end of the forward itself)."""
        self.params.check_dropped_data()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` is an optimizer step: every ``gradient_accumulation_steps``-th
        micro-batch, or what :meth:`set_gradient_accumulation_boundary` set last."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps - self._micro_origin + 1) % self.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Decide by hand whether the next :meth:`step` is an optimizer step, instead of counting
        micro-batches (DeepSpeed's method of the same name; the value holds until set again,
        and None goes back to counting). The loss is still divided by
        ``gradient_accumulation_steps`` in :meth:`backward`, as in DeepSpeed.

        Raises:
            TypeError: ``is_boundary`` is neither a bool nor None.
            ValueError: False with ``zeroinf.optimizer_in_backward``, which steps in every backward.
        """
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary(is_boundary): expected a bool or None, got {is_boundary!r}")
        if is_boundary is False and self._in_bwd:
            raise ValueError("set_gradient_accumulation_boundary(False): zeroinf.optimizer_in_backward steps the "
                             "weights during every backward, so there is no accumulation to extend")
        self._boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside the block keep their gradients on this rank, in the parameters'
        ``.grad`` (summed there by autograd), instead of reducing them over ranks; the first
        :meth:`backward` after the block, or else the next :meth:`step`, reduces the sum (as
        ``torch.nn.parallel.DistributedDataParallel.no_sync``). The result equals reducing every
        micro-batch; with bf16/fp16 the local sum is in the parameters' dtype, not fp32.

        Raises:
            RuntimeError: at ZeRO stage 3, whose gradients are reduced unit by unit during the
                backward (DeepSpeed refuses ``no_sync`` at stages 2 and 3), or entered again
                inside itself.
        """
        if self.params.reduces_during_backward:
            raise RuntimeError("engine.no_sync(): ZeRO stage 3 reduces each unit's gradients during the backward and "
                               "frees the full gradient; accumulate with gradient_accumulation_steps instead")
        if self._in_no_sync:
            raise RuntimeError("engine.no_sync(): already inside no_sync")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def zero_grad(self) -> None:
        """Drop the module's ``.grad`` (the engine already does after each backward)."""
        for p in self.module.parameters():
            p.grad = None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the loss scale with fp16),
        then reduce this micro-batch's gradients into the fp32 accumulation buffers. Returns
        ``loss / gradient_accumulation_steps`` (``loss`` itself with ``scale_wrt_gas=False``),
        as DeepSpeed does. DeepSpeed's keywords: ``retain_graph`` is passed to autograd (a second
        backward through the same graph adds its gradients, as in plain PyTorch);
        ``scale_wrt_gas=False`` leaves out the division by ``gradient_accumulation_steps``.

        Raises:
            ValueError: ``loss`` is not a scalar tensor requiring grad.
            RuntimeError: a trainable parameter was put into the model after :func:`initialize`
                ([Note: parameters added after initialize]); or, at stage 3 with
                ``zeroinf.optimizer_in_backward``, called inside a ``zeroinf.gathered_parameters``
                block that holds parameters (:meth:`_check_no_held_units`; nothing ran).
            Exception: whatever the autograd backward raised part-way; none of its gradients
                stays (see :meth:`_drop_partial_gradients`).
        """
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("engine.backward(loss): loss must be a scalar tensor that requires grad")
        self._check_added()
        if self._in_bwd:  # it steps the partitions: not under a gathered_parameters block's copy
            self._check_no_held_units("engine.backward() with zeroinf.optimizer_in_backward")
        self._backwards += 1  # also when it raises: its gradients went through the engine
        self._counted_and_raised = None
        self._window_backwards += 1
        t0 = time.perf_counter()
        self.synchronize()  # a background step has finished by now (the forward needed its updates)
        if self._in_bwd:
            self._check_backward_step()
        elif self.is_gradient_accumulation_boundary():
            self.sub_optimizer.prefetch()  # the first sub-group's NVMe read hides behind this backward
        try:
            if self._in_bwd:
                self._start_backward_step()
            self.params.forget_raised_pass()
            scaled = loss.float()
            if self.gas > 1 and scale_wrt_gas:
                scaled = scaled / self.gas
            if self.loss_scaler is not None:
                scaled = scaled * self.loss_scaler.scale
            scaled.backward(retain_graph=retain_graph)
            if self._in_bwd:
                self.params.end_backward_step()
        except BaseException as exc:
            # optimizer in backward: with no gradient handed over yet nothing was updated and the
            # engine goes on (an OOM skipped by the caller); else some groups may be stepped
            # already and the step fails (StepFailedError from every later wait)
            if self._step.uncounted:
                self._step.abandoned()
                self.params.abort_backward_step(exc)
            elif not self._in_bwd:
                self._drop_partial_gradients(exc)
            if self._closed and isinstance(exc, Exception):
                # close() ran inside this backward (a hook, a signal handler): what failed next is
                # a consequence (at stage 3 autograd met released placeholders), and says so
                raise RuntimeError("zeroinf: engine.close() was called during this engine.backward (from a hook or "
                                   "a signal handler), so the backward could not finish; close the engine after "
                                   f"engine.backward returns ({type(exc).__name__}: {exc})") from exc
            raise
        t1 = time.perf_counter()
        self._step_stats["backward_s"] += t1 - t0
        for p in self._outside:
            p.grad = None
        if self._in_no_sync:
            self._unreduced = True
        else:
            self._reduce()
        return loss / self.gas if scale_wrt_gas and self.gas > 1 else loss

    def _drop_partial_gradients(self, exc: BaseException) -> None:
        """A backward that raised part-way left some of its gradients and not others. At stages
        0-2 they are in ``.grad`` only (the window's earlier micro-batches are reduced already):
        they are dropped, and the backward counts for nothing. At stage 3 each unit's gradient
        was reduced into the accumulation buffers as its backward finished, where it cannot be
        told from the window's others, and ``zero_grad()`` could not reach it: the next step
        would add part of the failed batch. So
        the whole window's gradients are dropped there, with a warning (with ``no_sync`` too,
        whose ``.grad`` sums the window's backwards)."""
        if self._closed:  # close() ran meanwhile (a signal handler): nothing is left to drop
            return
        if not self.params.reduces_during_backward and not self._unreduced:
            for _n, p, flag in self._requires_grad:
                if flag:
                    p.grad = None
            self._backwards -= 1
            self._window_backwards -= 1
            return
        n = self._window_backwards
        self.synchronize()
        self.params.abort_iteration()  # the failed backward's unreduced flat gradients and gathered units go too
        self._forget_gradients()
        warnings.warn(f"zeroinf: engine.backward raised part-way ({type(exc).__name__}); the gradients of this "
                      f"accumulation window ({n} backward(s)) were dropped, since the ones it had reduced cannot be "
                      "told from the window's others. The next step() without a new backward steps on none.",
                      RuntimeWarning, stacklevel=3)

    def _reduce(self) -> None:
        """Reduce the gradients in ``.grad`` into the accumulation buffers (stages 0-2; stage 3
        has reduced them during the backward)."""
        t1 = time.perf_counter()
        self._unreduced = False
        self._step_stats["comm_elements"] += self.params.reduce_gradients()
        self._step_stats["reduce_s"] += time.perf_counter() - t1

    def _check_backward_step(self) -> None:
        """``zeroinf.optimizer_in_backward``: raise RuntimeError if the previous backward's
        update was never closed by :meth:`step`. (``requires_grad`` flips were checked by the
        grad-enabled forward that made the loss.)"""
        if self._step.uncounted:
            raise RuntimeError("zeroinf.optimizer_in_backward: engine.backward() was called twice without "
                               "engine.step() between; the first backward already updated the weights, so call "
                               "engine.step() after every engine.backward()")

    def _start_backward_step(self) -> None:
        """``zeroinf.optimizer_in_backward``: start this step's optimizer update, which runs
        while the backward reduces each group's gradient ([Note: optimizer in backward])."""
        # the step number and hyper-parameters engine.step() would use (the LR schedule moves in step())
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        # set first: an interrupt anywhere below reaches backward()'s abort, which stops the worker
        self._step.start_in_backward()
        self.params.start_backward_step(self.sub_optimizer, step=self.optimizer_steps + 1, hyper=hyper,
                                        norm_type=self.config.zeroinf.grad_norm_type)

    def _check_requires_grad(self) -> None:
        """Raise if a parameter was frozen or unfrozen after :func:`initialize`.

        Raises:
            RuntimeError: naming the first such parameter. The flat buffers, sub-groups and
                optimizer state were laid out for the old flag: a weight frozen later would keep
                moving (momentum, weight decay), one unfrozen later would never train.
        """
        for name, p, flag in self._requires_grad:
            if p.requires_grad != flag:
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' had requires_grad={flag} at zeroinf.initialize and now has "
                    f"{p.requires_grad}; the engine's partitions and optimizer state are laid out for the first "
                    "setting and would train it wrongly. Set requires_grad before zeroinf.initialize "
                    "(or build a new engine; at stage 3 on a newly built model).")

    def _check_added(self) -> None:
        """Raise if a trainable parameter was put into the model after :func:`initialize`
        ([Note: parameters added after initialize]).

        Raises:
            RuntimeError: naming the first such parameter still in the model and trainable.
        """
        if not self._added:
            return
        present = {p for p in self.module.parameters()}
        for p, name in list(self._added.items()):
            if p not in present:
                del self._added[p]  # taken out again (a module swapped back)
            elif p.requires_grad:
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' ({tuple(p.shape)}) was put into the model after zeroinf.initialize "
                    "(a module or parameter assigned later: resize_token_embeddings, an adapter added to the wrapped "
                    "model); the engine's optimizer does not hold it, so it would never train. Make the change "
                    "before zeroinf.initialize (for a stage-3 model built under zeroinf.Init: inside "
                    "zeroinf.gathered_parameters(..., modifier_rank=0)), or freeze it (requires_grad=False).")

    def _check_backward_ran(self) -> None:
        """Raise if this micro-batch's gradients came from a backward outside :meth:`backward`
        (``loss.backward()``): the engine never took them, so stages 0-2 stepped without them
        (weights moved by momentum and decay alone, ``.grad`` left on every parameter) and
        stage 3 lost them from the second step on, silently. Evidence: ``.grad`` on a trainable
        parameter (the engine's backward leaves none), or stage-3 gradients reduced with no
        engine backward since the last :meth:`step`. A step with no backward at all stays valid.
        The refused gradients (and the window's others) are dropped, so they leak into no later
        step.

        Raises:
            RuntimeError: naming a parameter, or the stage-3 reduction.
        """
        reduced = self.params.reduced_since_check()
        if self._backwards:
            return
        stray = next((n for n, p, flag in self._requires_grad if flag and p.grad is not None), None)
        if stray is not None or reduced:
            what = f"parameter '{stray}' has a .grad" if stray is not None else "stage 3 reduced gradients"
            # drop them, and this accumulation window's others: the next step would add them in
            self.synchronize()  # a background step may still read the gradient partitions
            self._forget_gradients()
            raise RuntimeError(f"zeroinf: engine.step() after a backward that did not run through engine.backward(loss) "
                               f"({what}); call engine.backward(loss) instead of loss.backward(): it scales the loss, "
                               "hands the gradients to the engine and waits for a step still running. The gradients "
                               "of this accumulation window were dropped, and no step was taken")

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Count a micro-batch; at the accumulation boundary run the optimizer step, then the LR
        scheduler's ``step(**lr_kwargs)`` (DeepSpeed's keyword: ``lr_kwargs={"metrics": val_loss}``
        for ``ReduceLROnPlateau``; not after a skipped fp16 step).

        Raises:
            RuntimeError: a parameter's ``requires_grad`` changed since :func:`initialize`, or
                the micro-batch's backward ran outside :meth:`backward` (``loss.backward()``).
            FloatingPointError: fp16 gradients overflowed at ``min_loss_scale`` (see
                :class:`zeroinf.runtime.loss_scaler.LossScaler`).
            Exception: whatever the LR scheduler's ``step`` raised. The optimizer step was
                applied and counted by then (the exception says so): do not call step() again
                for this micro-batch.
            RuntimeError: step() called again, with no backward in between, after it raised
                one of the two above: the micro-batch was counted, and the retry would take
                another optimizer step (on zero gradients).
            RuntimeError: at stage 3, called inside a ``zeroinf.gathered_parameters`` block
                that holds parameters (nothing is stepped; :meth:`_check_no_held_units`).
        """
        self._check_open()
        if self._counted_and_raised is not None and not self._backwards:
            raise RuntimeError(f"zeroinf: engine.step() again after it raised ({self._counted_and_raised}) with no "
                               "engine.backward since: that micro-batch was counted already, and stepping again would "
                               f"take another optimizer step on zero gradients (step {self.global_steps}). Go on with "
                               "the next micro-batch's forward and backward.")
        self._check_requires_grad()
        self._check_backward_ran()
        self._check_dropped_data()
        sched_error = None
        if self.is_gradient_accumulation_boundary():
            self._check_no_held_units()
            self.params.adopt_replaced_data()  # [Note: weights changed between steps]
            if self._unreduced:  # no_sync() kept them to the end of the window
                self._reduce()
            try:
                self._optimizer_step()
            except FloatingPointError as exc:  # at min_loss_scale: the window was skipped and dropped, and counts
                self._count_samples()
                self._window_backwards = 0
                self._count_micro_batch()
                self._counted_and_raised = f"FloatingPointError: {exc}"[:200]
                raise
            self._count_samples()
            self._window_backwards = 0
            if self._step_applied:
                # the engine stepped on the optimizer's behalf: tell torch schedulers so (they warn otherwise),
                # also one the engine does not hold (built on the returned optimizer later)
                self.optimizer._opt_called = True
            if self._step_applied and self.lr_scheduler is not None:
                try:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
                except Exception as exc:  # raised below, once this step is counted
                    sched_error = exc
            self._stats = dict(self._step_stats)
            self._step_stats = self._new_step_stats()
            self._log_step()
        self._count_micro_batch()
        if sched_error is not None:
            self._counted_and_raised = f"the LR scheduler's step raised {type(sched_error).__name__}"
            if hasattr(sched_error, "add_note"):  # Python 3.11+
                sched_error.add_note(f"zeroinf: raised by the LR scheduler's step(**{lr_kwargs or {}!r}) after optimizer step "
                                     f"{self.global_steps}, which was applied and counted; a scheduler whose step() "
                                     "needs arguments (ReduceLROnPlateau) takes them from engine.step(lr_kwargs={...})")
            raise sched_error

    def _count_samples(self) -> None:
        """An optimizer step (applied or skipped) consumed a window: ``train_batch_size()``
        samples, or, once the caller sets the boundaries (:meth:`set_gradient_accumulation_boundary`),
        one micro-batch per rank for each backward of the window, as DeepSpeed counts them."""
        if self._boundary is None:
            self._global_samples += self.train_batch_size()
        else:
            self._global_samples += self.train_micro_batch_size_per_gpu() * self.world_size * self._window_backwards

    def _count_micro_batch(self) -> None:
        """The end of :meth:`step` (a step that raised otherwise keeps its backwards: the retry
        is not refused)."""
        self.micro_steps += 1
        self._backwards = 0
        self.params.clear_reduced_since_check()

    def _forget_gradients(self) -> None:
        """Drop every gradient not yet stepped: the accumulation buffers, ``.grad`` that
        :meth:`no_sync` kept, and the counts of backwards that made them (a checkpoint load
        does this, so a load rolls back to the saved state and nothing from before it is
        added to the next step)."""
        for _n, p, flag in self._requires_grad:
            if flag:
                p.grad = None
        self.params.zero_grad_acc()
        self._unreduced = False
        self._backwards = self._window_backwards = 0
        self.params.clear_reduced_since_check()

    def _global_norm(self, norm_type: float, local: Optional[float] = None) -> float:
        """The global gradient norm from this rank's ``local`` part (``sum |g|^p`` or ``max |g|``
        of its partitions; default: asked of the parameter manager), summed over ranks."""
        if local is None:
            value, partitioned = self.params.local_grad_norm_parts(norm_type)
        else:
            value, partitioned = local, True
        if self.world_size > 1 and partitioned:
            # on the compute device: NCCL reduces only CUDA tensors (gloo takes either)
            value = grad_norm.all_ranks(value, norm_type, device=self.params.device)
        norm = grad_norm.finish(value, norm_type)
        if self.loss_scaler is not None:
            norm = norm / self.loss_scaler.scale
        return norm

    def synchronize(self) -> None:
        """Wait for the optimizer step running in the background (stage 3 with
        ``zeroinf.overlap_step`` or ``zeroinf.optimizer_in_backward``); a no-op otherwise. Its Adam
        time and NVMe bytes are counted in the current step's :meth:`stats`, the time waited in
        ``io_wait_s``.

        Raises:
            StepFailedError: the background step failed (``__cause__`` is the original error);
                raised again by every later wait until :meth:`close`.
            RuntimeError: called inside the backward that feeds a step run in the backward
                (``zeroinf.optimizer_in_backward``: a hook or signal handler).
        """
        if not self._step.in_flight:
            return
        t0 = time.perf_counter()
        # raises a failed step's error, again at every later call; and RuntimeError inside the
        # backward that feeds a step run in the backward (waiting there would never end)
        self.params.finish_step()
        self._step.joined()
        st = self.sub_optimizer.stats
        s = self._step_stats
        s["io_wait_s"] += time.perf_counter() - t0
        s["adam_s"] += st.adam_s
        s["nvme_read_bytes"] += st.bytes_read
        s["nvme_write_bytes"] += st.bytes_written

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        if self._in_bwd:
            self._close_backward_step()
            return
        self.synchronize()
        t0 = time.perf_counter()
        cfg = self.config
        norm = self._global_norm(cfg.zeroinf.grad_norm_type)
        self._grad_norm = norm
        overflow = not math.isfinite(norm)
        at_min = None
        if self.loss_scaler is not None:
            try:
                self.loss_scaler.update(overflow)
            except FloatingPointError as exc:  # at min_loss_scale: skipped like any overflow, then raised
                at_min = exc
        self.global_steps += 1
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
            self.params.zero_grad_acc()
            self._step_stats["optimizer_s"] += time.perf_counter() - t0
            if at_min is not None:
                raise at_min
            return
        grad_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if cfg.gradient_clipping > 0:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            # Folded into the step's divisor rather than a pass over the gradients (which, on
            # NVMe, would read and rewrite every gradient partition): g / (scale / coef).
            coef = torch.tensor(cfg.gradient_clipping, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6)
            if float(coef) < 1.0:
                grad_scale = grad_scale / float(coef)
        self.optimizer_steps += 1
        self.params.adopt_changed_weights(self.sub_optimizer)  # [Note: weights changed between steps]
        # a snapshot: the LR schedule below moves on while a background step still reads it
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        s = self._step_stats
        if self._overlap:
            self.params.start_step(self.sub_optimizer, step=self.optimizer_steps, hyper=hyper, grad_scale=grad_scale)
            self._step.start_in_background()
            s["io_wait_s"] += self.params.take_step_wait_s()  # forward waits on the last update
        else:
            self.sub_optimizer.step(step=self.optimizer_steps, hyper=hyper, grad=self.params.grad,
                                    out=self.params.param_target, grad_scale=grad_scale)
            st = self.sub_optimizer.stats
            t1 = time.perf_counter()
            self.params.gather_params()
            s["gather_s"] += time.perf_counter() - t1
            self.params.zero_grad_acc()
            s["adam_s"] += st.adam_s
            s["io_wait_s"] += st.io_wait_s
            s["nvme_read_bytes"] += st.bytes_read
            s["nvme_write_bytes"] += st.bytes_written
        s["optimizer_s"] += time.perf_counter() - t0

    def _mark_weights_current(self) -> None:
        """Take the parameters as they are now for the fp32 masters' rounded values (after a
        checkpoint load wrote both), so the next step does not compare them again
        ([Note: weights changed between steps]); a no-op at stage 3."""
        self.params.mark_weights_current()

    def _close_backward_step(self) -> None:
        """engine.step() with ``zeroinf.optimizer_in_backward``: the update already runs (since
        engine.backward); count the step, record the global norm, move the LR schedule.

        Raises:
            RuntimeError: no engine.backward() since the last step, or called inside the backward
                (a hook or signal handler).
            StepFailedError: the background update failed.
        """
        if not self._step.uncounted:
            self.synchronize()  # a failed update: its StepFailedError says more than the line below
            raise RuntimeError("zeroinf.optimizer_in_backward: engine.step() needs an engine.backward() first "
                               "(the update runs inside the backward)")
        t0 = time.perf_counter()
        norm_type = self.config.zeroinf.grad_norm_type
        # may raise (inside the backward, or the update failed): the step stays open until then
        self._grad_norm = norm = self._global_norm(norm_type, self.params.backward_step_norm(norm_type))
        self._step.counted()
        if not math.isfinite(norm):
            warnings.warn(f"zeroinf.optimizer_in_backward: step {self.optimizer_steps + 1} applied gradients whose "
                          f"global norm is {norm} (the update runs during the backward, before the norm is known, "
                          "so it cannot be skipped); the weights may now hold inf/nan", RuntimeWarning,
                          stacklevel=5)  # the caller of engine.step(), through torch.no_grad's wrapper
        self.global_steps += 1
        self.optimizer_steps += 1
        self._step_applied = True
        self.params.backward_step_done()
        s = self._step_stats
        s["io_wait_s"] += self.params.take_step_wait_s()
        if not self.config.zeroinf.overlap_step:
            self.synchronize()
        s["optimizer_s"] += time.perf_counter() - t0
