"""The optimizer step of stage 3 overlapped with the next forward.

[Note: overlapped step] With parameters and optimizer state off the device, the step moves
~12 bytes per parameter each way (fp32 master, ``exp_avg``, ``exp_avg_sq``; 8 when the fp32
partitions are the masters, [Note: master in the partitions] in engine_glue.py) plus the
gradient and the new parameters. Nothing in the next forward needs unit *k*'s new parameters before the
forward reaches unit *k*, so the engine hands the step to one background thread that updates the
flat groups in forward order (``manager.groups()`` order: persistent, root, blocks) and marks each
group done once its new partition is stored. The forward's gathers wait only for their own
groups (:meth:`StepGate.wait`); the prefetcher does not run ahead into groups still pending.
The global gradient norm, and with it the clipping coefficient, is known before the hand-off
(ZeRO-Offload's delayed update, Ren et al. 2021 §4.3, would use stale gradients instead; this
keeps the step exact: same numbers as a synchronous step).

Anything that reads or writes partitions or optimizer state outside a gather (checkpoints, the
module's ``state_dict``, ``gathered_parameters``, the next optimizer step, ``close``) waits for
the whole step first; an exception in the background thread is re-raised there, in the caller's
thread, and every later wait raises it again until the engine is closed.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional, Sequence, Set, Tuple

import torch

from .step_cursor import SubGroupCursor

if TYPE_CHECKING:  # annotations only
    from .units import FlatGroup

__all__ = ["StepGate", "StepFailedError", "run_overlapped_step"]

_WHOLE_STEP = object()  # pending until the worker returns: its optimizer state I/O is done too


class StepFailedError(RuntimeError):
    """The background optimizer step failed; ``__cause__`` is the original exception. Partitions
    whose update had not finished hold their old values: do not continue training from them."""


class StepGate:
    """Which flat groups (by key) still wait for their update from the background step.

    Thread-safe. ``wait_s`` accumulates the seconds callers blocked in :meth:`wait` (read and
    reset with :meth:`take_wait_s`).
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._pending: Set[str] = set()
        self._error: Optional[BaseException] = None
        self._worker: Optional[int] = None  # thread ident of the step's worker: it never waits on itself
        self._starter: Optional[int] = None  # the thread starting the worker, until :meth:`started`
        self._thread: Optional[threading.Thread] = None  # that worker
        #: called before a wait blocks; raises when blocking could never end (the optimizer in
        #: backward sets it while the backward that feeds its step runs: BackwardStep.check_can_wait)
        self.before_block: Optional[Callable[[], None]] = None
        self.wait_s = 0.0

    def begin(self, keys: Iterable[str], worker: Optional[int] = None) -> None:
        """Mark ``keys`` pending (the step is about to start), and the step as a whole until
        :meth:`finish`. Raises a previous step's error."""
        with self._cv:
            self._raise()
            self._pending = set(keys) | {_WHOLE_STEP}
            self._worker = worker

    def add(self, key: str) -> None:
        """Mark group ``key`` pending within a step already begun (the optimizer in backward hands
        groups over one by one, as their gradients are reduced). Raises a previous step's error."""
        with self._cv:
            self._raise()
            self._pending.add(key)

    def set_worker(self, ident: int) -> None:
        with self._cv:
            self._worker = ident

    def starting(self, thread: threading.Thread) -> None:
        """The calling thread is about to start ``thread``, the worker of a step about to begin:
        a wait on this thread before ``thread`` runs (a signal handler calling ``engine.close()``
        while it is being started) would never end, and fails the step instead."""
        with self._cv:
            self._starter, self._thread = threading.get_ident(), thread

    def started(self) -> None:
        """The worker thread is running (or the start raised: then :meth:`fail` too)."""
        with self._cv:
            self._starter = None

    def done(self, key: str) -> None:
        """Group ``key`` has its new values in its home tier."""
        with self._cv:
            self._pending.discard(key)
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The step failed: wake every waiter with ``exc``. The first failure is kept: a later one
        is its consequence (the backward that feeds a step in the backward fails because the step
        did, or the worker stops because the backward did), and every later wait names the cause."""
        with self._cv:
            if self._error is None:
                self._error = exc
            self._pending.clear()
            self._cv.notify_all()

    def finish(self) -> None:
        """The worker ended normally: nothing is pending any more."""
        with self._cv:
            self._pending.clear()
            self._worker = None
            self._cv.notify_all()

    def idle(self) -> bool:
        """Whether no step is running or pending and none failed: the optimizer state is the
        caller's (the worker returned)."""
        with self._cv:
            return not self._pending and self._error is None

    def pending(self, keys: Optional[Iterable[str]] = None) -> bool:
        """Whether any of ``keys`` (default: any group) still waits for its update."""
        with self._cv:
            if keys is None:
                return bool(self._pending)
            return any(k in self._pending for k in keys)

    def wait(self, keys: Optional[Iterable[str]] = None) -> None:
        """Block until ``keys`` are updated, or with ``keys=None`` until the whole step has
        finished (its optimizer-state swaps included). A no-op on the worker thread itself.

        Raises:
            StepFailedError: the background step failed (chained to its exception).
            RuntimeError: from :attr:`before_block`, when blocking here could never end.
        """
        if threading.get_ident() == self._worker:
            return
        keys = None if keys is None else list(keys)
        with self._cv:
            if self._starter == threading.get_ident() and self._pending and not self._thread.is_alive():
                # the worker that would end this wait is not started, and only this thread starts it
                self._error = self._error or RuntimeError("the background optimizer step was interrupted before "
                                                          "its thread started (a signal handler waited for it)")
                self._pending.clear()
                self._cv.notify_all()
            t0 = None
            while self._error is None and (self._pending if keys is None else
                                           any(k in self._pending for k in keys)):
                if t0 is None:
                    check = self.before_block
                    if check is not None:
                        check()
                    t0 = time.perf_counter()
                self._cv.wait()
            if t0 is not None:
                self.wait_s += time.perf_counter() - t0
            self._raise()

    def take_wait_s(self) -> float:
        with self._cv:
            s, self.wait_s = self.wait_s, 0.0
            return s

    def _raise(self) -> None:
        if self._error is not None:
            # str(), not repr(): an OSError's repr leaves out its file name
            raise StepFailedError(f"the background optimizer step failed: {type(self._error).__name__}: "
                                  f"{self._error}") from self._error


