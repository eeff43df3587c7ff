"""Trace-then-schedule prefetch.

The first iteration (forward + backward) of each kind records the order in which units are
requested: ``(unit index, phase)`` with phase ``"fwd"`` or ``"bwd"``. Kinds are keyed by
``torch.is_grad_enabled()`` at the forward, so an eval forward under ``no_grad`` keeps its own
trace and never disturbs the training trace. Later iterations follow the trace: each request
advances a cursor, and the units next in the trace are gathered ahead of use, bounded by
``stage3_prefetch_bucket_size`` (elements in flight ahead) and ``stage3_max_live_parameters``.

A request that differs from the trace (a conditional branch, a different generate length), or an
iteration that ends before its trace does, is a divergence: everything prefetched and not yet
used is released, the rest of the iteration is served on demand, the new order is recorded and
replaces the old trace, and a warning is issued once per kind of divergence.
"""
from __future__ import annotations

import bisect
import itertools
import warnings
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Set, Tuple

__all__ = ["PrefetchScheduler"]

Entry = Tuple[int, str]


class _Prefetched:
    """Indices of the units gathered ahead, with their elements summed as they come and go
    (``numel``): :meth:`PrefetchScheduler.schedule` read the sum at every request. Only
    ``add``, ``discard`` and ``clear`` change it (a set subclass would let its other
    mutators put the sum out of step)."""

    def __init__(self, numel_of: Callable[[int], int]):
        self._indices: Set[int] = set()
        self.numel_of, self.numel = numel_of, 0

    def __contains__(self, index: object) -> bool:
        return index in self._indices

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)

    def add(self, index: int) -> None:
        if index not in self._indices:
            self.numel += self.numel_of(index)
            self._indices.add(index)

    def discard(self, index: int) -> None:
        if index in self._indices:
            self.numel -= self.numel_of(index)
            self._indices.discard(index)

    def clear(self) -> None:
        self._indices.clear()
        self.numel = 0


