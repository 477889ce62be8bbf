"""hvd_compress.torch.DistributedOptimizer: Horovod's DistributedOptimizer with a compression
pipeline per parameter.

Built the way Horovod builds its own: a class made on the fly from the user's optimizer class and
Horovod's `_DistributedOptimizer` methods, so hooks, `backward_passes_per_step`, `synchronize()`
/ `skip_synchronize()`, `zero_grad` checks and `hvd.broadcast_optimizer_state` behave exactly as
in Horovod. Only the per-parameter reduction is ours:

    1. compensate: Nesterov momentum (m = mu*m + g; p = mu*m + g) and/or error feedback
       (p = p + e), state kept per parameter name in a StateStore;
    2. compress p in a kernel (EF: e = p - D(C(p)) in the same call);
    3. issue the first collective of the strategy chosen for this tensor
       (hvd_compress.collectives: allreduce, allgather or the compressed allreduce's alltoall)
       asynchronously, overlapped with the rest of backward; at each later gradient, the
       plans whose collective has finished are moved on (their next collective issued, or
       their result decoded) without waiting for any;
    4. in synchronize(): every tensor's plan that backward did not move is moved on by one
       collective (the compressed allreduce's owners reduce and issue their allgather) before
       any is waited on to the end, then decoded into the gradient.

Each step is a transaction on the state store (StateStore.begin): it opens at the step's first
reduction and is committed by step(). It is rolled back in synchronize() when a reduced gradient
is not finite (every rank holds the same reduced gradients, so all decide alike without a
collective), and when a step was synchronized but never stepped (the user skipped it: seen at
zero_grad() or at the next step's first reduction).

Tensors under `min_compress_bytes` go through Horovod's plain allreduce, as do sparse gradients.
"""
from __future__ import annotations

import collections
import os
import warnings
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.optimizer import _DistributedOptimizer

from .. import buckets, collectives, stats
from ..autotune import Autotune
from ..spec import CompressionConfig, momentum_advice, sparse_momentum_error, spec_momentum
from ..state import StateStore
from ..stats import CompressionStats
from . import _C
from .codec import DTYPE_NAMES, TorchAdapter, TorchCodec
from .powersgd import PowerSGDMember, PowerSGDReduction
from .waiting import wait, waiter
from . import elastic
from ..compressor import CompressorBase
from .compression import Compression

DEFAULT_MIN_COMPRESS_BYTES = 65536


def _to_config(compression: Any) -> CompressionConfig:
    if isinstance(compression, CompressorBase):
        return compression.config
    if compression is hvd.Compression.none:
        return Compression.from_spec("none").config
    if compression is hvd.Compression.fp16:
        return Compression.from_spec("fp16").config
    return Compression.from_spec(compression).config


