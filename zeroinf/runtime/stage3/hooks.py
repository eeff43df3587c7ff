"""Stage 3 hooks: installation, and the forward hooks of the model and its units."""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import List

import torch
from torch.utils._pytree import tree_flatten

from .passes import IterationPhase, UnitCall
from .units import Unit, UnitState
from .foreign import _ForeignAccessMode, _RecomputeMode, _shallow_args
from .released import hide_from_dynamo


def _pre_accumulate(manager_ref, unit_index: int, grad: torch.Tensor) -> None:
    """A parameter's gradient hook: :meth:`Stage3ParameterManager._pre_accumulate`, through a
    weak reference (see ``_remove_param_hooks``)."""
    m = manager_ref()
    if m is not None:
        m._pre_accumulate(m.units[unit_index], grad)


def _post_accumulate(manager_ref, param: torch.Tensor) -> None:
    """A parameter's post-accumulate hook, through a weak reference (see ``_remove_param_hooks``)."""
    m = manager_ref()
    if m is not None:
        m._post_accumulate(param)


class _GraphToken:
    """Lives in an autograd node's metadata; see :meth:`Stage3ParameterManager._note_graph`."""

    __slots__ = ("__weakref__",)


def _graph_dropped(manager_ref, calls: List[UnitCall], generation: int) -> None:
    """A forward's graph is gone with its backward not run (the finalizer of its token, see
    :meth:`Stage3ParameterManager._note_graph`). Nothing to do once the iteration ended
    (``_end_iteration`` cleared every count) or the manager is gone."""
    m = manager_ref()
    if m is not None and m._generation == generation:
        m._inputs_never_come(calls)
        m._graphs_alive -= 1
        if m._graphs_alive == 0 and m._idle():
            # no forward of the iteration can be run backward any more: the units it kept gathered
            # for that backward go (in-place edits to them would be discarded by the step), the persistent one too; the iteration stays open, so a next grad-enabled
            # forward still joins it and follows the trace
            for u in m.units:
                if u.state is not UnitState.RELEASED and (u.persistent or not m.is_pinned(u)):
                    m.release(u)


