"""Host<->device copies for the runtime: on named CUDA side streams with event hand-offs, or plain
copies on the CPU.

:func:`transfers_for` picks the implementation from the compute device. Both offer the same
methods, so a caller writes the hand-off once; on the CPU every event is ``None`` and every wait is
a no-op, and no ``torch.cuda`` function is called.

The hand-off protocol (``ev`` is a CUDA event, or ``None`` on the CPU):

* ``after = t.mark()`` on the compute thread, right after allocating a device buffer: the point of
  the caller's current (compute) stream after which the buffer's memory is free of earlier kernels.
* ``ready = t.h2d([(dst, src), ...], after)`` on any thread: the H2D stream waits for ``after``,
  copies ``non_blocking`` from the (pinned) host sources, and records ``ready``.
* ``t.stream_wait(ready)`` on the compute thread, before the compute uses ``dst``: an on-device wait
  (``Stream.wait_event``); the host is not blocked.
* ``t.host_wait(ready)`` on the thread that reuses a host source (the I/O thread returning a
  pinned staging buffer to its pool), or reads a host destination: blocks that thread only
  (``Event.synchronize``, which torch's sync debug mode does not count; the device never stalls).
* ``ready = t.d2h(dst, src)`` on the compute thread: the D2H stream waits for the compute stream's
  work so far, copies ``non_blocking`` into the pinned ``dst``, records ``ready``; ``src``'s device
  memory is kept from reuse until that copy is done (``Tensor.record_stream``).
* ``ready = t.d2h(dst, src, work=w, divisor=n, keep=(inp,))`` on the compute thread, right after
  launching a collective ``w`` (``async_op=True``) that writes ``src`` from ``inp``: as above, and
  before the copy the D2H stream waits for the collective (``w.wait()`` issued with the D2H stream
  current: a stream wait, the host is not blocked) and divides ``src`` by ``n`` in place; ``inp``
  is kept from reuse like ``src``. The compute stream never waits for the collective.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

__all__ = ["HostTransfers", "CudaTransfers", "transfers_for"]

Copies = Sequence[Tuple[torch.Tensor, torch.Tensor]]  # (dst, src) pairs


class HostTransfers:
    """The CPU implementation: copies run inline on the calling thread; events are ``None``.

    Attributes:
        side_streams: False: there are no side streams (callers keep their plain CPU path).
        h2d_stream, d2h_stream: None.
    """

    side_streams = False
    h2d_stream = None
    d2h_stream = None

    def mark(self) -> None:
        """No stream to mark."""
        return None

    def h2d(self, copies: Copies, after: Optional[Any] = None) -> None:
        """``dst.copy_(src)`` for each pair, now, on the calling thread."""
        for dst, src in copies:
            dst.copy_(src)
        return None

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, work: Optional[Any] = None, divisor: int = 1,
            keep: Sequence[torch.Tensor] = ()) -> None:
        """Now, on the calling thread: ``work.wait()`` (blocks until the collective is done),
        ``src.div_(divisor)`` (unless 1), ``dst.copy_(src)``. ``keep`` needs no care here."""
        if work is not None:
            work.wait()
        if divisor != 1:
            src.div_(divisor)
        dst.copy_(src)
        return None

    def stream_wait(self, ready: Optional[Any]) -> None:
        """Nothing to wait for: the copy is done."""

    def host_wait(self, ready: Optional[Any]) -> None:
        """Nothing to wait for: the copy is done."""

    def done(self, ready: Optional[Any]) -> bool:
        """Always True: copies are synchronous."""
        return True


class CudaTransfers:
    """Copies on two named side streams of one CUDA device, handed over with events.

    Args:
        device: the compute device (``cuda`` or ``cuda:<index>``).
        api: the ``torch.cuda`` module (tests pass a stand-in with the same names: ``Stream``,
            ``Event``, ``stream``, ``current_stream``, ``device``).

    Attributes:
        side_streams: True.
        h2d_stream: host -> device copies of gathered parameters (``torch.cuda.Stream``).
        d2h_stream: device -> host copies of reduced gradient shards (``torch.cuda.Stream``).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    side_streams = True

    def __init__(self, device: torch.device, api: Any = None):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaTransfers: device must be a CUDA device, got {device}")
        self._cuda = api if api is not None else torch.cuda
        self.device = device
        with self._cuda.device(device):
            self.h2d_stream = self._cuda.Stream(device=device)
            self.d2h_stream = self._cuda.Stream(device=device)

    def _event(self, stream) -> Any:
        ev = self._cuda.Event()
        ev.record(stream)
        return ev

    def _keep_alive(self, t: torch.Tensor, stream) -> None:
        """Keep ``t``'s device block from reuse until ``stream``'s work queued so far is done."""
        t.record_stream(stream)

    def mark(self) -> Any:
        """An event on the calling thread's current stream of the device (the compute stream)."""
        return self._event(self._cuda.current_stream(self.device))

    def h2d(self, copies: Copies, after: Any) -> Any:
        """Enqueue the copies on :attr:`h2d_stream` after ``after``; return their ``ready`` event.

        Each ``src`` should be pinned host memory (pageable memory makes the copy synchronous
        with the host); each ``dst`` is a device tensor, kept from reuse by the allocator until
        the copy is done even if it is freed earlier. The sources must stay untouched until
        ``ready`` completes (:meth:`host_wait`).
        """
        s = self.h2d_stream
        with self._cuda.stream(s):
            if after is not None:
                s.wait_event(after)
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
                self._keep_alive(dst, s)
            return self._event(s)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, work: Optional[Any] = None, divisor: int = 1,
            keep: Sequence[torch.Tensor] = ()) -> Any:
        """Enqueue ``dst.copy_(src)`` (dtype converted on the device) on :attr:`d2h_stream` after
        the compute stream's work so far; return its ``ready`` event. ``dst`` is pinned host
        memory, valid only after :meth:`host_wait` on the returned event.

        Args:
            work: a ``torch.distributed`` work handle (``async_op=True``) of the collective that
                writes ``src``: the D2H stream waits for it first (``work.wait()`` with the D2H
                stream current makes that stream wait on NCCL's; no host block).
            divisor: ``src`` is divided by it in place on the D2H stream before the copy (the
                average over ranks; 1: no division).
            keep: further device tensors (the collective's input) whose blocks must not be
                reused until this stream's work so far is done, like ``src``.
        """
        s = self.d2h_stream
        s.wait_stream(self._cuda.current_stream(self.device))
        with self._cuda.stream(s):
            if work is not None:
                work.wait()
            if divisor != 1:
                src.div_(divisor)
            dst.copy_(src, non_blocking=True)
            for t in (src, *keep):
                self._keep_alive(t, s)
            return self._event(s)

    def stream_wait(self, ready: Optional[Any]) -> None:
        """The calling thread's current stream waits on the device for ``ready`` (no host wait)."""
        if ready is not None:
            self._cuda.current_stream(self.device).wait_event(ready)

    def host_wait(self, ready: Optional[Any]) -> None:
        """Block the calling thread until ``ready`` has completed (other threads run on)."""
        if ready is not None:
            ready.synchronize()

    def done(self, ready: Optional[Any]) -> bool:
        """Whether ``ready`` has completed, without waiting."""
        return ready is None or bool(ready.query())


def transfers_for(device: torch.device) -> "HostTransfers | CudaTransfers":
    """:class:`CudaTransfers` for a CUDA device, :class:`HostTransfers` for anything else."""
    device = torch.device(device)
    return CudaTransfers(device) if device.type == "cuda" else HostTransfers()
