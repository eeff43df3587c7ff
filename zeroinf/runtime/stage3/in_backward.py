"""The optimizer step of stage 3 run inside the backward (``"zeroinf": {"optimizer_in_backward": true}``).

[Note: optimizer in backward] With parameters, gradients and optimizer state on NVMe, the
overlapped step ([Note: overlapped step] in overlap.py) still writes every reduced gradient
partition to its swap file during the backward and reads it back in the step: 8 bytes per fp32
parameter on top of the optimizer state's 24, and all of the step's I/O lands in the next
forward while the backward leaves the disk mostly idle. Here each flat group is stepped as soon
as its gradient is reduced, on one background thread, while the backward goes on with the units
before it: gradients never leave host memory (and at most the partitions waiting for the thread
are held), and the optimizer state's I/O overlaps the backward. This is torchtune's
``optimizer_in_bwd`` (and ``torch.distributed.optim._apply_optimizer_in_backward``) for ZeRO-3
partitions.

What it costs: a group's update runs before the other gradients exist, so nothing that needs
all of them can come first. The config refuses gradient accumulation, gradient clipping and fp16
(its overflow check skips whole steps); a non-finite gradient is applied (as ``torch.optim.AdamW``
does) and the engine warns. The hyper-parameters (learning rate) are read when the backward
starts. A unit needed again in the same backward after its update began (a weight read by a
module whose backward runs later without a gradient for it) raises instead of seeing new
weights. The numbers are those of the synchronous step: the same Adam on the same gradients.

Flow: :meth:`BackwardStep.start` (engine.backward, before autograd runs) starts the worker, which
runs one ``SubGroupOptimizer.step`` over every sub-group in the order the gradients arrived in the
previous backward (reverse forward order at first), so its NVMe pipeline reads ahead; the
manager's reductions call the object (``grad_sink``, compute thread) with each reduced partition, and
``grad(i)`` in the worker waits for its group's. Groups that got no gradient are handed over
with zeros by :meth:`end_backward`. Each partition's share of the global gradient norm is
taken where it first lies on the host: at the hand-over on the CPU, so ``engine.step()`` has the
norm at once; on CUDA on the worker after the copy lands, so ``engine.step()`` waits until the
worker has reached the last group (untested here: no GPU). The step gate marks each group pending from its hand-over
until its new partition is stored, so the next forward's gathers wait for their own groups only.

[Note: worker threads] With the compute on the CPU, the worker's Adam ran an OpenMP team as wide
as the backward's (``torch.get_num_threads()``) on the same cores, and the backward, the step's
critical path here, slowed more than the updates gained. The worker caps its own threads at half
the count of the thread running the backward (:func:`worker_threads`, through
``limit_thread_parallelism``, which leaves every other thread's count alone). The overlapped step
([Note: overlapped step]) keeps the full count: there the update is longer than the forward it
hides behind, and the cap made that step slower. On CUDA the backward's compute is on the device,
and without the C++ ops (``ZEROINF_DISABLE_OPS=1``) there is no per-thread cap to set: nothing is
capped then.

[Note: optimizer reads in the forward] With the optimizer state on NVMe the backward is bound by
the disk: each group's update reads its moments and writes them back with its new partition,
while the forward leaves the disk idle for a good part of its time once its parameter reads have
run ahead. So the end of each backward arms a call (``manager.call_in_forward``) that, halfway
through the next grad-enabled forward, starts reading the first groups' moments for the next
backward, into the swap buffers free then (``SubGroupOptimizer.prefetch(block=False)``: it never
waits, and leaves the group whose swap-out is still in flight alone). It is skipped while the
worker still runs or after it failed; the backward's own read-ahead at :meth:`BackwardStep.start`
then does it, as before. Halfway: earlier, the reads compete with the forward's first
parameter reads, on which the forward waits; later, they may not finish before the backward's
first groups arrive. What it buys is small, as the forward has less idle disk than it seems: on
bench/stage3_step.py's in-backward step (2 vCPUs, one virtual disk; steps with and without it
alternating in one process, 10 pairs a run) the backward got ~45 ms shorter and the forward
~40 ms longer; the step was 0.5-3.6% faster in each of 7 runs, at 1/4, 1/2, 3/4 and 9/10 of
the units (best at 1/2 and 3/4).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ...optim import limit_thread_parallelism
from ..grad_norm import norm_part
from .step_cursor import SubGroupCursor

__all__ = ["BackwardStep", "OptimizerInBackwardError", "sub_group_indices", "worker_threads"]


def sub_group_indices(subs, keys: List[str]) -> List[int]:
    """Indices into ``subs`` (the glue's ``(group, lo, hi, param_group)`` sub-groups) of the flat
    groups ``keys``, group by group in that order, each group's sub-groups in their own order."""
    by_key: Dict[str, List[int]] = {}
    for i, (g, _lo, _hi, _gi) in enumerate(subs):
        by_key.setdefault(g.key, []).append(i)
    return [i for k in keys for i in by_key[k]]


def worker_threads(compute_threads: int) -> int:
    """OpenMP threads of the optimizer-in-backward worker beside a CPU backward running
    ``compute_threads`` ([Note: worker threads]): half, at least one."""
    return max(1, int(compute_threads) // 2)


class OptimizerInBackwardError(RuntimeError):
    """The model does something the optimizer in backward cannot follow (names the unit or
    group); turn ``zeroinf.optimizer_in_backward`` off for it."""


class _Cancelled(Exception):
    """The backward failed before any gradient was handed over: the step ends with nothing done."""


#: reduced gradient partitions that may wait in host memory for the worker; beyond it the
#: backward waits (host memory stays flat in model size, as with gradients on NVMe)
MAX_WAITING = 2


class BackwardStep:
    """One optimizer step run during one backward; see [Note: optimizer in backward].

    Args:
        glue: the :class:`~zeroinf.runtime.stage3.engine_glue.Stage3EngineParams` (sub-groups,
            manager).
        sub_optimizer: the engine's ``SubGroupOptimizer``.
        step: 1-based Adam step number; ``hyper``: a snapshot of the param groups'
            hyper-parameters; ``norm_type``: the engine's global-norm type (2.0 or inf).
        order: flat-group keys in the order their gradients are expected.
    """

    def __init__(self, glue, sub_optimizer, *, step: int, hyper, norm_type: float, order: List[str]):
        self.glue, self.m, self.opt = glue, glue.manager, sub_optimizer
        self.step, self.hyper, self.norm_type = step, hyper, float(norm_type)
        self.order = order
        self.handed: Set[str] = set()   # read by the manager's _request (compute thread)
        self.arrival: List[str] = []    # keys in hand-over order: the next step's expected order
        self.norms: Dict[str, float] = {}
        self.ended = False              # end_backward or abort ran: nothing more is handed over
        self.owner = threading.get_ident()  # the thread running the backward
        self._cv = threading.Condition()
        # key -> (gradient partition, its CUDA copy's event, scratch to give back, partition copy)
        self._arrived: Dict[str, Tuple[Optional[torch.Tensor], Any, Optional[torch.Tensor], Optional[torch.Tensor]]] = {}
        self._waiting = 0               # entries of _arrived that hold a gradient partition
        self._wanted: Optional[str] = None  # the key the worker waits for
        self._over = False              # the worker returned
        self._abort: Optional[BaseException] = None
        self._keys = set(order)
        self.thread: Optional[threading.Thread] = None
        self._threads: Optional[int] = None  # the backward thread's count, CPU compute only

    # --- compute thread -------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the first sub-groups' optimizer state and the worker thread; from
        here on the manager hands reduced gradients to this object."""
        subs = self.glue._subs
        indices = sub_group_indices(subs, self.order)
        self.opt.prefetch(indices)
        # [Note: worker threads] the backward runs on this thread, with this thread's count
        self._threads = torch.get_num_threads() if self.m.device.type == "cpu" else None
        self.m.step_gate.begin(())
        self.m.step_gate.before_block = self.check_can_wait
        try:
            self.thread = threading.Thread(target=self._run, args=(indices,),
                                           name="zeroinf-optimizer-in-backward")
            self.thread.start()
        except BaseException:
            self.m.step_gate.finish()  # no worker: nothing is pending
            raise
        self.m.grad_sink = self

    def inside_backward(self) -> bool:
        """Whether the calling thread is inside the backward that feeds this step (its own
        thread, or autograd's device thread running a hook): waiting for the step there would
        never end."""
        if self.ended:
            return False
        graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
        return threading.get_ident() == self.owner or graph_task != -1

    def check_can_wait(self) -> None:
        """Raise RuntimeError when :meth:`inside_backward`: every wait for this step (the step
        gate, the worker's join, the norm parts) calls it before blocking."""
        if self.inside_backward():
            raise RuntimeError(
                "zeroinf.optimizer_in_backward: cannot wait for the optimizer update from inside engine.backward "
                "(a signal handler or backward hook calling synchronize, state_dict, step, a checkpoint, ...): the "
                "update needs the rest of this backward's gradients. Do it after engine.backward returns.")

    def __call__(self, g, part: Optional[torch.Tensor], ready: Any = None,
                 recycle: Optional[torch.Tensor] = None) -> None:
        """The manager's reduction hands over group ``g``'s reduced gradient partition ``part``
        (``shard_numel`` CPU elements, training dtype or fp32; on CUDA still being copied until
        ``ready``); ``recycle``: the scratch tensor ``part`` lies in, given back once stepped.
        Waits while :data:`MAX_WAITING` partitions already wait for the worker (unless the
        worker waits for a group not handed over yet).

        Raises:
            OptimizerInBackwardError: ``g``'s gradient was reduced twice in this backward.
        """
        if g.key not in self._keys:  # frozen: no optimizer state
            if recycle is not None:
                self.m.host.give(recycle)
            return
        if g.key in self.handed:
            raise OptimizerInBackwardError(
                f"zeroinf.optimizer_in_backward: the gradient of flat group {g.key} was reduced twice in one backward "
                "(a parameter's gradient was accumulated again after its unit's reduction, e.g. by reentrant "
                "activation checkpointing); its update had already started. Turn zeroinf.optimizer_in_backward off.")
        norm = None
        if ready is None:  # on the host already: its norm part now, so engine.step() need not wait
            norm = 0.0 if part is None else norm_part(part, self.norm_type)
        master = self.glue.master_copy(g)  # [Note: master in the partitions]: no NVMe read in the step
        self.handed.add(g.key)
        self.arrival.append(g.key)
        self.m.step_gate.add(g.key)
        with self._cv:
            if norm is not None:
                self.norms[g.key] = norm
            self._arrived[g.key] = (part, ready, recycle, master)
            self._waiting += part is not None
            self._cv.notify_all()
            # back-pressure; never while the worker waits for a group still to come (deadlock)
            while (self._waiting > MAX_WAITING and not self._over and self._abort is None
                   and (self._wanted is None or self._wanted in self._arrived)):
                self._cv.wait()

    def end_backward(self) -> None:
        """After autograd returned: hand over every group that got no gradient (stepped with
        zeros, as the synchronous step does), detach from the manager, and release the persistent
        unit (the next forward gathers it after its update)."""
        for k in self.order:
            if k not in self.handed:
                self(self.glue.group_by_key[k], None)
        self.ended = True
        self.m.grad_sink = None
        self.m.step_gate.before_block = None
        self.m.persistent_updated()

    def abort(self, exc: BaseException) -> bool:
        """The backward failed with ``exc``: stop the worker. Returns True when no gradient had
        been handed over: then nothing was updated and the step ends without error; otherwise
        it fails (groups already stepped keep their new values, the others their old ones)."""
        self.ended = True
        self.m.grad_sink = None
        self.m.step_gate.before_block = None
        with self._cv:
            self._abort = exc
            self._cv.notify_all()
        if self.handed:
            # the step fails even if the worker finishes every group it got (an interrupt right
            # after autograd returned): it is not counted, and the persistent unit is not refreshed
            failure = RuntimeError("the backward failed (raised or was interrupted) after its optimizer update began")
            failure.__cause__ = exc
            self.m.step_gate.fail(failure)
        elif self.thread is None or self.thread.ident is None:  # stopped inside start(): no worker ran
            self.m.step_gate.finish()
        return not self.handed

    def norm_parts(self) -> List[float]:
        """Each group's gradient norm part (``sum |g|^p``, or ``max |g|``) in ``manager.groups()``
        order (the synchronous step's: the same float sums), waiting for those the worker
        computes (CUDA: after the copy to the host). Raises StepFailedError, or RuntimeError
        when called inside the backward that feeds the step (:meth:`check_can_wait`)."""
        self.check_can_wait()
        with self._cv:
            while len(self.norms) < len(self._keys) and self._abort is None and not self._over:
                self._cv.wait()
        missing = self._keys - set(self.norms)
        if missing:
            self.m.step_gate.wait()  # the worker failed: raises StepFailedError
            raise RuntimeError(f"zeroinf.optimizer_in_backward: no gradient norm for {sorted(missing)[:3]}")
        return [self.norms[g.key] for g in self.m.groups() if g.key in self.norms]

    # --- the worker -----------------------------------------------------------------------
    def _run(self, indices: List[int]) -> None:
        m, subs = self.m, self.glue._subs
        m.step_gate.set_worker(threading.get_ident())

        def enter(g) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
            with self._cv:
                self._wanted = g.key
                self._cv.notify_all()  # a hand-over held back may go on now
                while g.key not in self._arrived and self._abort is None:
                    self._cv.wait()
                self._wanted = None
                if self._abort is not None:
                    if not self.handed:
                        raise _Cancelled()
                    raise RuntimeError("the backward failed before every gradient was reduced") from self._abort
                part, ready, recycle, master = self._arrived.pop(g.key)
                self._waiting -= part is not None
                self._cv.notify_all()
            if part is None:
                part = m.host.take(g.shard_numel, torch.float32)
                part.zero_()
                recycle = part
            elif ready is not None:
                m.transfers.host_wait(ready)
            if g.key not in self.norms:  # CUDA: landed on the host just now
                norm = norm_part(part, self.norm_type)
                with self._cv:
                    self.norms[g.key] = norm
                    self._cv.notify_all()
            return part, self.glue.step_target(g, master), recycle

        try:
            cur = SubGroupCursor(m, subs, indices, enter=enter, store=self.glue.store_stepped)
            if self._threads is not None:
                limit_thread_parallelism(worker_threads(self._threads))
            self.opt.step(step=self.step, hyper=self.hyper, grad=cur.grad_of, out=cur.out_of, indices=indices,
                          on_done=cur.done)
        except _Cancelled:  # nothing was handed over, so nothing was stepped: the state is whole
            m.step_gate.finish()
        except BaseException as exc:  # re-raised in the caller's thread by the gate
            m.step_gate.fail(exc)
        else:
            m.step_gate.finish()
        finally:
            with self._cv:
                self._over = True
                self._cv.notify_all()