class PrefetchScheduler:
    """Decides what to gather ahead and what to keep; the manager does the moving.

    Args:
        manager: the :class:`~zeroinf.runtime.stage3.manager.Stage3ParameterManager`; used
            through ``units``, ``live_numel``, ``issue(unit)``, ``release(unit)``,
            ``is_pinned(unit)`` and ``stats``.
        prefetch_bucket_size: elements that may be in flight ahead of use (0: no prefetch).
        max_live_parameters: bound on gathered elements.
        max_reuse_distance: a unit requested again within this many elements is kept.
    """

    def __init__(self, manager, prefetch_bucket_size: int, max_live_parameters: int, max_reuse_distance: int):
        self.m = manager
        self.bucket = prefetch_bucket_size
        self.max_live = max_live_parameters
        self.max_reuse = max_reuse_distance
        self.traces: Dict[Hashable, List[Entry]] = {}
        self.key: Hashable = None
        self.trace: Optional[List[Entry]] = None
        self.pos = 0
        self.record: List[Entry] = []
        self.diverged = False
        self.active = False
        self.prefetched = _Prefetched(lambda i: manager.units[i].numel)
        # of the trace being followed: each unit's positions in it, and the elements requested
        # before each position (prefix sums), so _requested_within needs no scan
        self._indexed: Optional[List[Entry]] = None
        self._positions: Dict[int, List[int]] = {}
        self._prefix: List[int] = [0]
        # schedule() found every entry in [pos, _scan_from) gathered, in flight or persistent;
        # a release lowers it to that unit's next position (unit_released)
        self._scan_from = 0
        self.traces_recorded = 0
        self._warned: Set[str] = set()

    # --- iteration boundaries -------------------------------------------------------------
    def begin(self, key: Hashable) -> None:
        self.key, self.trace = key, self.traces.get(key)
        self.pos, self.record, self.diverged, self.active = 0, [], False, True
        self._scan_from = 0

    @property
    def following(self) -> bool:
        return self.active and self.trace is not None and not self.diverged

    def end(self) -> None:
        """Close the iteration: store a fresh trace if none was followed to its end."""
        if not self.active:
            return
        if self.following and self.pos != len(self.trace):
            self._diverge("iteration-ended-early",
                          f"the iteration ended after {self.pos} of {len(self.trace)} recorded unit requests")
        if self.trace is None or self.diverged:
            self.traces[self.key] = list(self.record)
            self.traces_recorded += 1
        self.drop_prefetched()
        self.active = False

    def abort(self) -> None:
        """Drop the iteration unrecorded (an interrupted forward): what it prefetched is
        released, and the trace stays as it was."""
        self.drop_prefetched()
        self.active = False

    # --- requests -------------------------------------------------------------------------
    def on_request(self, unit, phase: str) -> bool:
        """Note a request; returns True when the unit was prefetched for it."""
        entry = (unit.index, phase)
        if self.active:
            self.record.append(entry)
        if self.following:
            if self.pos < len(self.trace) and self.trace[self.pos] == entry:
                self.pos += 1
            else:
                exp = self.trace[self.pos] if self.pos < len(self.trace) else None
                want = f"{self.m.units[exp[0]].name} ({exp[1]})" if exp else "the end of the trace"
                self._diverge("other-unit" if exp else "past-the-end",
                              f"expected {want}, got {unit.name} ({phase})")
        hit = unit.index in self.prefetched
        self.prefetched.discard(unit.index)
        return hit

    def _diverge(self, cause: str, text: str) -> None:
        """A divergence. ``cause`` is its kind ("other-unit", "past-the-end",
        "iteration-ended-early"), not the units involved: a model whose order changes on
        purpose (LayerDrop, routing) would otherwise warn anew for every pair of units."""
        self.diverged = True
        self.m.stats.add("invalidations")
        if cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(f"zeroinf stage 3: unit order differs from the recorded trace ({text}); "
                          "serving on demand and recording a new trace. This warning is shown once per kind of "
                          "divergence; engine.stats()['stage3'] counts them all as invalidations.",
                          RuntimeWarning, stacklevel=3)
        self.drop_prefetched()
        if self.m._staged:
            self.m.drop_staged()

    def drop_prefetched(self) -> None:
        """Release every unit gathered ahead that has not been used yet (staged NVMe reads
        stay: they cost no live parameters and are dropped when the partitions change)."""
        for idx in sorted(self.prefetched):
            u = self.m.units[idx]
            if not self.m.is_pinned(u):
                self.m.release(u)
        self.prefetched.clear()

    def schedule(self) -> None:
        """Gather the next units of the trace ahead of use, within the bucket and live bounds."""
        if not self.following or self.bucket <= 0:
            return
        ahead = self.prefetched.numel
        trace, k = self.trace, max(self.pos, self._scan_from)
        while k < len(trace):
            idx, phase = trace[k]
            u = self.m.units[idx]
            if u.persistent or u.state.value != "released":
                k += 1
                continue
            if self.m.step_gate.pending(g.key for g in u.groups):
                break  # its update from the background step is not stored yet: no read ahead of it
            if ahead + u.numel > self.bucket or self.m.live_numel + u.numel > self.max_live:
                break
            self.m.issue(u, for_backward=phase == "bwd")
            self.prefetched.add(idx)
            ahead += u.numel
            k += 1
        self._scan_from = k
        # NVMe reads run further ahead, into staging buffers, while buffers are free
        for idx, _phase in itertools.islice(trace, k, None):
            u = self.m.units[idx]
            if u.persistent or u.state.value != "released" or idx in self.m._staged:
                continue
            if not self.m.stage(u):
                break

    def hold_for_next_use(self, unit) -> bool:
        """Keep ``unit``, gathered and done with, as prefetched for its next request when that
        request comes within ``stage3_prefetch_bucket_size`` elements of requests from here (the
        forward's last blocks, requested again first by the backward): released, it would be
        read again at once. Returns True when held. Held units count in the bucket of
        :meth:`schedule` (which then gathers that much less ahead) and are released like any
        prefetched unit on a divergence or at the end of the iteration; they are live already,
        so ``stage3_max_live_parameters`` is not exceeded."""
        if self.bucket <= 0 or unit.persistent or not self._requested_within(unit, self.bucket):
            return False
        self.prefetched.add(unit.index)
        return True

    def keep_after_use(self, unit) -> bool:
        """True when ``unit`` is requested again within ``max_reuse_distance`` elements."""
        return self._requested_within(unit, self.max_reuse)

    def _requested_within(self, unit, limit: int) -> bool:
        """Whether the followed trace requests ``unit`` again after at most ``limit`` elements of
        other requests from the cursor on (O(log n): a scan per request made a forward of n
        units O(n²), 1.7 s for 500 tiny units)."""
        if not self.following:
            return False
        j = self._next_position(unit)
        return j is not None and self._prefix[j] - self._prefix[self.pos] <= limit

    def _next_position(self, unit) -> Optional[int]:
        """The first position at or after the cursor where the followed trace requests ``unit``."""
        if self._indexed is not self.trace:
            self._positions, self._prefix = {}, [0]
            for i, (idx, _phase) in enumerate(self.trace):
                self._positions.setdefault(idx, []).append(i)
                self._prefix.append(self._prefix[-1] + self.m.units[idx].numel)
            self._indexed = self.trace
        at = self._positions.get(unit.index, ())
        j = bisect.bisect_left(at, self.pos)
        return at[j] if j < len(at) else None

    def unit_released(self, unit) -> None:
        """``unit`` was released: :meth:`schedule` looks at its next request again."""
        if self.following and self._scan_from > self.pos:
            j = self._next_position(unit)
            if j is not None and j < self._scan_from:
                self._scan_from = j