class _CompressedReduction:
    """Methods that replace Horovod's per-parameter allreduce (copied into the dynamic class)."""

    def __init__(self, params, named_parameters, config, min_compress_bytes,
                 backward_passes_per_step, op, gradient_predivide_factor, sparse_as_dense,
                 process_set, grad_scaler, bucket_bytes=0):
        self._hvdc_config = config
        self._hvdc_scaler = grad_scaler
        self._hvdc_min_bytes = min_compress_bytes
        self._hvdc_store = StateStore(TorchAdapter(), spec=config.canonical())
        self._hvdc_stats = CompressionStats()
        self._hvdc_codec_ns = _C.codec_time_ns()  # the kernels' clock is per process
        self._hvdc_writer = None
        self._hvdc_synced = False  # synchronized and finite: committed by step()
        self._hvdc_active = None  # ranks stepping (not joined) this step, once counted
        self._hvdc_counting = None  # the count's allreduce while it is in flight
        self._hvdc_deferred: list = []  # parameters whose gradient waits for the count
        # Whether a step touches state, so that a rank in hvd.join() must be looked for: the
        # codec's, or the spec's momentum even where nothing is compressed (codec none).
        self._hvdc_momentum = spec_momentum(config) is not None
        self._hvdc_stateful = config.codec != "none" or self._hvdc_momentum
        # A rank outside the process set steps on its own gradients, as with Horovod's
        # optimizer (which registers no hooks there): nothing of the set is asked of it.
        member = process_set.included()
        self._hvdc_tune = Autotune(config.autotune if member else 0)
        self._hvdc_codec = TorchCodec(config, self._hvdc_store,
                                      rank=process_set.rank() if member else 0,
                                      world=process_set.size() if member else 1)
        self._hvdc_powersgd = (PowerSGDReduction(config, self._hvdc_store, process_set,
                                                 average=op == hvd.Average)
                               if config.info.rounds == 2 and member else None)
        self._hvdc_nodes, self._hvdc_groups = None, {None: process_set}
        self._hvdc_gloo = hvd.gloo_enabled()
        if config.hierarchical and member:
            self._hvdc_nodes, local, cross = node_process_sets(process_set)
            self._hvdc_groups.update({collectives.LOCAL: local, collectives.CROSS: cross})
        _DistributedOptimizer.__init__(
            self, params, named_parameters, hvd.Compression.none,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, groups=None,
            sparse_as_dense=sparse_as_dense, process_set=process_set)
        if self._hvdc_powersgd is not None:
            self._hvdc_powersgd.plan(
                [(self._parameter_names[p], p) for p in self._backward_order()
                 if p.numel() * p.element_size() >= min_compress_bytes], bucket_bytes)
        # Bucketed parameters -> the buckets holding their pieces; per step, each bucket's
        # members with a gradient so far, and the buckets in flight.
        self._hvdc_pieces: dict[Any, list[buckets.Bucket]] = {}
        self._hvdc_filling: dict[int, dict[str, tuple]] = {}
        self._hvdc_flights: dict[int, tuple] = {}
        # This step's plans in flight, oldest first: moved on during backward as they finish.
        self._hvdc_moving: collections.deque = collections.deque()
        if bucket_bytes and member and config.codec != "none" and config.info.rounds == 1:
            self._hvdc_plan_buckets(bucket_bytes)

    def _backward_order(self) -> list:
        """The parameters that take gradients in the reverse of the order they were given: the
        order backward usually produces them."""
        return [p for group in reversed(self.param_groups) for p in reversed(group["params"])
                if p in self._requires_update]

    def _hvdc_plan_buckets(self, max_bytes: int) -> None:
        """hvd_compress.buckets.layout over the parameters this optimizer compresses, in
        backward order."""
        by_name, order = {}, []
        for p in self._backward_order():
            if p.dtype in DTYPE_NAMES and p.dim() >= self._hvdc_codec.info.min_dim:
                name = self._parameter_names[p]
                by_name[name] = p
                order.append((name, p.numel(), DTYPE_NAMES[p.dtype], p.element_size()))
        for bucket in buckets.layout(order, max_bytes, self._hvdc_min_bytes):
            for m in bucket.members:
                self._hvdc_pieces.setdefault(by_name[m.name], []).append(bucket)

    def _allreduce_grad_async(self, p):
        routed = self._hvdc_enter(p)
        self._hvdc_advance()
        return routed

    def _hvdc_advance(self) -> None:
        """Moves on the plans whose collective has finished, oldest first, stopping at the
        first still in flight: a plan of several collectives (threshold's sizes, then its
        payloads) then sends the next during backward instead of after it."""
        moving = self._hvdc_moving
        while moving and moving[0].ready():
            plan = moving.popleft()
            plan.prepare()
            if not plan.done:
                moving.append(plan)

    def _hvdc_enter(self, p):
        """p's gradient into the step (opened at its first gradient): routed, or held until
        the step's count of stepping ranks is in."""
        if self._hvdc_synced:  # the last step was synchronized but never taken
            self._hvdc_abandon()
        if not self._hvdc_store.in_step:
            if self._hvdc_follow_world():
                # Reached without a sync (Horovod skips it when workers were only removed):
                # every survivor drops its per-rank state alike, so all stay consistent.
                self.load_compression_state_dict(elastic.shared_part(
                    self.compression_state_dict()))
            self._hvdc_store.begin()
            self._hvdc_filling, self._hvdc_flights, self._hvdc_deferred = {}, {}, []
            self._hvdc_moving.clear()
            self._hvdc_codec.drop_views()
            scaler = self._hvdc_scaler
            if scaler is not None and scaler.is_enabled():  # the scale these gradients carry
                self._hvdc_store.rescale(float(scaler.get_scale()),
                                         self._hvdc_config.info.scale_free_slots)
        self._hvdc_tune.begin()
        if self._hvdc_touching():
            self._hvdc_count()  # first, on every rank: see synchronize()
            if not self._hvdc_counted(block=False):
                # Where this gradient goes depends on the count; backward goes on meanwhile,
                # and the gradients ready by then are routed, in order, when it is in.
                self._hvdc_deferred.append(p)
                return _DEFERRED, None
            self._hvdc_route_deferred()
        return self._hvdc_route(p)

    def _hvdc_route(self, p):
        """p's gradient to its bucket, to a compressed plan or to Horovod's plain allreduce."""
        if p.grad is None:
            p.grad = p.data.new(p.size()).zero_()
        if p.grad.is_sparse and self.sparse_as_dense:
            # Dense from here on, as in the TF frontend: compressed, bucketed and given the
            # spec's momentum like any dense gradient (Horovod would densify it only inside its
            # own allreduce, after the choice to send it uncompressed).
            p.grad = p.grad.to_dense()
        if not p.grad.is_sparse and not p.grad.is_contiguous():
            # A transposed view or a channels_last gradient: Horovod's collectives (the plain
            # path, PowerSGD's) take contiguous tensors only, and the result lands in p.grad.
            p.grad = p.grad.contiguous()
        grad = p.grad
        name = self._parameter_names.get(p)
        compress = self._hvdc_tune.compresses()
        if compress and p in self._hvdc_pieces and not self._hvdc_joined():
            return self._hvdc_bucketed(p, name, grad)
        if (not compress or grad.is_sparse or self._hvdc_config.codec == "none"
                or grad.dtype not in DTYPE_NAMES
                or grad.numel() * grad.element_size() < self._hvdc_min_bytes
                or grad.dim() < self._hvdc_codec.info.min_dim or self._hvdc_joined()):
            return self._hvdc_plain(p, name, grad)
        if self._hvdc_powersgd is not None:
            return self._powersgd_grad_async(p, name, grad)
        ps = self.process_set
        step = self._hvdc_store.next_step(name)
        job = collectives.Job(name=name, n=grad.numel(), itemsize=grad.element_size(),
                              config=self._hvdc_config, rank=ps.rank(), world=ps.size(),
                              average=self.op == hvd.Average, opname=name, step=step,
                              fields_step=step, nodes=self._hvdc_nodes, gloo=self._hvdc_gloo, extra={"grad": grad})
        collectives.choose(job)
        pending = PendingPlan(collectives.plan(job, self._hvdc_codec), self._hvdc_groups, job)
        self._hvdc_moving.append(pending)
        self._hvdc_stats.record(name, job.info.name, grad.numel() * grad.element_size(),
                                job.payload_bytes, job.strategy, job.wire_bytes)
        return pending, None

    def _hvdc_bucketed(self, p, name, grad):
        """p's gradient joins its buckets; each bucket that is then complete is sent."""
        if grad.is_sparse or grad.dtype != p.dtype:
            kind = "sparse" if grad.is_sparse else str(grad.dtype)
            raise ValueError(f"parameter {name!r} has a {kind} gradient and cannot join its "
                             f"bucket of {p.dtype} gradients; pass sparse_as_dense=True for "
                             f"sparse gradients, or bucket_mb=0")
        step = self._hvdc_store.next_step(name)
        for bucket in self._hvdc_pieces[p]:
            ready = self._hvdc_filling.setdefault(bucket.index, {})
            ready[name] = (p, step)
            if len(ready) == len(bucket.members):
                self._hvdc_launch(bucket)
        return BucketShare(self._hvdc_flights, self._hvdc_pieces[p], name, p), None

    def _hvdc_launch(self, bucket) -> None:
        """One job over the concatenation of the bucket's members that have a gradient."""
        ready = self._hvdc_filling[bucket.index]
        members = [m for m in bucket.members if m.name in ready]
        grads = [ready[m.name][0].grad for m in members]
        # A bucket of one member (a piece of a large gradient, or one that filled a bucket
        # alone) is its gradient's own memory, reduced in place: no copy in, none out.
        flat = (grads[0].view(-1)[members[0].start:members[0].stop] if len(members) == 1 else
                torch.cat([g.reshape(-1)[m.start:m.stop] for g, m in zip(grads, members)]))
        name, step = bucket.named(members), ready[members[0].name][1]
        ps = self.process_set
        job = collectives.Job(name=name, n=flat.numel(), itemsize=flat.element_size(),
                              config=self._hvdc_config, rank=ps.rank(), world=ps.size(),
                              average=self.op == hvd.Average, opname=name, step=step,
                              fields_step=step, nodes=self._hvdc_nodes, gloo=self._hvdc_gloo, extra={"grad": flat},
                              members=tuple((m.name, m.n) for m in members))
        collectives.choose(job)
        self._hvdc_codec.view(name, [(m.name, g, m.start, m.stop) for g, m in zip(grads, members)])
        offsets, at = {}, 0
        for m in members:
            offsets[m.name] = (at, m.n)
            at += m.n
        pending = PendingPlan(collectives.plan(job, self._hvdc_codec), self._hvdc_groups, job)
        self._hvdc_flights[bucket.index] = (pending, offsets)
        self._hvdc_moving.append(pending)
        self._hvdc_stats.record(name, job.info.name, flat.numel() * flat.element_size(),
                                job.payload_bytes, job.strategy, job.wire_bytes)

    def _hvdc_plain_allreduce_async(self, p):
        """Horovod's own allreduce of p.grad. Horovod 0.28.1 has no bfloat16 allreduce: such a
        gradient travels as float32 (exact) and is rounded back once, after the reduction."""
        grad = p.grad
        if grad.is_sparse or grad.dtype != torch.bfloat16:
            handle, ctx = _DistributedOptimizer._allreduce_grad_async(self, p)
            return (waiter(handle) if isinstance(handle, int) else handle), ctx
        pre, post = ((1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
                     if self.op == hvd.Average else (1.0, 1.0))
        handle = hvd.allreduce_async_(grad.float(), name=self._parameter_names.get(p),
                                      op=self.op, prescale_factor=pre, postscale_factor=post,
                                      process_set=self.process_set)
        return (lambda: wait(handle).to(grad.dtype)), None

    def _hvdc_plain(self, p, name, grad):
        """Horovod's own allreduce of the uncompressed gradient, recorded in the statistics.
        The spec's momentum goes with it (the optimizer's own is 0), except in a step that a
        rank sits out in hvd.join(), which touches no state."""
        if self._hvdc_touching() and not self._hvdc_joined():
            if grad.is_sparse and spec_momentum(self._hvdc_config) is not None:
                raise ValueError(sparse_momentum_error(self._hvdc_config, name))
            if not grad.is_sparse:
                self._hvdc_codec.plain_momentum(name, grad)
        handle, ctx = self._hvdc_plain_allreduce_async(p)
        if not grad.is_sparse:
            nbytes = grad.numel() * grad.element_size()
            self._hvdc_stats.record(name, "none", nbytes, nbytes, collectives.ALLREDUCE,
                                    _ring_allreduce_bytes(nbytes, self.process_set.size()))
        return handle, ctx

    def _hvdc_touching(self) -> bool:
        """Whether this step may read or write compression state, so that a rank in hvd.join()
        must be looked for (_hvdc_joined). Once autotune has settled on uncompressed steps and the
        spec keeps no momentum, no step can: each gradient then goes straight to Horovod's
        allreduce, with no count of stepping ranks before it, as in Horovod's own optimizer."""
        return self._hvdc_stateful and (self._hvdc_momentum or self._hvdc_tune.compress is not False)

    def _hvdc_joined(self) -> bool:
        """Whether a rank of the set has called hvd.join() and waits there this step.

        A joined rank takes part in allreduces only, adding zeros: Horovod refuses allgather
        and alltoall once a rank has joined (the others hang or raise), and a joined rank's
        zeros would corrupt the homomorphic sum (code 0 is the lowest level, not zero) and
        PowerSGD's shared Q. So each stepping rank counts itself once per step, by an allreduce
        of a one; every rank gets the same count and routes the step alike. While a rank is
        joined, compressed gradients go through Horovod's plain allreduce, as Horovod's own
        optimizer sends them, and no compression state is read or written, step counters
        included: the joined rank's state cannot move, and seeds and warm start drawn from the
        counters must still agree between ranks when all of them step again."""
        self._hvdc_count()
        self._hvdc_counted(block=True)
        return self._hvdc_active < self.process_set.size()

    def _hvdc_count(self) -> None:
        """Issues this step's count of stepping ranks (_hvdc_joined), once."""
        ps = self.process_set
        if self._hvdc_active is not None or self._hvdc_counting is not None:
            return
        if ps.size() == 1:
            self._hvdc_active = 1
            return
        self._hvdc_counting = hvd.allreduce_async(
            torch.ones(1, dtype=torch.int32), op=hvd.Sum, process_set=ps,
            name="hvd_compress.active_ranks")

    def _hvdc_counted(self, block: bool) -> bool:
        """Whether this step's count is in (waiting for it when block)."""
        handle = self._hvdc_counting
        if handle is not None and (block or hvd.poll(handle)):
            self._hvdc_active, self._hvdc_counting = int(wait(handle)), None
        return self._hvdc_active is not None

    def _hvdc_route_deferred(self) -> None:
        """The gradients that came before the count, routed in the order they came (every
        rank issues the same collectives in the same order)."""
        while self._hvdc_deferred:
            p = self._hvdc_deferred.pop(0)
            self._handles[p] = self._hvdc_route(p)

    def _powersgd_grad_async(self, p, name, grad):
        step = self._hvdc_powersgd.compressed_step(name, grad)
        if step is None:
            return self._hvdc_plain(p, name, grad)
        nbytes = grad.numel() * grad.element_size()
        world = self.process_set.size()
        # The spec's momentum goes before the error feedback, as it does before other codecs'.
        self._hvdc_codec.plain_momentum(name, grad)
        member = self._hvdc_powersgd.start(name, grad, step)
        self._hvdc_moving.extend(self._hvdc_powersgd.take_sent())
        sent = member.sent_elements * (8 if grad.dtype == torch.float64 else 4)
        self._hvdc_stats.record(name, "powersgd", nbytes, sent, collectives.ALLREDUCE,
                                _ring_allreduce_bytes(sent, world))
        return member, None

    def synchronize(self):
        # Every rank's first collective of a step is the count of stepping ranks: made at its
        # first gradient, or here by a rank that had none (the others are waiting on it).
        if self._hvdc_touching():
            self._hvdc_joined()
            self._hvdc_route_deferred()
        nowhere, has_gradient = self._hvdc_without_gradient()
        # Gradients that only other ranks computed: zeros go in their place, as in Horovod's
        # optimizer, issued before any batch below is closed so that PowerSGD's batches hold the
        # same members on every rank.
        for p in self._requires_update - nowhere:
            if p not in self._handles:
                self._handles[p] = self._allreduce_grad_async(p)
        # Buckets with members that no rank has a gradient for go without them (every rank
        # leaves out the same ones).
        for bucket in {b.index: b for bs in self._hvdc_pieces.values() for b in bs}.values():
            if bucket.index in self._hvdc_filling and bucket.index not in self._hvdc_flights:
                self._hvdc_launch(bucket)
        # Every plan that backward did not move is moved on by one collective before Horovod's
        # loop waits on any result, so that second collectives (two-round codecs, the
        # compressed allreduce's allgather) overlap each other. A bucket's plan is moved once,
        # whatever its member count (PowerSGD's batches move once of themselves).
        for handle, _ in list(self._handles.values()):
            for plan in getattr(handle, "plans", (handle,)):
                if hasattr(plan, "prepare") and not getattr(plan, "moved", False):
                    plan.prepare()
        self._hvdc_moving.clear()
        checked = [(p, h) for p, (h, _) in self._handles.items()
                   if isinstance(h, (PowerSGDMember, PendingPlan))]
        everything = self._requires_update
        self._requires_update = everything - nowhere
        try:
            _DistributedOptimizer.synchronize(self)
        finally:
            self._requires_update = everything
            if has_gradient is not None:
                wait(has_gradient)
        counted = self._hvdc_active == self.process_set.size()
        self._hvdc_active = None  # counted again next step
        if self._hvdc_tune.end(counted):
            self._hvdc_decide()
        if self._hvdc_powersgd is not None:
            self._hvdc_powersgd.end_step()
        store = self._hvdc_store
        finite = not store.touched() or self._hvdc_finite(checked)
        self._hvdc_filling, self._hvdc_flights = {}, {}
        if not finite:
            store.rollback()
        elif store.in_step:
            self._hvdc_synced = True
        self._hvdc_stats.end_step()
        if self._hvdc_writer is not None:
            self._hvdc_write_step()

    def _hvdc_decide(self) -> None:
        """The end of autotune's probe (hvd_compress.autotune, step 4)."""
        ps, times = self.process_set, self._hvdc_tune.times
        summed = (times if ps.size() == 1 else hvd.allreduce(
            torch.tensor(times, dtype=torch.float64), op=hvd.Sum, process_set=ps,
            name="hvd_compress.autotune").tolist())
        if not self._hvdc_tune.decide(summed):
            # The buckets' entries would stay beside their members' uncompressed ones.
            self._hvdc_stats.tensors.clear()

    def _hvdc_without_gradient(self) -> tuple[set, Any]:
        """The parameters that no rank of the set has a gradient for in this step (not
        reduced: none computed in backward, p.grad None), and the handle of the collective
        that tells, if it is still to be waited for. Horovod would reduce zeros for them;
        here the step does not exist for them: no gradient, no update, and no compression
        state touched (an error-feedback residual would otherwise be sent). Which parameters
        those are takes one small allreduce per step: a rank that computed every gradient
        cannot know that another lacks one. But it knows that none is missing everywhere, so
        it does not wait for the answer before its gradients' own collectives, which the
        ranks that lack some are still to issue."""
        ps = self.process_set
        if not ps.included():
            return set(), None
        params = sorted(self._requires_update, key=lambda q: self._parameter_names[q])
        mine = [q in self._handles or q.grad is not None for q in params]
        if ps.size() == 1:
            return {q for q, has in zip(params, mine) if not has}, None
        handle = hvd.allreduce_async(torch.tensor(mine, dtype=torch.int32), op=hvd.Sum,
                                     name="hvd_compress.has_gradient", process_set=ps)
        if all(mine):
            return set(), handle
        return {q for q, count in zip(params, wait(handle).tolist()) if count == 0}, None

    def _hvdc_follow_world(self) -> bool:
        """After an elastic reset Horovod re-initializes with another rank and size: the codec
        and PowerSGD take them up. True when they changed."""
        ps = self.process_set
        if not ps.included():
            return False
        rank, world = ps.rank(), ps.size()
        if (rank, world) == (self._hvdc_codec.rank, self._hvdc_codec.world):
            return False
        if self._hvdc_nodes is not None:
            raise RuntimeError("hierarchical compression cannot follow an elastic resize: its "
                               "node process sets belong to the old world")
        self._hvdc_codec = TorchCodec(self._hvdc_config, self._hvdc_store, rank=rank, world=world)
        self._hvdc_tune = Autotune(self._hvdc_config.autotune)  # another job: measured again
        if self._hvdc_powersgd is not None:
            self._hvdc_powersgd.world = world
        return True

    def _hvdc_finite(self, checked) -> bool:
        # PowerSGD and the aggregations checked their results as they wrote them (on the CPU):
        # those are not read again.
        known = {p: h.finite for p, h in checked if h.finite is not None}
        if not all(known.values()):
            return False
        # A bucketed gradient is a view of its bucket's reduced tensor: one check per bucket.
        reduced = []
        for plan, _ in self._hvdc_flights.values():
            out = plan()
            if plan.finite is None:
                reduced.append(out)
            elif not plan.finite:
                return False
        reduced += [g._values() if g.is_sparse else g
                    for g in (p.grad for p in self._requires_update
                              if p not in known
                              and (p not in self._hvdc_pieces or not self._hvdc_flights))
                    if g is not None]
        return _C.all_finite(reduced)

    def _hvdc_abandon(self) -> None:
        self._hvdc_synced = False
        self._hvdc_store.rollback()

    def step(self, closure=None):
        loss = _DistributedOptimizer.step(self, closure)
        if self._hvdc_synced:
            self._hvdc_synced = False
            self._hvdc_store.commit()
        return loss

    def zero_grad(self):
        if self._hvdc_synced:  # gradients dropped after synchronize(): the step is skipped
            self._hvdc_abandon()
        return _DistributedOptimizer.zero_grad(self)

    def compression_report(self) -> dict:
        """Bytes per step, ratio and codec-kernel time since this optimizer was built, with the
        per-tensor statistics (what `python -m hvd_compress` prints and writes)."""
        rep = stats.report(self._hvdc_stats, str(self._hvdc_config), self._hvdc_stats.steps,
                           _C.codec_time_ns() - self._hvdc_codec_ns)
        tuned = self._hvdc_tune.report()
        if tuned is not None:
            rep["autotune"] = tuned
        return rep

    def write_compression_summaries(self, logdir: str) -> None:
        """From the next step on, write each step's statistics (hvd_compress.stats.SCALARS) as
        TensorBoard scalars to `logdir`. Call it on one rank: every rank would write the same
        files."""
        from torch.utils.tensorboard import SummaryWriter
        self._hvdc_writer = SummaryWriter(logdir)
        self._hvdc_writer_ns = _C.codec_time_ns()

    def _hvdc_write_step(self) -> None:
        s, now = self._hvdc_stats, _C.codec_time_ns()
        values = (s.last_step_raw, s.last_step_sent,
                  s.last_step_raw / s.last_step_sent if s.last_step_sent else 1.0,
                  (now - self._hvdc_writer_ns) / 1e6)
        self._hvdc_writer_ns = now
        for tag, value in zip(stats.SCALARS, values):
            self._hvdc_writer.add_scalar(tag, value, s.steps)
        # Flushed every step: a run that ends without closing the writer keeps its last steps.
        self._hvdc_writer.flush()

    def compression_state_dict(self) -> dict:
        """Error-feedback residuals, momentum buffers and step counters as numpy arrays, keyed
        by parameter name (the format both frontends share)."""
        self._hvdc_codec.settle()
        return self._hvdc_store.state_dict()

    def load_compression_state_dict(self, state: dict, strict_spec: bool = True) -> None:
        self._hvdc_synced = False
        self._hvdc_store.load_state_dict(state, strict_spec=strict_spec)

    @property
    def compression_stats(self) -> CompressionStats:
        return self._hvdc_stats

    @property
    def compression_config(self) -> CompressionConfig:
        return self._hvdc_config


def _ring_allreduce_bytes(nbytes: int, world: int) -> float:
    return 2.0 * (world - 1) / world * nbytes


_OPS = {"sum": hvd.Sum, "max": hvd.Max}
# The handle of a gradient that waits for the step's count of ranks; synchronize() routes it
# before Horovod's loop reads any handle.
_DEFERRED = object()


class BucketShare:
    """A parameter's reduced gradient out of the buckets holding its pieces (the handle Horovod's
    synchronize() calls); its buckets are sent when their last member arrives."""

    def __init__(self, flights: dict, held: list, name: str, p):
        self._flights, self._held, self._name, self._p = flights, held, name, p

    @property
    def plans(self) -> list:
        return [self._flights[b.index][0] for b in self._held]

    def __call__(self) -> torch.Tensor:
        pieces = []
        for bucket in self._held:
            plan, offsets = self._flights[bucket.index]
            at, n = offsets[self._name]
            pieces.append(plan()[at:at + n])
        if len(pieces) == 1:
            return pieces[0].view(self._p.shape)
        # Pieces reduced in place are already the gradient, side by side.
        grad, at = self._p.grad, 0
        for piece in pieces:
            if piece.data_ptr() != grad.data_ptr() + at * grad.element_size():
                return torch.cat(pieces).view(self._p.shape)
            at += piece.numel()
        return grad


class PendingPlan:
    """A reduction plan in flight: each collective it yields is issued asynchronously; the plan
    resumes when its result is needed. Horovod's synchronize() calls the handle for the
    reduced gradient; prepare() moves the plan on by one collective, so every tensor's second
    collective is issued before any tensor is waited on to the end."""

    def __init__(self, gen, groups, job=None):
        self._gen, self._groups, self._job = gen, groups, job
        self._done, self._result = False, None
        self.moved = False  # moved on at least once
        self._issue(next(gen))

    @property
    def done(self) -> bool:
        return self._done

    def ready(self) -> bool:
        """Whether prepare() would not wait: the collective in flight has finished."""
        return self._done or hvd.poll(self._handle)

    @property
    def finite(self) -> bool | None:
        """Once called: whether the job's reduced gradient is all finite, as the aggregation
        kernels found while writing it (on the CPU); None where they did not look."""
        return None if self._job is None else self._job.extra.get("finite")

    def _issue(self, request) -> None:
        ps = self._groups[request.group]
        if isinstance(request, collectives.Allreduce):
            t = request.tensor
            if t.dtype == torch.bfloat16:  # no bfloat16 in Horovod's allreduce: float32, exact
                t = t.float()
            handle = hvd.allreduce_async_(t, name=request.name, op=_OPS[request.op],
                                          process_set=ps)
        elif isinstance(request, collectives.Allgather):
            t = request.tensor.view(1, -1) if request.rows else request.tensor
            handle = hvd.allgather_async(t, name=request.name, process_set=ps)
        else:
            splits = torch.tensor(request.splits, dtype=torch.int32)
            handle = hvd.alltoall_async(request.tensor, splits=splits, name=request.name,
                                        process_set=ps)
        self._handle = handle

    def prepare(self) -> None:
        if self._done:
            return
        self.moved = True
        out = wait(self._handle)
        if isinstance(out, tuple):  # alltoall: (received, received splits)
            out = out[0]
        try:
            self._issue(self._gen.send(out))
        except StopIteration as end:
            self._done, self._result = True, end.value

    def __call__(self):
        while not self._done:
            self.prepare()
        return self._result


_node_sets: dict[tuple, object] = {}


def node_process_sets(process_set):
    """The two-level strategy's process sets (collectives.node_groups), registered once per job
    as Horovod dynamic process sets, every rank registering every set in the same order."""
    collectives.check_node_sets_possible(process_set is hvd.global_process_set)
    mine = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]
    layout = hvd.allgather(torch.tensor([mine]), name="hvd_compress.node_layout").tolist()
    return collectives.register_node_sets(layout, hvd.rank(), hvd.add_process_set,
                                          hvd.global_process_set, _node_sets)


