"""Where a stage-3 iteration is, and the backward passes that run through its graph.

[Note: backward passes] Autograd runs a forward's graph in passes: ``loss.backward()`` (the
engine's backward) accumulates gradients into the parameters, ``torch.autograd.grad`` returns
them and accumulates nothing, and a graph kept with ``retain_graph=True`` may be run again. The
manager sees a pass through its hooks only: the first of them that fires while no pass runs
begins a :class:`BackwardPass` and queues its end on that hook's autograd graph task
(``queue_callback``); graph tasks started inside it (reentrant activation checkpointing's
backward of a block) belong to it. A pass that raised part-way never reaches its end: the next
forward, or ``engine.backward`` (``forget_raised_pass``), drops it. Within a pass a unit's
gradient is reduced once every parameter whose gradient the graph task accumulates has it
(``Stage3ParameterManager._grads_expected``: a parameter the forward never read, an adapter
switched off, is in no graph and expected by none); at its end a pass reduces whatever it
accumulated that is not reduced yet (a parameter whose accumulation ran with no gradient, every
path back to it having returned None). A pass that accumulated gradients, or freed its graph, ends the iteration; one that only computed
gradients (``autograd.grad``) and kept its graph leaves it open for the backward to come, so
that backward is the iteration's and its gradients are reduced at its own end. A pass run with
``create_graph=True`` records a graph whose nodes saved gathered parameters as they are (the
saved-tensor hooks of the forward are not active in a backward), so every unit it used stays
gathered until the iteration ends.

A unit's gradient of the running pass is a :class:`GradState`; the iteration as a whole is an
:class:`IterationPhase`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["IterationPhase", "GradState", "BackwardPass", "UnitCall"]


class IterationPhase(enum.Enum):
    """Where the iteration is between passes: ``IDLE`` (none open), ``OPEN`` (forwards ran, none
    of them hooked outputs for a backward: submodules called on their own), ``AWAITING_BACKWARD``
    (a forward hooked its outputs; the backward that accumulates their gradients has not run)."""

    IDLE = "idle"
    OPEN = "open"
    AWAITING_BACKWARD = "awaiting backward"


class GradState(enum.Enum):
    """A unit's gradient in the running pass: ``NONE`` (no parameter's gradient arrived),
    ``PARTIAL`` (some arrived, summed in its groups' ``grad_full``), ``REDUCED`` (every trainable
    parameter's arrived and the reduction was launched; a parameter accumulated again in the same
    pass, a block called twice under reentrant checkpointing, makes it ``PARTIAL`` again)."""

    NONE = "none"
    PARTIAL = "partial"
    REDUCED = "reduced"


@dataclass(eq=False)
class BackwardPass:
    """One pass of autograd through the iteration's graph (see [Note: backward passes]).

    Attributes:
        derives: run with ``create_graph=True`` (grad mode on inside the backward).
        keeps_graph: run with ``retain_graph=True``: the graph may be run again.
        accumulated: a managed parameter's gradient was accumulated in it.
    """

    derives: bool
    keeps_graph: bool
    accumulated: bool = False


class UnitCall:
    """One grad-enabled forward call of a unit with ``inputs`` tensors that require grad: in a
    pass its backward is over once that pass computed each input's gradient (``left`` counts
    down, reset at every pass). ``live`` is False once no pass can run through it (its graph was
    dropped, or its iteration ended)."""

    __slots__ = ("unit", "inputs", "left", "live")

    def __init__(self, unit, inputs: int):
        self.unit, self.inputs, self.left, self.live = unit, inputs, inputs, True
