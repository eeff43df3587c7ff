"""Stage 3 gather and release of units: issue, complete (wait), release, read-ahead."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .passes import GradState
from .released import mark_gathered, mark_released
from .units import FlatGroup, ParamSlot, Unit, UnitState
from .common import _finished, _sole_owner, pool_tensor, views_its_slot
from .reads import _Staged, _io_delay
from .. import collectives


class FetchMixin:
    """Gathers units (issue, then complete on use) and releases them."""

    # ------------------------------------------------------------------------ gather / release
    @property
    def live_numel(self) -> int:
        """Elements of non-persistent units gathered or being gathered."""
        return self._live

    def is_pinned(self, unit: Unit) -> bool:
        """True while the unit is in use (running forward, or awaiting its gradients)."""
        return (unit.persistent or unit in self._active or unit in self._foreign or unit.gather_works is not None
                or unit.index in self._derived_holds or (
                    self._pass is not None and unit.state is UnitState.GATHERED
                    and (unit.grad is GradState.PARTIAL or (unit.in_backward and unit.inputs_pending > 0))))

    def issue(self, unit: Unit, for_backward: bool = False) -> None:
        """Start gathering ``unit`` (its tier reads; the all-gather runs in :meth:`_complete`).
        ``for_backward``: its next request is the backward's (prefetched from the forward); with
        :attr:`snapshot_partitions` the read then also keeps a copy of this rank's partition
        (:meth:`partition_copy`)."""
        if unit.state is not UnitState.RELEASED:
            return
        self.step_gate.wait(g.key for g in unit.groups)  # its update from a background step
        if not unit.persistent:
            self._live += unit.numel
            self.stats.live(self._live)
        staged = self._staged.pop(unit.index, None)
        if staged is not None and self._adopts_staging(unit):
            # [Note: staged buffers adopted] the read-ahead's buffers become g.full: no copy
            for g, buf in zip(unit.groups, staged.bufs):
                g.full, g.full_in_pool = pool_tensor(buf, g.dtype, g.padded_numel), True
            staged.bufs = []  # the groups own them now: release() gives them back
        else:
            for g in unit.groups:
                g.full = self.host.take(g.padded_numel, g.dtype, self.device)
        after = self.transfers.mark()  # [Note: CUDA streams]: earlier kernels may still use g.full's block
        unit.state = UnitState.FETCHING
        # [Note: snapshots of held units] a unit the forward gathers and the backward finds still
        # gathered had no copy, so the optimizer in backward read its master from NVMe at the
        # start of the backward, when the disk is busiest (2 x 33 MB on the bench model, one read
        # 96 ms); the units held last time keep a copy from their forward read (a memcpy on the
        # I/O thread; dropped on release if the unit is not held after all)
        snapshot = self.snapshot_partitions and (for_backward or self._in_backward
                                                 or unit.index in self._held_into_backward)
        self.stats.add("gathers")
        if staged is not None:
            self.stats.add("read_ahead_hits")
        if self._io is not None and self.unit_tier(unit) == "nvme":
            unit.future = self._io.submit(self._read_partitions, unit, staged, after, snapshot)
        else:
            ready = self._read_partitions(unit, None, after, snapshot)
            unit.future = None if ready is None else _finished(ready)  # _complete waits for it

    # [Note: staged buffers adopted] On the CPU with one rank a unit's full buffer is its
    # partition, byte for byte, so a read-ahead's staging buffer becomes ``g.full`` itself
    # instead of being copied into a host buffer (a pass over every byte read, on the cores
    # the forward and backward compute on). The buffer stays out of the pool until the unit is
    # released; stage() keeps the on-demand reserve free whatever units hold, so reads on
    # demand and write-backs always find a buffer. A buffer something still views at release
    # (a user kept ``p.data``) is left to the viewer and the pool gets a new one in its place.
    def _adopts_staging(self, unit: Unit) -> bool:
        """Whether a staged read of ``unit`` is gathered in place (see [Note: staged buffers
        adopted]): host compute without side streams, one rank, no empty group, and not the
        persistent unit, which stays gathered through whole iterations (its buffer would be
        out of the pool all that time)."""
        return (not unit.persistent and self.world_size == 1 and self.device.type == "cpu"
                and not self.transfers.side_streams
                and all(g.padded_numel == g.shard_numel > 0 for g in unit.groups))

    def _give_back_full(self, g: FlatGroup, full: torch.Tensor) -> None:
        """Return ``g``'s released full buffer to where :meth:`issue` took it from."""
        in_pool, g.full_in_pool = g.full_in_pool, False
        if not in_pool:
            if _sole_owner(full):
                self.host.give(full)  # no view of it is left (a user's or autograd's keeps it alive)
            return
        if self._pool is None or self._pool.closed:
            return
        if _sole_owner(full):
            self._pool.release(full)
        else:
            self._pool.replace(full)

    # [Note: read-ahead] NVMe partitions can be read into pinned staging buffers further ahead
    # than units are gathered: staging does not count as live parameters (nothing is on the
    # device yet), and is bounded by the free buffers of the pool, keeping min_buffer_count()/2
    # (or the widest unit's partitions) for reads on demand and write-backs. A later issue()
    # turns a staged unit into a device copy on the same I/O thread, after the read.
    def stage(self, unit: Unit) -> bool:
        """Start reading ``unit``'s NVMe partitions into staging buffers; False when not
        possible now (not NVMe, already staged or gathered, or too few free buffers)."""
        if (self.unit_tier(unit) != "nvme" or unit.state is not UnitState.RELEASED or unit.index in self._staged
                or not unit.groups or self.step_gate.pending(g.key for g in unit.groups)):
            return False
        bufs = self._pool.acquire_leaving(len(unit.groups), keep_free=max(len(u.groups) for u in self.units))
        if bufs is None:
            return False
        views = [b.view(torch.uint8)[: g.store.nbytes].view(g.dtype) for b, g in zip(bufs, unit.groups)]
        st = _Staged(bufs, views)
        st.future = self._io.submit(self._stage_read, unit, st)
        self._staged[unit.index] = st
        return True

    def _stage_read(self, unit: Unit, st: "_Staged") -> None:
        _io_delay()
        t0 = self.tracer.now()
        nbytes = sum(g.store.read_raw(v) for g, v in zip(unit.groups, st.views))
        t1 = self.tracer.now()
        self.stats.add("bytes_nvme_read", nbytes)
        self.stats.add("io_busy_s", t1 - t0)
        self.tracer.span(f"read {unit.name}", "transfer", t0, t1, thread="io", args=self._read_args(unit.groups, nbytes, "nvme"))

    def _free_staged(self, st: "_Staged") -> None:
        for b in st.bufs:
            self._pool.release(b)
        st.bufs = []

    def drop_staged(self, units: Optional[List[Unit]] = None) -> None:
        """Forget staged reads (of ``units``, default all) and free their buffers.

        Raises:
            OSError: the first read-ahead that failed (after every buffer is freed); its data
                was never used.
        """
        errors = []
        for idx in list(self._staged):
            if units is None or any(u.index == idx for u in units):
                st = self._staged.pop(idx)
                failed = st.future.exception()
                if failed is not None:
                    errors.append(failed)
                self._free_staged(st)
        if errors:
            raise errors[0]

    def empty_cache(self) -> int:
        """Free what is kept between iterations for speed: read-ahead NVMe partitions (their pinned
        staging buffers go back to the pool) and the recycled host scratch buffers. Returns the
        scratch bytes freed.

        Raises:
            RuntimeError: the manager is closed, or a forward, backward or hook is running, or a
                forward's graph is alive (its backward would gather the units again).
            OSError: a read-ahead had failed (:meth:`drop_staged`; its data was never used).
        """
        self._check_open()
        if not self._idle() or self._graphs_alive:
            raise RuntimeError("empty_partition_cache: called during a forward or backward, or with a forward's "
                               "graph alive (run its backward, or drop its output, first)")
        self.drop_staged()
        return self.host.clear()

    def _complete(self, unit: Unit) -> None:
        """Finish gathering ``unit`` (issuing it first if released): wait for its tier read and
        all-gather it, or wait for the all-gather launched ahead; then point its parameters
        into the full buffers. Collective when ``world_size > 1`` and nothing was launched ahead."""
        if unit.state is UnitState.GATHERED:
            return
        if unit.state is UnitState.RELEASED:
            self.issue(unit)
        if unit.gather_works is not None:
            self._wait_allgather(unit, used=True)
        else:
            self._read_done(unit)
            if self.world_size > 1:
                for g in unit.groups:
                    t0 = self.tracer.now()
                    self._allgather(g, async_op=False)
                    self.tracer.span(f"all_gather {g.key}", "comm", t0, self.tracer.now())
        for g in unit.groups:
            self._storage_of[g.full.untyped_storage().data_ptr()] = g
            for s in g.slots:
                mark_gathered(s.param)  # first: .data = on the plain class is faster
                s.param.data = g.full[s.offset:s.offset + s.numel].view(s.shape)
                s.version, s.data_read, s.data_seen = s.param._version, False, None
        unit.state = UnitState.GATHERED

    def _read_done(self, unit: Unit) -> None:
        """Wait until ``unit``'s tier read has filled its shard of ``g.full`` (on CUDA: the
        compute stream waits for the H2D copy's event; the host waits only for the read to be
        enqueued); counts and traces the time the compute thread blocked."""
        if unit.future is None:
            return
        t0 = self.tracer.now()
        done = unit.future.done()
        failed = unit.future.exception()  # waits; an interrupt here leaves the read in flight untouched
        if failed is not None:
            # released again, so the next gather reads afresh (a transient error then passes; a
            # damaged swap file raises again) instead of every later gather raising this one
            unit.future = None
            self.release(unit)
            raise failed
        self.transfers.stream_wait(unit.future.result())  # [Note: CUDA streams]
        unit.future = None
        t1 = self.tracer.now()
        if not done:
            self.stats.add("wait_io_s", t1 - t0)
            self.tracer.span(f"wait {unit.name}", "wait", t0, t1)

    def _allgather(self, g: FlatGroup, async_op: bool):
        """All-gather ``g.full`` from every rank's shard (this rank's is in place). Returns the
        work handle with ``async_op`` (``g.full`` is valid after ``work.wait()``), else None.

        NCCL: in place with ``all_gather_single`` (the input is this rank's chunk of the
        output, as FSDP2 does). gloo (and any other backend): into the chunks of ``g.full`` from
        a copy of the shard; the work keeps both alive until it completes."""
        lo, hi = self._shard_range(g)
        self.stats.add("bytes_allgather", g.full.numel() * g.full.element_size())
        if self._nccl:
            return collectives.all_gather_single(g.full, g.full[lo:hi], group=self.group, async_op=async_op)
        mine = g.full[lo:hi].clone()
        return dist.all_gather(list(g.full.chunk(self.world_size)), mine, group=self.group, async_op=async_op)

    # [Note: all-gather ahead] When a unit is requested while the recorded trace is followed,
    # the all-gather of the unit requested next in the trace is launched (``async_op=True``)
    # right away, so it runs while the current unit computes, and waited for (``work.wait()``)
    # when that unit is requested: on CUDA the compute stream waits for NCCL's stream; on the
    # CPU the compute thread blocks only if gloo has not finished.
    # Every rank must issue the same collectives in the same order (reductions are issued from
    # backward hooks in between), so the launch point must not depend on timing. Which units
    # were issued (prefetch stops at a unit whose background step update is pending) and
    # whether a read has finished differ between ranks; so the decision reads only what is the
    # same on every rank: the trace position, which units are GATHERED or have an all-gather in
    # flight, and the bounds (the next unit fits in ``stage3_prefetch_bucket_size``, and with
    # those units in ``stage3_max_live_parameters``). If the next unit was not issued here, it
    # is issued now (dropping read-only prefetches to make room), and its tier read is waited
    # for on the host before the launch. A unit with an all-gather in flight is pinned
    # (``is_pinned``), so prefetch drops, which depend on timing, never release it; it is
    # released only by what every rank does alike (the end of the iteration, a divergence that
    # leaves no room otherwise), and then waits for the work first, since gloo/NCCL still
    # write into ``g.full``.
    def _settled_live(self) -> int:
        """Elements of non-persistent units gathered or with an all-gather in flight: the part
        of ``live_numel`` that is the same on every rank (no read-only prefetches)."""
        return sum(u.numel for u in self.units
                   if not u.persistent and (u.state is UnitState.GATHERED or u.gather_works is not None))

    def _allgather_ahead(self) -> None:
        """Launch the all-gather of the next unit of the trace; see [Note: all-gather ahead]."""
        sch, opts = self.scheduler, self.options
        if self.world_size == 1 or opts.prefetch_bucket_size <= 0 or not sch.following or sch.pos >= len(sch.trace):
            return
        unit = self.units[sch.trace[sch.pos][0]]
        if (unit.persistent or not unit.groups or unit.state is UnitState.GATHERED or unit.gather_works is not None
                or unit.numel > opts.prefetch_bucket_size
                or self._settled_live() + unit.numel > opts.max_live_parameters):
            return
        if unit.state is UnitState.RELEASED:
            self._make_room(unit)
            self.issue(unit, for_backward=sch.trace[sch.pos][1] == "bwd")
            self.stats.live(self._live)
            sch.prefetched.add(unit.index)
        self._read_done(unit)
        unit.gather_t0 = self.tracer.now()
        unit.gather_works = [self._allgather(g, async_op=True) for g in unit.groups]
        self.stats.add("allgathers_ahead")

    def _wait_allgather(self, unit: Unit, used: bool) -> None:
        """Wait for ``unit``'s all-gathers launched ahead (on CUDA: the current stream waits);
        ``used``: for its request (False: it is being released unused). Traced on the "comm"
        row from launch to the end of the wait."""
        works, unit.gather_works = unit.gather_works, None
        t0 = self.tracer.now()
        for w in works:
            w.wait()
        t1 = self.tracer.now()
        self.tracer.span(f"all_gather {unit.name}", "comm", unit.gather_t0, t1, thread="comm",
                         args={"ahead": True, "used": used, "wait_s": t1 - t0})

    def release(self, unit: Unit) -> None:
        """Drop the unit's full buffers; parameters become empty placeholders. A no-op while a
        ``gathered_parameters`` block holds the unit (``user_holds``): a forward run inside the
        block (of the model or of a submodule: [Note: entry modules]) released what the block
        had gathered.

        Raises:
            OSError: the unit's tier read failed (raised after the unit is released, so its next
                gather reads again).
        """
        if unit.state is UnitState.RELEASED or unit.user_holds:
            return
        if unit.gather_works is not None:  # gloo/NCCL still write into g.full
            self._wait_allgather(unit, used=False)
        failed = None
        if unit.future is not None:  # a read still writes into the buffer
            failed = unit.future.exception()
            unit.future = None
        gathered = unit.state is UnitState.GATHERED
        if gathered and not self._closed and (self._ctx is not None or (self._in_backward and self.grad_sink is None)):
            self._keep_forward_changes(unit)
        for g in unit.groups:
            self._drop_snapshot(g)
            base = g.full.data_ptr() if gathered and g.full is not None else None
            if g.full is not None:
                self._storage_of.pop(g.full.untyped_storage().data_ptr(), None)
            for s in g.slots:
                if base is not None and s.numel and not views_its_slot(s.param, s, base, g.full.element_size()):
                    self.dropped_data.append(s.name)  # data of another shape in a forward, or outside one
                s.param.data = self._placeholder(g.dtype)
                mark_released(s.param)
                s.data_read, s.data_seen = False, None
            full, g.full = g.full, None
            if full is not None:
                self._give_back_full(g, full)
        if unit.persistent:
            self._persistent_stale = True
        else:
            self._live -= unit.numel
        unit.state = UnitState.RELEASED
        self.scheduler.unit_released(unit)
        self.stats.add("releases")
        if failed is not None:  # its read failed: released all the same, then its error
            raise failed

    # [Note: changes in a forward] A forward may change its weights: an in-place op under
    # no_grad (a max-norm clamp_, nn.Embedding(max_norm=...)'s renorm) or ``p.data = t``. In plain
    # PyTorch the change stays and the optimizer steps from it; here the gathered buffer is a
    # copy that release() drops, so the change was lost and the model trained the unchanged
    # weight, silently. The parameter's version counter (bumped by in-place
    # ops, not by our own copies into the buffer) and its data pointer tell a change; each
    # changed parameter is written into this rank's partition, with its slice of the fp32
    # master, at its unit's release inside the forward and, for units kept gathered (the
    # persistent one, those held into the backward), at the end of the forward: before any
    # step can have updated the partition since the gather; releases in a backward keep a
    # backward hook's change the same way, unless the optimizer runs in the backward (it may
    # have stepped the unit already). Each rank keeps its own shard's
    # part of the change (ranks that changed a weight differently, as DDP's replicas drift,
    # end with a mix). Data of another shape, dtype or device cannot be kept, nor a re-view of
    # the buffer in another layout (release records it in ``dropped_data``; the engine
    # raises). A weight the forward used before giving it new data has its slot's ``replaced``
    # count moved, so the backward, which would read the new values where plain PyTorch reads
    # the old ones, raises instead. An in-place op on ``p.data`` moves no
    # version counter: the foreign-access mode marks a parameter whose ``.data`` the forward
    # read (``data_read``) and copies this rank's part of it as it was then (``data_seen``); the
    # release compares the buffer with that copy, not with the partition, which
    # on NVMe would be read back for it (doubling a step's reads). Changes made
    # outside a forward go through ``gathered_parameters(modifier_rank=...)``.
    def _note_data_read(self, g: FlatGroup, s: ParamSlot) -> None:
        """The forward read ``s.param.data`` for the first time since its gather: mark it and
        keep a copy of this rank's part of it (``data_seen``, on the gathered buffer's device),
        unless the gathered buffer is this rank's partition itself, where whatever the release
        finds is written as it is ([Note: changes in a forward])."""
        s.data_read = True
        if g.full is None:  # a released persistent unit: gathered, and unmarked, before its use
            return
        lo, hi = self._shard_range(g)
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        local = g.store.local()
        if a < b and (local is None or local.data_ptr() != g.full[lo:hi].data_ptr()):
            s.data_seen = g.full[a:b].clone()

    def _keep_forward_changes(self, unit: Unit) -> None:
        """Write the forward's changes to ``unit``'s gathered parameters into the partitions
        ([Note: changes in a forward]); a no-op for a released unit. A forward run inside a
        ``gathered_parameters`` block keeps its changes too (with in-place changes the block
        made before it: the version counters do not tell them apart)."""
        if unit.state is not UnitState.GATHERED:
            return
        for g in unit.groups:
            changed = []
            base, size = g.full.data_ptr(), g.full.element_size()
            lo, hi = self._shard_range(g)
            for s in g.slots:
                p = s.param
                if not s.numel:
                    continue
                if views_its_slot(p, s, base, size):
                    if p._version == s.version:
                        if not s.data_read:
                            continue
                        # .data was read: compare this rank's part with the copy taken then
                        # (none where the gathered buffer is the partition itself: then
                        # written, and the master takes what differs from it, refreshed_master)
                        seen, s.data_read, s.data_seen = s.data_seen, False, None
                        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                        if a >= b or (seen is not None and torch.equal(g.full[a:b], seen)):
                            continue
                else:
                    # not keepable (release() records it in dropped_data): data of another
                    # shape, dtype or device, or a re-view of the buffer itself (p.data =
                    # p.data.t()): the forward's saved tensors read the buffer in the old
                    # layout, which a copy into it would scramble
                    d = p.data
                    if (d.shape != s.shape or d.dtype != g.dtype or d.device != g.full.device
                            or d.untyped_storage().data_ptr() == g.full.untyped_storage().data_ptr()):
                        continue
                    view = g.full[s.offset:s.offset + s.numel].view(s.shape)
                    if torch.equal(d, view):  # an activation checkpoint's recompute repeating the
                        p.data = view  # forward's p.data = t: nothing new
                        continue
                    view.copy_(d)
                    p.data = view
                    # what this forward saved of the old values (it used the weight before the
                    # change) would be read back from the changed buffer, where plain PyTorch's
                    # backward keeps the old tensor: _unpack refuses that
                    s.replaced += 1
                changed.append(s)
            if changed:
                self.stats.add("forward_changes_kept", len(changed))
                self.write_group_values(g, [(s, g.full[s.offset:s.offset + s.numel]) for s in changed])
                for s in changed:
                    s.version, s.data_read, s.data_seen = s.param._version, False, None

    def _make_room(self, unit: Unit, for_block: bool = False) -> None:
        """Release prefetched and kept units until ``unit`` fits under max_live_parameters.

        [Note: the live limit and gathered_parameters] The limit bounds what the engine gathers
        on its own. A ``gathered_parameters`` block is the user's explicit request: DeepSpeed's
        ``GatheredParameters`` gathers whatever it names whatever the limit (TRL's generation
        gathers a whole model that way). So the block's own gathers (``for_block``), and any
        gather that finds no room only because blocks hold units, go ahead over the limit after
        releasing what may be released; ``live_over_limit`` counts them. Otherwise no room
        raises RuntimeError, naming the units in use."""
        limit = self.options.max_live_parameters
        if unit.persistent or unit.state is not UnitState.RELEASED or self._live + unit.numel <= limit:
            return
        self.scheduler.drop_prefetched()
        for releasable in self._release_tiers():
            for u in self.units:
                if self._live + unit.numel <= limit:
                    return
                if releasable(u) and u.index not in self._derived_holds:
                    self.release(u)
        if self._live + unit.numel > limit:
            if for_block or any(u.user_holds for u in self.units):
                self.stats.add("live_over_limit")
                return
            hint = ""
            if self._derived_holds:
                hint = (" (a backward run with create_graph=True keeps every unit it used gathered until the "
                        "backward through its graph ends)")
            live = [u.name for u in self.units if u.state is not UnitState.RELEASED and not u.persistent]
            raise RuntimeError(f"zeroinf stage 3: gathering unit '{unit.name}' ({unit.numel} elements) would exceed "
                               f"zero_optimization.stage3_max_live_parameters={limit}; in use: {live} "
                               f"({self._live} elements). Raise the limit{hint}.")

    def _release_tiers(self):
        """What :meth:`_make_room` may release, tier by tier: each tier is tried over every unit
        (in unit order, alike on every rank) before the next, cheapest to give up first."""
        def free(u: Unit) -> bool:  # not in use: gathered ahead, or kept for reuse
            return u.state is not UnitState.RELEASED and not self.is_pinned(u)

        def idle(u: Unit) -> bool:  # neither running a forward nor read by another module
            return not u.persistent and u not in self._active and u not in self._foreign

        def launched(u: Unit) -> bool:  # an all-gather launched ahead
            return u.gather_works is not None and u not in self._active and u not in self._foreign

        def kept_for_inputs(u: Unit) -> bool:
            # kept only for its inputs' gradients, its own in: the next unit's backward hook fires
            # on the very gradient that completes this unit's inputs, before that input hook, so
            # at the live limit the two would not both fit. A frozen weight still needed is
            # gathered again through the saved-tensor hooks
            return u.state is UnitState.GATHERED and u.inputs_pending > 0 and self._grads_in(u) and idle(u)

        def awaiting_gradients(u: Unit) -> bool:
            # in a backward, still waiting for gradients: two forwards and one backward of their
            # sum (DPO, siamese), or a gradient penalty before the backward, leave a unit waiting
            # for the other call's gradients while the next one must come in. Its weights are gathered again when a saved tensor
            # or a gradient's accumulation needs them ([Note: gradient of a released parameter]);
            # its partial gradient stays in grad_full
            return self._in_backward and u.state is UnitState.GATHERED and u.gather_works is None and idle(u)

        return free, launched, kept_for_inputs, awaiting_gradients

    def _request(self, unit: Unit, phase: str, record: bool = True) -> None:
        """A unit is needed now: count, gather (on demand if not prefetched), prefetch ahead.
        ``record=False`` for requests that depend on what happens to be live (saved-tensor
        unpacking), which would make the trace differ between identical iterations."""
        self._check_open()
        sink = self.grad_sink
        if sink is not None and any(g.key in sink.handed for g in unit.groups):
            from .in_backward import OptimizerInBackwardError
            raise OptimizerInBackwardError(
                f"zeroinf stage 3: unit '{unit.name}' is needed again in the backward after its gradient was reduced and "
                "its update began (zeroinf.optimizer_in_backward): the rest of the backward would see the new weights. "
                "Something whose backward runs later uses this unit's parameters: a weight read without a gradient "
                "(.detach()) by an earlier module, or the unit called again under reentrant activation checkpointing "
                "(use_reentrant=False avoids that). Turn zeroinf.optimizer_in_backward off for this model.")
        was_live = unit.state is UnitState.GATHERED
        hit = self.scheduler.on_request(unit, phase) if record else False
        if was_live:
            self.stats.add("already_live")
        elif hit:
            self.stats.add("prefetch_hits")
        else:
            self.stats.add("prefetch_misses")
        self._make_room(unit)
        self._complete(unit)
        if self._pass is not None and self._pass.derives and not unit.persistent:
            self._derived_holds.add(unit.index)  # [Note: backward passes]: its graph may save these weights
        self.stats.live(self._live)  # also units gathered before this iteration began
        self.scheduler.schedule()
        if record:
            self._allgather_ahead()

    def _gather_foreign(self, unit: Unit) -> None:
        with self.busy():
            self.stats.add("foreign_gathers")
            self._request(unit, "fwd")
            if unit not in self._foreign:
                self._foreign.append(unit)