def _check_ranks_agree(config: CompressionConfig, min_bytes: int, max_bucket_bytes: int,
                       process_set) -> None:
    mine = (f"{config.canonical()};min_compress_bytes={min_bytes};"
            f"bucket_bytes={max_bucket_bytes};autotune={config.autotune}").encode()
    sizes = hvd.allgather(torch.tensor([len(mine)]), name="hvd_compress.spec_check.sizes",
                          process_set=process_set)
    blob = hvd.allgather(torch.frombuffer(bytearray(mine), dtype=torch.uint8),
                         name="hvd_compress.spec_check", process_set=process_set)
    theirs = [bytes(b.tolist()).decode() for b in torch.split(blob, sizes.tolist())]
    if len(set(theirs)) > 1:
        detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(theirs))
        raise ValueError(f"ranks disagree on the compression spec ({detail}); every rank must "
                         f"pass the same compression, min_compress_bytes, bucket_mb and autotune")


def DistributedOptimizer(optimizer, named_parameters=None, compression="none",
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set,
                         min_compress_bytes=DEFAULT_MIN_COMPRESS_BYTES, grad_scaler=None,
                         bucket_mb=None):
    """Wrap `optimizer` like `horovod.torch.DistributedOptimizer`, compressing gradients.

    compression: a spec string ("topk,k=0.01,ef=vanilla"), a dict with BytePS keys, a
        `Compression.<codec>(...)` object, or Horovod's `hvd.Compression.none/fp16`.
    min_compress_bytes: gradients smaller than this are allreduced uncompressed (default 64 KiB).
    gradient_predivide_factor applies to the uncompressed gradients only; compressed ones are
    scaled by their codec (fp16 divides by the world size before the sum).
    Explicit allreduce groups are not supported: compressed payloads are issued per parameter.
    grad_scaler: the `torch.amp.GradScaler` whose scaled gradients this optimizer reduces.
        Compression state in gradient units (residuals, momenta, DGC velocities) is rescaled
        whenever the loss scale changes, so that it always meets gradients in its own units.
    bucket_mb: compress and send gradients in buckets of up to this many MiB (hvd_compress.buckets),
        larger tensors in pieces of that size; 0 sends each gradient alone. Not given: the
        spec's `bucket_mb` (so `python -m hvd_compress` and HVD_COMPRESSION can set it), else 0.
        A bucket's selection (top-k, DGC, threshold) and scales (onebit, quantisers) span the
        whole bucket; state stays keyed by parameter name. PowerSGD keeps its per-matrix batches.
    """
    config = _to_config(compression)
    max_bytes = buckets.bucket_bytes(bucket_mb, config)
    if max_bytes and config.hierarchical:
        raise ValueError("bucket_mb is not supported with hierarchical=true yet: the two-level "
                         "strategy shards each gradient itself; pass bucket_mb=0")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op={op} is not supported with compression; valid: hvd.Average, hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
    if num_groups or groups is not None:
        raise ValueError("groups/num_groups are not supported by hvd_compress: each compressed "
                         "gradient is its own collective; leave them unset")
    if grad_scaler is not None and not all(hasattr(grad_scaler, a)
                                           for a in ("get_scale", "is_enabled")):
        raise ValueError(f"grad_scaler must be a torch.amp.GradScaler (get_scale() and "
                         f"is_enabled()), got {type(grad_scaler).__name__}")
    if backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
    if not isinstance(min_compress_bytes, int) or min_compress_bytes < 0:
        raise ValueError(f"min_compress_bytes must be an integer >= 0, got {min_compress_bytes!r}")
    for group in optimizer.param_groups[:1]:
        advice = momentum_advice(config, group.get("momentum", 0))
        if advice:
            warnings.warn(advice)
    if config.momentum == "nesterov" or config.info.replaces_momentum:
        what = config.codec if config.info.replaces_momentum else "momentum=nesterov"
        for group in optimizer.param_groups:
            if group.get("momentum", 0):
                warnings.warn(f"{what} in the compression spec replaces the optimizer's own "
                              f"momentum ({group['momentum']}); setting it to 0")
                group["momentum"] = 0
    # Under elastic Horovod a worker that joins builds its optimizer while the others wait in
    # the reset's sync: no collective may run here, and the sync checks the spec instead.
    if (process_set.included() and process_set.size() > 1
            and os.environ.get("HOROVOD_ELASTIC") != "1"):
        _check_ranks_agree(config, min_compress_bytes, max_bytes, process_set)

    namespace = dict(_DistributedOptimizer.__dict__)
    for key, value in _CompressedReduction.__dict__.items():
        if not key.startswith("__") or key == "__init__":
            namespace[key] = value
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, elastic.CompressedOptimizer), namespace)
    return cls(optimizer.param_groups, named_parameters, config, min_compress_bytes,
               backward_passes_per_step, op, gradient_predivide_factor, sparse_as_dense,
               process_set, grad_scaler, max_bytes)
