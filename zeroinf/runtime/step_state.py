"""Where the engine's optimizer update is: the one state behind ``engine.synchronize``,
``engine.step`` and the checks that depend on an update in flight.

An update runs in the background in two cases, both at stage 3: ``zeroinf.overlap_step`` starts
it in ``engine.step()`` and lets it run behind the next forward; ``zeroinf.optimizer_in_backward``
starts it in ``engine.backward()``, where it steps each group as its gradient is reduced, and
``engine.step()`` only counts it. Two facts follow, and each is a question the engine asks:

* is an update in flight (``engine.synchronize`` must join it before anything reads the
  weights)? :attr:`StepState.in_flight`;
* did a backward apply an update that no ``engine.step()`` has counted yet (a checkpoint or a
  second backward then would see weights of one step and counters of another)?
  :attr:`StepState.uncounted`.

The two are not independent (an uncounted update is in flight until joined), so they are one
:class:`StepPhase`, changed only by the transitions below. A transition from a phase it does not
expect raises ``RuntimeError``: that is an engine fault, not a user error.
"""
from __future__ import annotations

import enum

__all__ = ["StepPhase", "StepState"]


class StepPhase(enum.Enum):
    """``IDLE``: no update in flight, every applied update counted. ``RUNNING``: a counted update
    runs in the background. ``IN_BACKWARD``: a backward's update runs and ``engine.step()`` has not
    counted it. ``JOINED_UNCOUNTED``: that update finished (joined) and is still not counted."""

    IDLE = "idle"
    RUNNING = "running"
    IN_BACKWARD = "in backward"
    JOINED_UNCOUNTED = "joined, uncounted"


class StepState:
    """The engine's :class:`StepPhase` and its transitions (one per engine; not thread-safe: the
    engine's own thread changes it)."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = StepPhase.IDLE

    @property
    def in_flight(self) -> bool:
        """An update runs in the background: join it (``params.finish_step``) before reading
        the weights or the optimizer state."""
        return self.phase in (StepPhase.RUNNING, StepPhase.IN_BACKWARD)

    @property
    def uncounted(self) -> bool:
        """A backward applied an update that ``engine.step()`` has not counted yet."""
        return self.phase in (StepPhase.IN_BACKWARD, StepPhase.JOINED_UNCOUNTED)

    def _move(self, allowed, to: StepPhase, what: str) -> None:
        if self.phase not in allowed:
            raise RuntimeError(f"zeroinf engine: {what} in step phase '{self.phase.value}'")
        self.phase = to

    def start_in_background(self) -> None:
        """``engine.step()`` with ``overlap_step`` started a counted update: IDLE -> RUNNING."""
        self._move((StepPhase.IDLE,), StepPhase.RUNNING, "an overlapped step started")

    def start_in_backward(self) -> None:
        """``engine.backward()`` with ``optimizer_in_backward`` started an update: IDLE -> IN_BACKWARD."""
        self._move((StepPhase.IDLE,), StepPhase.IN_BACKWARD, "a step in the backward started")

    def joined(self) -> None:
        """The update in flight finished and was joined: RUNNING -> IDLE, IN_BACKWARD ->
        JOINED_UNCOUNTED. A failed update raises in the join before this, so its phase stays and
        every later join raises again."""
        if self.phase is StepPhase.RUNNING:
            self.phase = StepPhase.IDLE
        else:
            self._move((StepPhase.IN_BACKWARD,), StepPhase.JOINED_UNCOUNTED, "an update was joined")

    def counted(self) -> None:
        """``engine.step()`` counted the backward's update: IN_BACKWARD -> RUNNING (it may still
        run), JOINED_UNCOUNTED -> IDLE."""
        self._close_uncounted("an update was counted")

    def abandoned(self) -> None:
        """The backward that runs the update raised: the update is never counted (the step fails
        or, with no group stepped yet, ends without change; the join says which). Same moves as
        :meth:`counted`."""
        self._close_uncounted("an update was abandoned")

    def _close_uncounted(self, what: str) -> None:
        if self.phase is StepPhase.IN_BACKWARD:
            self.phase = StepPhase.RUNNING
        else:
            self._move((StepPhase.JOINED_UNCOUNTED,), StepPhase.IDLE, what)