class HooksMixin:
    """Module and parameter hooks, and the forward side of an iteration."""

    def _install_hooks(self) -> None:
        hide_from_dynamo()  # the hooks mark parameters gathered and released
        root = self.module
        for u in self.units[2:]:
            self._handles.append(u.module.register_forward_pre_hook(
                lambda m, a, kw, u=u: self._pre_forward(u, a, kw), with_kwargs=True))
            self._handles.append(u.module.register_forward_hook(lambda m, a, o, u=u: self._post_forward(u, o),
                                                                always_call=True))
        # [Note: entry modules] the model's forward is one way in; a submodule called on its
        # own is another (Hugging Face's inner model, a head, peft's generate() calling the
        # wrapped model's): DeepSpeed hooks every module, so these work there. Here every module
        # may open the forward when none is running (one inside a unit, a block's MLP probed on
        # its own, gathers its unit as a foreign read);
        # inside a forward (or a backward, or with a backward pending) only the model does.
        for mod in root.modules():
            self._handles.append(mod.register_forward_pre_hook(self._entry_pre, prepend=True))
            self._handles.append(mod.register_forward_hook(self._entry_post, always_call=True))
        me = weakref.ref(self)  # see _remove_param_hooks: the hooks reach the manager weakly
        for u in self.units:
            for g in u.groups:
                for s in g.slots:
                    if s.param.requires_grad:
                        self._param_hooks.append(s.param.register_hook(functools.partial(_pre_accumulate, me, u.index)))
                        self._param_hooks.append(s.param.register_post_accumulate_grad_hook(
                            functools.partial(_post_accumulate, me)))

    def _remove_param_hooks(self) -> None:
        """Remove the parameters' gradient hooks. close() does: torch does not show a tensor's
        hooks to Python's cycle collector while C++ also holds the tensor, so a parameter ->
        hook -> manager -> parameter cycle kept the model, its partitions and every buffer of a
        closed engine alive until exit (2 GB per closed 100M-parameter engine with CPU tiers).
        The hooks hold the manager weakly and their unit by index, so an engine dropped without
        close() is collected too (otherwise each dropped engine keeps its memory, a thread, a
        descriptor and 1.3 MB of locked memory kept per dropped 3.2M-parameter engine)."""
        for h in self._param_hooks:
            h.remove()
        self._param_hooks.clear()

    def remove_hooks(self) -> None:
        """Detach from the module (parameters stay partitioned)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._remove_param_hooks()


    def _entry_pre(self, module, args) -> None:
        """Forward pre-hook of every entry module ([Note: entry modules])."""
        # with a forward's graph alive (its backward may come), a grad-enabled call joins its
        # iteration as the model's second forward would ([Note: several forwards, one
        # backward]; skipped, its weights would not be hooked and their gradients would be lost), and a no-grad call computes on what is gathered;
        # once every such graph is dropped, a call opens its own forward
        if module is not self.module and (not self._idle() or (self._graphs_alive and not torch.is_grad_enabled())):
            return
        self._check_open()
        if self._ctx is not None:  # the last forward was interrupted past its post-hook
            self.abort_iteration()
        # set before opening: a pre-hook that raises after the contexts opened still gets its
        # post-hook (always_call), which closes them (a failed read left the mode on: the
        # keyboard-interrupt test saw it from an earlier test)
        self._entry = module
        self._root_pre_forward(module, args)

    def _entry_post(self, module, args, output):
        """Forward hook of every entry module: closes the forward the same module opened."""
        if self._entry is not module:
            return None
        self._entry = None
        output = self._root_post_forward(module, args, output)
        # here, not only in engine.forward: a forward of the model called directly (generate())
        # said nothing, and the next engine(x) raised for it
        self.check_dropped_data()
        return output

    def check_dropped_data(self) -> None:
        """Raise RuntimeError naming the parameters a forward gave data that cannot go into their
        partitions (``p.data = t`` of another shape, dtype, layout or device: ``dropped_data``),
        and forget them; a same-shape change is kept ([Note: changes in a forward]). The unit's
        release dropped the data, so the forward computed with weights the optimizer never
        saw. Called at the end of a forward (released units) and at the step (units held on
        into the backward)."""
        if not self.dropped_data:
            return
        names = sorted(set(self.dropped_data))
        self.dropped_data.clear()
        raise RuntimeError(
            f"zeroinf stage 3: the forward gave {', '.join(repr(n) for n in names[:5])}{', ...' if len(names) > 5 else ''} "
            "data of another shape, dtype, layout or device (p.data = t); a stage-3 parameter keeps the shape and dtype it was "
            "partitioned with, so that change was dropped when its unit was released and this forward's result does "
            "not match the weights being trained (a change of the same shape and dtype is kept). Change weights "
            "between steps inside `with zeroinf.gathered_parameters(params, modifier_rank=0):`, or train at stages "
            "0-2")

    def _root_pre_forward(self, module, args):
        """Open the forward of the entry module ``module`` (after :meth:`_entry_pre` checked the
        engine is open and aborted a forward interrupted past its post-hook)."""
        with self.busy():
            # a pass still recorded here raised before its end (no callback ran): its iteration
            # ends unrecorded (its trace stopped part-way); one this forward does not continue (no
            # backward came) ends as usual
            if self._pass is not None:
                self.scheduler.abort()
                self._end_iteration()
            elif self._phase is not IterationPhase.IDLE and not self._continues_iteration():
                self._end_iteration()
            self._calls = []
            if self._phase is IterationPhase.IDLE:
                self._phase = IterationPhase.OPEN
                self._forwards_in_iteration = 0
                self._submodule_forwards = 0
                self.scheduler.begin(torch.is_grad_enabled())
            if module is self.module:
                self._forwards_in_iteration += 1
            else:
                self._submodule_forwards += 1
            self._fwd_units_done = 0
            self._t_iter = self.tracer.now()
            ctx = contextlib.ExitStack()
            ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            ctx.enter_context(_ForeignAccessMode(self))
            self._ctx = ctx
            if self._persistent_stale and self.units[0].groups:
                self.release(self.units[0])
                self._complete(self.units[0])
                self._persistent_stale = False
            self._active.append(self.units[1])
            self._request(self.units[1], "fwd")

    #: forwards of the model one iteration may span before its backward ([Note: several forwards,
    #: one backward])
    MAX_FORWARDS_PER_ITERATION = 16
    #: submodule forwards called on their own one iteration may span ([Note: a submodule's forward
    #: before the model's]): a frozen vision tower run once per image of the batch (at 16 in all,
    #: the iteration would be cut there and its two halves take turns as the trace: no prefetch hit)
    MAX_SUBMODULE_FORWARDS_PER_ITERATION = 1024

    def _continues_iteration(self) -> bool:
        """[Note: several forwards, one backward] A grad-enabled forward whose output awaits a
        backward, followed by another grad-enabled forward (DPO's chosen and rejected halves, a
        siamese pair, ``loss(model(a)) + loss(model(b))``), is one iteration: one trace that
        spans both forwards and the backward, followed from the next step on. Ending the
        iteration at the second forward instead recorded a trace of one forward, which the next
        step's backward then broke (2 invalidations per step, 7 of 15 requests missed). A
        forward with a backward of its own ends its iteration at the end of that backward, as
        before. A forward whose graph is dropped unused (``model(x)`` for a log line) is part of
        the iteration too (the same order every step, followed like the rest), and when its graph
        dies its unit calls stop waiting for their inputs' gradients (:meth:`_note_graph`), so the
        next backward releases units as usual. The iteration ends at a forward under another grad
        mode (an eval under ``no_grad``), and at the ``MAX_FORWARDS_PER_ITERATION``-th forward
        without a backward (a grad-enabled eval loop), which bounds the trace and the counters
        one iteration keeps. A unit of a forward whose graph is kept but never run backward
        stays kept for its inputs' gradients through the next backward, released when room is
        needed (``_release_tiers``)."""
        if not (self._phase is not IterationPhase.IDLE and self._pass is None and self._ctx is None
                and self._forwards_in_iteration < self.MAX_FORWARDS_PER_ITERATION
                and self._submodule_forwards < self.MAX_SUBMODULE_FORWARDS_PER_ITERATION):
            return False
        if self._phase is IterationPhase.OPEN:
            # open with no backward pending: only submodules' forwards so far, which the next
            # forward under the same grad mode joins ([Note: a submodule's forward before the model's])
            return torch.is_grad_enabled() is self.scheduler.key
        return torch.is_grad_enabled() and self.scheduler.key is True

    # [Note: a submodule's forward before the model's] A submodule called on its own, whose
    # output needs no gradient (a frozen input embedding computing ``inputs_embeds``, as peft's
    # prompt tuning, LLaVA-style and NEFTune-like code do, each step and each generated token),
    # then the model: ending the iteration at the submodule's forward recorded a trace of that
    # one call, which the model's forward broke next, and the other way round, every step
    # (2 invalidations and no prefetch hit per step). Such a
    # forward leaves its iteration open, and the next forward under the same grad mode joins
    # it, as a second forward with a backward pending does; a forward of the model itself with no
    # backward still ends its iteration at once, and MAX_SUBMODULE_FORWARDS_PER_ITERATION bounds
    # a loop of submodule calls.

    def _note_graph(self, outputs: List[torch.Tensor]) -> None:
        """Put one token in the autograd metadata of each output's ``grad_fn``: it lives as long
        as the forward's graph (which outlives the output tensors: a loss computed from the
        logits keeps it). When the graph is dropped with its backward not run, the token's
        finalizer marks this forward's unit calls as done with their inputs' gradients (their
        hooks died with the graph), unless the iteration ended since."""
        calls, self._calls = self._calls, []
        token = _GraphToken()
        for t in outputs:
            if t.grad_fn is not None:
                t.grad_fn.metadata["zeroinf_forward"] = token
        self._graphs_alive += 1
        weakref.finalize(token, _graph_dropped, weakref.ref(self), calls, self._generation)

    @staticmethod
    def _inputs_never_come(calls: List[UnitCall]) -> None:
        """``calls``' units no longer wait for their inputs' gradients: no backward will run
        through the forward that made them ([Note: several forwards, one backward])."""
        for call in calls:
            if call.live and call.left > 0:
                call.unit.inputs_pending = max(0, call.unit.inputs_pending - 1)
            call.live, call.left = False, 0

    def _root_post_forward(self, module, args, output):
        with self.busy():
            if self._ctx is not None:
                for u in self.units:  # the units kept gathered ([Note: changes in a forward])
                    self._keep_forward_changes(u)
                self._ctx.close()
                self._ctx = None
            if self.units[1] in self._active:
                self._active.remove(self.units[1])
            self._release_foreign()
            self.tracer.span("forward", "unit", self._t_iter, self.tracer.now())
            backward_follows = self._hook_outputs(self.units[1], output) if torch.is_grad_enabled() else []
            # units gathered ahead for the backward's first requests stay (they count as live
            # parameters, within the prefetch bounds); releasing them here threw their reads away
            # and the backward read them again
            ahead = self.scheduler.prefetched if backward_follows else ()
            for u in self.units[1:]:
                if u.state is not UnitState.RELEASED and not self.is_pinned(u) and u.index not in ahead:
                    if not (backward_follows and self.scheduler.hold_for_next_use(u)):
                        self.release(u)
            if backward_follows:
                self._phase = IterationPhase.AWAITING_BACKWARD
                self._note_graph(backward_follows)
                return output
            self._inputs_never_come(self._calls)  # no output needs a gradient: no backward through it
            self._calls = []
            if self._phase is not IterationPhase.AWAITING_BACKWARD and module is self.module:
                # a submodule's forward leaves the iteration open ([Note: a submodule's forward
                # before the model's])
                self._end_iteration()
        return output

    def _pre_forward(self, unit: Unit, args=(), kwargs=None):
        with self.busy():
            if self._phase is IterationPhase.IDLE and self._pass is None:
                raise RuntimeError(f"zeroinf stage 3: unit '{unit.name}' was called outside the managed model's "
                                   "forward where it cannot open one (inside a zeroinf hook, or after a forward "
                                   "interrupted past its hooks); call the model itself")
            self._active.append(unit)
            unit._t0 = self.tracer.now()
            self._request(unit, "fwd")
            if self._in_backward and torch.is_grad_enabled():  # [Note: recompute in the backward]
                mode = _RecomputeMode(self)
                mode.__enter__()
                self._recompute_modes.append((unit, mode))
            elif torch.is_grad_enabled():  # [Note: release after the inputs' gradients]
                ins = [t for t in _shallow_args(args, kwargs or {}) if isinstance(t, torch.Tensor) and t.requires_grad]
                if ins:
                    unit.inputs_pending += 1
                    call = UnitCall(unit, len(ins))
                    # one hook per input, counting down; the hooks hold no tensor:
                    # register_multi_grad_hook(mode="all") keeps the grad_fns in its hooks, a cycle
                    # through C++ that kept every graph not run backward alive
                    hook = functools.partial(self._input_grad, call)
                    for t in ins:
                        t.register_hook(hook)
                    self._calls.append(call)
                    self._live_calls.append(call)

    def _post_forward(self, unit: Unit, output):
        if self._recompute_modes and self._recompute_modes[-1][0] is unit:
            self._recompute_modes.pop()[1].__exit__(None, None, None)
        with self.busy():
            if unit in self._active:
                self._active.remove(unit)
            self.tracer.span(f"fwd {unit.name}", "unit", getattr(unit, "_t0", self.tracer.now()), self.tracer.now())
            if torch.is_grad_enabled():
                self._hook_outputs(unit, output)
                if not self._in_backward:
                    self._fwd_units_done += 1
                    call = self._in_forward_call
                    if call is not None and self._fwd_units_done >= call[0]:
                        self._in_forward_call = None
                        call[1]()
            self._release_foreign()
            # in the backward this forward is activation checkpointing's recompute: the unit's own
            # backward comes next and reads the parameters it saved, so it stays gathered until its
            # gradients are reduced (_post_accumulate) or the backward ends
            if (not self._in_backward and not self.scheduler.keep_after_use(unit) and unit not in self._active
                    and not self.scheduler.hold_for_next_use(unit)):
                self.release(unit)
        return None

    def _release_foreign(self) -> None:
        for u in list(self._foreign):
            self._foreign.remove(u)
            if u not in self._active and not self.scheduler.keep_after_use(u):
                self.release(u)

    def _hook_outputs(self, unit: Unit, output) -> List[torch.Tensor]:
        """Request ``unit`` for the backward when the first of ``output``'s tensors that require
        grad gets its gradient; returns those tensors (empty: no backward can follow)."""
        leaves, _ = tree_flatten(output)
        ts = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if ts:
            torch.autograd.graph.register_multi_grad_hook(ts, lambda grads, u=unit: self._pre_backward(u), mode="any")
        return ts