def run_overlapped_step(m, sub_optimizer, subs: Sequence[Tuple[Any, int, int, int]], *, step: int, hyper,
                        grad_scale: float, read_master_ahead: Callable, step_target: Callable,
                        store_stepped: Callable) -> threading.Thread:
    """Start ``sub_optimizer``'s step over every sub-group on a background thread and return
    the thread ([Note: overlapped step]). ``m``: the :class:`Stage3ParameterManager`; ``subs``:
    ``(flat group, lo, hi, param group)`` per sub-group, in forward order; ``read_master_ahead(g)``,
    ``step_target(g, master)`` and ``store_stepped(g, target)``: where a group's partition is
    read, stepped and stored (:class:`~zeroinf.runtime.stage3.engine_glue.Stage3EngineParams`).
    Each group, once stored, has its gradient cleared and is released to the forward's gathers
    (``m.step_gate``); an exception in the thread is re-raised by the gate's waits.

    Raises:
        RuntimeError: the thread could not be started (the gate fails, so no wait blocks for good).
    """
    groups = list(dict.fromkeys(g for g, _lo, _hi, _gi in subs))  # forward order, unique
    following = {a.key: b for a, b in zip(groups, groups[1:])}  # the group stepped after each
    on_nvme = m.options.grads_on_nvme
    ahead: Dict[str, Any] = {}  # the next group's gradient read, in flight on the I/O thread

    def read_grad(g: FlatGroup):
        if not on_nvme:
            return None
        # in the dtype the file holds (bf16 after one micro-batch of bf16 training): fewest bytes
        t = m.host.take(g.shard_numel, m.grad_file_dtype(g))
        return t, m.submit_io(m.read_grad_raw, g, t)

    def read(g: FlatGroup):  # the gradient and (partition = master) the partition, on the I/O thread
        return read_grad(g), read_master_ahead(g)

    def enter(g: FlatGroup) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        grad_read, master_read = ahead.pop(g.key, None) or read(g)
        nxt = following.get(g.key)
        if nxt is not None:
            ahead[nxt.key] = read(nxt)
        if grad_read is not None:
            t, fut = grad_read
            fut.result()
        else:
            t = g.grad_shard if g.grad_shard is not None else torch.zeros(g.shard_numel, dtype=torch.float32)
        master = None
        if master_read is not None:
            master, fut = master_read
            fut.result()
        return t, step_target(g, master), t if on_nvme else None  # the read's scratch goes back

    def finished(g: FlatGroup) -> None:  # the stepped group's gradient is spent
        if on_nvme:
            g.grad_on_nvme = False
            g.grad_norm_part = None
        else:
            g.drop_grad_shard()

    cur = SubGroupCursor(m, subs, range(len(subs)), enter=enter, store=store_stepped, finished=finished)

    def run() -> None:
        m.step_gate.set_worker(threading.get_ident())
        try:
            sub_optimizer.step(step=step, hyper=hyper, grad=cur.grad_of, out=cur.out_of, grad_scale=grad_scale,
                               on_done=cur.done)
        except BaseException as exc:  # re-raised in the caller's thread by the gate
            for reads in ahead.values():
                for r in reads:
                    if r is not None:
                        r[1].exception()  # let the read in flight finish before its tensor goes
            m.step_gate.fail(exc)
            return
        m.step_gate.finish()

    # not a daemon: the interpreter joins it before tearing down. A daemon thread still in the
    # C++ Adam op at exit was killed mid-frame ("terminate called without an active exception",
    # exit code 134, when a script ends right after engine.step() without engine.close())
    worker = threading.Thread(target=run, name="zeroinf-optimizer-step")
    m.step_gate.starting(worker)
    m.step_gate.begin(g.key for g in groups)
    try:
        worker.start()
    except BaseException as exc:  # nothing runs the step: its waits raise instead of blocking for good
        m.step_gate.fail(exc)
        raise
    finally:
        m.step_gate.started()
    return worker
