"""Stage 3 backward: unit gradients, their reduction over ranks, the end of a pass and of an iteration."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .passes import BackwardPass, GradState, IterationPhase, UnitCall
from .units import FlatGroup, Unit, UnitState
from .. import collectives


class _Reduction(NamedTuple):
    """A gradient reduction launched by :meth:`Stage3ParameterManager._reduce`.

    ``shard`` (this rank's ``shard_numel`` elements, training dtype, compute device) holds the
    sum over ranks once ``work`` has completed (``work`` is None with one rank: already there);
    ``full`` is the unit's flat gradient the collective reads (``shard`` may be a view of it)."""

    group: FlatGroup
    full: torch.Tensor
    shard: torch.Tensor
    work: Any


# [Note: asynchronous reductions] in Stage3ParameterManager: CPU reductions in flight, at most:
_REDUCTIONS_IN_FLIGHT = 2


class ReduceMixin:
    """The backward hooks and gradient reduction."""

    # ------------------------------------------------------------------------ backward hooks
    def _pre_backward(self, unit: Unit) -> None:
        with self.busy():
            self._enter_pass()
            unit._t0 = self.tracer.now()
            unit.in_backward = True
            self._request(unit, "bwd")

    def _enter_pass(self) -> BackwardPass:
        """The running backward pass; the first hook of a new autograd call begins it (see
        [Note: backward passes]): the per-pass state of every unit and forward call starts afresh,
        and the pass's end is queued on its graph task. A hook of another graph task while a pass
        runs is one started inside it (reentrant checkpointing's backward of a block)."""
        p = self._pass
        if p is not None:
            return p
        p = self._pass = BackwardPass(derives=torch.is_grad_enabled(),
                                      keeps_graph=torch._C._autograd._get_current_graph_task_keep_graph())
        self._reset_pass_state()
        for call in self._live_calls:
            if call.live:
                call.left = call.inputs
                call.unit.inputs_pending += 1
        self._t_bwd = self.tracer.now()
        self._held_into_backward = {u.index for u in self.units
                                    if not u.persistent and u.state is not UnitState.RELEASED}
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end_pass, p))
        return p

    def _pre_accumulate(self, unit: Unit, grad: torch.Tensor) -> None:
        """[Note: gradient of a released parameter] Runs just before autograd accumulates
        ``grad`` into a parameter of ``unit`` (a tensor hook on the leaf, bound to its unit: one
        attribute test per gradient in the common case). Autograd builds ``param.grad`` with
        the parameter's own sizes, so the parameter must be gathered then: a released one failed
        with "The size of tensor a (0) must match the size of tensor b (32)". A parameter whose
        uses in the forward lie far apart gets its gradient only once every use's backward ran:
        a head tied to the embedding, whose single accumulation comes at the very end of the
        backward, after the root unit was released to make room for the blocks (at the smallest
        stage3_max_live_parameters the engine runs). Such a unit is gathered again here, on demand (also in a pass of
        ``torch.autograd.grad`` with respect to the parameter, which accumulates nothing: the
        hook cannot tell the two apart)."""
        if unit.state is not UnitState.GATHERED:
            with self.busy():
                self._enter_pass()
                self._request(unit, "bwd", record=False)

    def _post_accumulate(self, param: nn.Parameter) -> None:
        s = self._slots[param]
        unit, g = s.unit, s.group
        grad = param.grad
        if grad is None:
            return
        self._enter_pass().accumulated = True
        if g.grad_full is None:  # [Note: first gradient copied] no zero fill, no add
            g.grad_full = self.host.take(g.padded_numel, g.dtype, self.device)
            g.grad_written = set()
        dst = g.grad_full[s.offset:s.offset + s.numel]
        if s.index in g.grad_written:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            g.grad_written.add(s.index)
        param.grad = None
        if unit.grad is not GradState.PARTIAL:  # the unit's first gradient of the pass (or since its reduction)
            unit.grads_seen, unit.grads_expected = 0, self._grads_expected(unit)
        unit.grads_seen += 1
        unit.grad = GradState.PARTIAL
        if unit.grads_seen >= unit.grads_expected:
            self._reduce(unit)
            self._release_after_backward(unit)

    @staticmethod
    def _grads_expected(unit: Unit) -> int:
        """How many of ``unit``'s trainable parameters get a gradient accumulated in the running
        autograd graph task (at least 1: one just arrived): those whose ``AccumulateGrad`` node
        the task will run. A parameter the forward never read (an adapter switched off) is in no
        graph, so its unit's gradient is final, reduced and released as soon as the others are
        in, not at the end of the backward. Inside the backward; the unit is gathered."""
        n = 0
        with torch.enable_grad(), torch._C.DisableTorchFunctionSubclass():
            for g in unit.groups:
                for s in g.slots:
                    p = s.param
                    if p.requires_grad:
                        node = p.view_as(p).grad_fn.next_functions[0][0]  # its AccumulateGrad
                        n += bool(torch._C._will_engine_execute_node(node))
        return max(n, 1)

    def _grads_in(self, unit: Unit) -> bool:
        """The unit's gradients of the running pass are all in: it has no trainable parameter,
        or the last one expected arrived and the unit was reduced."""
        return unit.trainable == 0 or unit.grad is GradState.REDUCED

    def _input_grad(self, call: UnitCall, _grad: torch.Tensor) -> None:
        """A tensor hook on an input of a unit's forward call: its gradient was computed."""
        if not call.live or call.left <= 0:
            return
        self._enter_pass()
        call.left -= 1
        if call.left == 0:
            self._inputs_done(call.unit)

    def _inputs_done(self, unit: Unit) -> None:
        """[Note: release after the inputs' gradients] The backward computed the gradients of
        one forward call's inputs: that call's backward is over. A unit was released as soon as
        its trainable gradients were in, but its frozen weights may be needed after them (a LoRA
        block's frozen LayerNorm, for the input gradient): re-gathered through the saved-tensor
        hooks (a second read), or, under activation checkpointing that recomputes a block's
        ``forward`` without its hooks (transformers 5), saved as the parameter itself and read as
        the empty placeholder ("size of tensor b (0)"). Once every call's inputs have their
        gradients and its own are in, it is released; until then it counts as pinned."""
        with self.busy():
            unit.inputs_pending = max(0, unit.inputs_pending - 1)
            self._release_after_backward(unit)

    def _release_after_backward(self, unit: Unit) -> None:
        """Release a unit whose backward is over in the running pass: its own gradients are in
        (reduced) and every forward call's inputs have theirs ([Note: release after the inputs'
        gradients]); not one a ``create_graph`` pass holds ([Note: backward passes])."""
        if (unit.inputs_pending == 0 and self._grads_in(unit) and not unit.persistent
                and unit not in self._active and unit.state is UnitState.GATHERED
                and unit.index not in self._derived_holds):
            self.tracer.span(f"bwd {unit.name}", "unit", getattr(unit, "_t0", self.tracer.now()), self.tracer.now())
            self.release(unit)

    # [Note: asynchronous reductions] A unit's flat gradient is reduced with ``async_op=True`` as
    # soon as its last parameter's gradient arrives, so the collective runs while the backward of
    # the units before it computes. NCCL reduce-scatters into a shard-sized buffer (half the bytes
    # of an all-reduce); gloo all-reduces (no reduce-scatter in every torch we support) and this
    # rank's shard is a view of the result. Either way the sum is divided by the world size
    # afterwards, on the shard only.
    # * CUDA: the D2H stream waits for the work (``CudaTransfers.d2h(work=...)``), divides and
    #   copies into pinned memory; the compute stream and the host never wait for it. From there
    #   on the hand-off is that of [Note: CUDA streams].
    # * CPU: up to ``_REDUCTIONS_IN_FLIGHT`` reductions stay in flight in a FIFO; launching one
    #   more completes the oldest (``work.wait()``, divide, add into ``grad_shard`` or hand to
    #   the I/O thread), and the end of the backward (and anything reading gradients,
    #   ``_land_grads(wait=True)``) completes the rest. Completion in launch order keeps the fp32
    #   accumulation order, hence the numbers, bit for bit those of a synchronous reduction.
    # Launches happen in the backward hooks' order, the same on every rank.
    def _reduce(self, unit: Unit) -> None:
        """Launch the average of the unit's flat gradients over ranks, whose shard is then added
        into ``grad_shard`` (or the swap file); see [Note: asynchronous reductions]."""
        did = False
        for g in unit.groups:
            if g.grad_full is None:
                continue
            if not g.optimized:  # requires grad, in no optimizer param group: nothing steps it
                self.host.give(g.grad_full)
                g.grad_full, g.grad_written = None, None
                continue
            t0 = self.tracer.now()
            self._zero_unwritten(g)
            red = self._launch_reduce(g)
            g.grad_full, g.grad_written = None, None
            if self.transfers.side_streams:  # CUDA: D2H on a side stream, after the collective
                self._grad_to_host_cuda(red)
            else:
                self._reductions.append(red)
                while len(self._reductions) > (_REDUCTIONS_IN_FLIGHT if self.world_size > 1 else 0):
                    self._finish_reduce(self._reductions.popleft())
            did = True
            self.tracer.span(f"reduce {g.key}", "comm", t0, self.tracer.now())
        if did:
            unit.reduces_this_backward += 1
            self.reduced_since_check = True
            self.stats.add("reduces")
        if unit.grad is GradState.PARTIAL:
            unit.grad = GradState.REDUCED

    def _launch_reduce(self, g: FlatGroup) -> _Reduction:
        """Start summing ``g.grad_full`` (``padded_numel``, training dtype) over ranks."""
        full = g.grad_full
        lo, hi = self._shard_range(g)
        if self.world_size == 1:
            return _Reduction(g, full, full[lo:hi], None)
        self.stats.add("bytes_reduce", full.numel() * full.element_size())
        self.stats.add("elements_reduce", full.numel())
        if self._nccl:
            shard = torch.empty(g.shard_numel, dtype=full.dtype, device=full.device)
            return _Reduction(g, full, shard, collectives.reduce_scatter_single(shard, full, group=self.group, async_op=True))
        return _Reduction(g, full, full[lo:hi], dist.all_reduce(full, group=self.group, async_op=True))

    def _finish_reduce(self, red: _Reduction) -> None:
        """CPU: wait for ``red``'s collective, average, and add the shard into ``grad_shard``
        (or hand it to the I/O thread for the swap file); the flat gradient goes back to
        ``self.host`` once nothing reads it."""
        g = red.group
        if red.work is not None:
            t0 = self.tracer.now()
            red.work.wait()
            self.tracer.span(f"wait reduce {g.key}", "wait", t0, self.tracer.now())
            red.shard.div_(self.world_size)
        part = red.shard  # training dtype; summed in fp32 below (exact: fp32 holds it)
        if part.device.type != "cpu":
            part = part.to(device="cpu", dtype=torch.float32)
        if self.grad_sink is not None:  # [Note: optimizer in backward]: stepped, never stored
            self.grad_sink(g, part, None, red.full)
        elif self.options.grads_on_nvme:
            # accumulate in the swap file on the I/O thread; the next unit's backward overlaps it
            self._grad_io.append(self._io.submit(self._accumulate_grad_on_nvme, g, part, red.full))
        else:
            self._add_to_grad_shard(g, part)
            self.host.give(red.full)

    def _finish_reductions(self) -> None:
        """CPU: complete every reduction in flight, in launch order."""
        while self._reductions:
            self._finish_reduce(self._reductions.popleft())

    # [Note: first gradient copied] A unit's flat gradient is allocated without zeroing; each
    # parameter's first gradient is copied into its slot and a repeated one added, and before
    # the reduction the elements no gradient was written to (parameters without a gradient,
    # alignment gaps, padding) are zeroed. Likewise the fp32 partition ``grad_shard`` of the
    # first micro-batch is a copy into a kept buffer, not an add onto zeros: a bf16/fp16 add
    # into fp32 would convert into a temporary first.
    @staticmethod
    def _zero_unwritten(g: FlatGroup) -> None:
        done = g.grad_written or set()
        pos = 0
        for s in g.slots:  # in offset order (units.py lays them out one after the other)
            if s.index in done:
                if s.offset > pos:
                    g.grad_full[pos:s.offset].zero_()
                pos = max(pos, s.offset + s.numel)
        if pos < g.padded_numel:
            g.grad_full[pos:].zero_()

    @staticmethod
    def _add_to_grad_shard(g: FlatGroup, part: torch.Tensor) -> None:
        """``grad_shard += part`` (fp32 CPU); the first micro-batch copies into the kept buffer."""
        if g.grad_shard is None:  # fp32 holds any bf16/fp16 value exactly: a copy, no temporary
            g.new_grad_shard().copy_(part)
        else:
            g.grad_shard.add_(part)

    def _grad_to_host_cuda(self, red: _Reduction) -> None:
        """CUDA: on the D2H stream, wait for ``red``'s collective, divide its shard by the world
        size and copy it as fp32 into a pinned host tensor; then hand that on by the copy's event
        (see [Note: CUDA streams]): to the I/O thread, which adds it into the swap file
        (``grads_on_nvme``), or to :meth:`_land_grads`, which adds it into ``grad_shard``.

        A plain ``non_blocking`` copy, not ``zeroinf.ops.cuda_grad.grad_bucket_pass``: the norm
        recorded for clipping is that of the accumulated gradient ([Note: norm while reducing]),
        which the per-micro-batch statistics of the fused pass do not give, and reading those
        device tensors would need another hand-off."""
        g = red.group
        part = self.host.empty(g.shard_numel, torch.float32)
        keep = (red.full,) if self._nccl else ()  # else the shard is a view of it
        ready = self.transfers.d2h(part, red.shard, work=red.work, divisor=self.world_size, keep=keep)
        if self.grad_sink is not None:  # [Note: optimizer in backward]: stepped once it lands
            self.grad_sink(g, part, ready, None)
        elif self.options.grads_on_nvme:
            # accumulate in the swap file on the I/O thread; the next unit's backward overlaps it
            self._grad_io.append(self._io.submit(self._accumulate_landed_grad_on_nvme, g, part, ready))
        else:
            self._grads_in_flight.append((g, part, ready))
            self._land_grads(wait=False)

    def _accumulate_landed_grad_on_nvme(self, g: FlatGroup, part: torch.Tensor, ready: Any) -> None:
        """I/O thread: wait (this thread only) for ``part``'s D2H copy, then add it to the file."""
        self.transfers.host_wait(ready)
        self._accumulate_grad_on_nvme(g, part)

    def _land_grads(self, wait: bool) -> None:
        """Add gradient shards whose D2H copy has completed into ``grad_shard``, in the order they
        were reduced (so the fp32 sums round as on the CPU path); with ``wait``, wait for all,
        and on the CPU complete the reductions in flight."""
        if wait:
            self._finish_reductions()
        while self._grads_in_flight:
            g, part, ready = self._grads_in_flight[0]
            if not wait and not self.transfers.done(ready):
                return
            self.transfers.host_wait(ready)
            self._add_to_grad_shard(g, part)
            self._grads_in_flight.pop(0)

    def _end_pass(self, p: BackwardPass) -> None:
        """The end of backward pass ``p`` (queued on its graph task; see [Note: backward
        passes]): the gradients it accumulated are final, and those not reduced yet are reduced
        now. A pass that accumulated gradients or freed its graph ends the iteration; one of
        ``torch.autograd.grad`` keeping its graph releases the units it gathered (but those a
        ``create_graph`` pass holds) and leaves the iteration to the backward to come."""
        if self._pass is not p:  # the iteration was aborted meanwhile
            return
        with self.busy():
            for u in self.units:
                if any(g.grad_full is not None for g in u.groups):
                    self._reduce(u)
            self._land_grads(wait=True)  # [Note: CUDA streams]: the optimizer step reads them next
            self._host_reads_done()
            self.check_grad_io(wait=False)
            self._pass = None
            if self.tracer is not None and hasattr(self, "_t_bwd"):
                self.tracer.span("backward", "unit", self._t_bwd, self.tracer.now())
            if p.accumulated or not p.keeps_graph:
                self._end_iteration()
                return
            for u in self.units:
                u.in_backward = False
                if u.state is not UnitState.RELEASED and not self.is_pinned(u):
                    self.release(u)

    def _reset_pass_state(self) -> None:
        """Every unit's per-pass state back to its start: no gradient of a pass in
        (``GradState.NONE``), its backward not begun, no forward call waiting (a new pass
        counts the calls it may run through again: :meth:`_enter_pass`)."""
        for u in self.units:
            u.grads_seen, u.grads_expected, u.grad, u.in_backward, u.inputs_pending = 0, 0, GradState.NONE, False, 0

    def forget_raised_pass(self) -> None:
        """Called where no backward pass runs (``engine.backward`` before it starts its own): a
        pass still recorded raised part-way, so its end never ran (an ``autograd.grad`` that
        failed inside the backward and was caught). Without this the next pass would be taken
        for one started inside it and end with nothing reduced. Its unreduced gradients are
        dropped (a failed pass's are never final) and its units released; the iteration stays
        open for the backward to come."""
        if self._pass is None:
            return
        with self.busy():
            self._pass = None
            for g in self.groups():
                if g.grad_full is not None:
                    full, g.grad_full, g.grad_written = g.grad_full, None, None
                    self.host.give(full)
            self._reset_pass_state()
            for u in self.units:
                if u.state is not UnitState.RELEASED and not self.is_pinned(u):
                    self.release(u)

    def _end_iteration(self) -> None:
        for g in self.groups():  # a backward that raised midway: its unreduced gradients must not
            if g.grad_full is not None:  # be added into the next backward's
                full, g.grad_full, g.grad_written = g.grad_full, None, None
                self.host.give(full)
        if self._phase is IterationPhase.IDLE:
            pass  # a pass through a graph kept from an iteration that ended: nothing to record
        elif self._forwards_in_iteration == 0 and self._phase is not IterationPhase.AWAITING_BACKWARD:
            # only submodules called on their own, none with a backward (a frozen embedding,
            # then an eval under no_grad): the model's next forward is this iteration's, so
            # record nothing ([Note: a submodule's forward before the model's]; recorded, the
            # trace broke twice a step)
            self.scheduler.abort()
        else:
            self.scheduler.end()
        self._active.clear()
        self._foreign.clear()
        # the persistent unit too: gathered between iterations (after a forward with no backward,
        # or between a backward and its step) its parameters took in-place edits silently, the
        # next forward computed on them and the next step discarded them; released, they refuse as
        # every other parameter does, and the next forward gathers it again (it is small)
        for u in self.units:
            self.release(u)
        self.last_reduce_counts = {u.name: u.reduces_this_backward for u in self.units if u.groups}
        self._reset_pass_state()
        for u in self.units:
            u.reduces_this_backward = 0
        for call in self._live_calls:  # no pass runs through this iteration's calls any more
            call.live = False
        self._live_calls = []
        self._derived_holds.clear()
        self._pass = None
        was, self._phase = self._phase, IterationPhase.IDLE
        self._graphs_alive = 0
        self._calls = []
        self._generation += 1
        if was is not IterationPhase.IDLE:  # a pass outside an iteration counts into the next one
            self.stats.finish()
            self.tracer.finish()
