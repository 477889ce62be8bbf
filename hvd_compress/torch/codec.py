"""One codec bound to torch tensors: the per-parameter compress / reduce / decode steps that the
optimizer's reduction plans (hvd_compress.collectives, through the `Ops` methods below) and the
stock-protocol compressors share. Everything numeric happens in the kernels of csrc/; this
module only allocates tensors and picks kernel arguments from the registry.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..collectives import (ALLREDUCE, COMPRESSED_ALLREDUCE, Job, Part, carry_kind, carry_parts,
                           chunk_bounds)
from ..registry import CodecInfo
from ..seeds import derive_seed, seed_name
from ..spec import CompressionConfig, masks_momentum, spec_momentum
from ..state import StateStore
from . import _C

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}
_NUMPY_VIEW = {torch.bfloat16: torch.float32}  # numpy has no bfloat16: upcast, exactly
_NO_CARRY = torch.zeros(0)


def check_gradient(t: torch.Tensor, what: str = "gradient") -> None:
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"{what} has dtype {t.dtype}; compression supports "
                         f"{', '.join(DTYPE_NAMES.values())}")


def kernel_params(cfg: CompressionConfig, n: int, *, seed: int = 0, prescale: float = 1.0,
                  step: int = 0) -> _C.Params:
    """Kernel arguments for one tensor of n elements (see CompressionConfig.kernel_fields)."""
    return _params(cfg.kernel_fields(n, step), seed, prescale)


def _params(fields: dict, seed: int = 0, prescale: float = 1.0) -> _C.Params:
    p = _C.Params()
    for name, value in fields.items():
        setattr(p, name, value)
    p.seed = seed
    p.prescale = prescale
    return p


@dataclass
class Encoded:
    payload: torch.Tensor
    params: _C.Params
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device



def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element is finite, as a 0-d bool tensor on t's device, without waiting for
    the device: on the CPU by the exponent bits (_C.all_finite: one read, 2.4x faster than
    torch.aminmax on one thread), on a GPU by min and max (NaN propagates to both; an inf is
    one of them), one reduction without a mask of t's size."""
    if t.device.type == "cpu":
        return torch.tensor(_C.all_finite([t]))
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _decode(kernel_id: int, payload: torch.Tensor, out: torch.Tensor, kp: _C.Params,
            alpha: float) -> None:
    """out = alpha * D(payload). A bfloat16 payload that Horovod reduced as float32 (it has no
    bfloat16 allreduce) is decoded in float32 and rounded once, so the result is the float32
    computation's, rounded."""
    if payload.dtype == torch.float32 and out.dtype == torch.bfloat16:
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        _C.decode(kernel_id, payload, wide, kp, alpha, False)
        out.copy_(wide)
    else:
        _C.decode(kernel_id, payload, out, kp, alpha, False)


def _whole_words(b: torch.Tensor) -> bool:
    """Whether these bytes can be viewed as int32 words."""
    return b.numel() % 4 == 0 and b.data_ptr() % 4 == 0


class TorchCodec:
    def __init__(self, config: CompressionConfig, store: StateStore | None, rank: int = 0,
                 world: int = 1):
        self.config = config
        self.info = config.info
        self.store = store
        self.rank, self.world = rank, world
        self._homo_words: dict[str, torch.Tensor] = {}
        self._scratch_buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._payloads: dict[tuple[str, str], tuple] = {}
        # Buckets in flight (hvd_compress.buckets): job name -> its members as (parameter name,
        # gradient, start, stop), and the bucket's state this step (flat, by kind).
        self._views: dict[str, list] = {}
        self._gathered: dict[str, dict[str, torch.Tensor]] = {}
        # (job name, kind) -> (buffer, the members' slots that are views of it), kept across
        # steps: a bucket's state is read and written in place, not gathered and scattered.
        self._buffers: dict[tuple[str, str], tuple[torch.Tensor, list]] = {}
        # The second buffer of a bucket's residual (_bucket_rewrite), in the same layout.
        self._spare_buffers: dict[tuple[str, str], tuple[torch.Tensor, list]] = {}
        self._elementwise = {"ef", "momentum", *self.info.state_slots}

    def view(self, name: str, members: list) -> None:
        """Job `name` is a bucket of `members`: its elementwise state is theirs (_bucket_state),
        its lazy residual scales settled into them as each part is encoded (encode_part)."""
        self._views[name] = members
        self._gathered[name] = {}

    def drop_views(self) -> None:
        """Forget buckets of a step that never finished (the store's rollback restores the
        members' slots the step touched)."""
        self._views.clear()
        self._gathered.clear()

    def plain_momentum(self, name: str, grad: torch.Tensor) -> None:
        """The spec's momentum (spec.spec_momentum) applied in place to a dense gradient that
        travels uncompressed."""
        taken = spec_momentum(self.config)
        if taken is None:
            return
        kind, factor, slot = taken
        m = self._slot(name, slot, grad)
        if kind == "nesterov":
            _C.nesterov(grad, m, factor)
        else:  # as torch.optim.SGD updates its momentum buffer, rounding for rounding
            _C.heavy_ball(grad, m, m, factor)
            grad.copy_(m)

    def encode(self, name: str, grad: torch.Tensor, *, prescale: float = 1.0) -> Encoded:
        """Momentum and error feedback (when configured), then the codec. May overwrite grad."""
        check_gradient(grad)
        cfg, info = self.config, self.info
        x = grad if grad.is_contiguous() else grad.contiguous()
        step = self.store.next_step(name) if self.store is not None else 0
        seed = 0
        if info.uses_seed:
            seed = derive_seed(cfg.seed, seed_name(name, self.rank, info.seed_per_rank), step)
        kp = kernel_params(cfg, x.numel(), seed=seed, prescale=prescale, step=step)
        if cfg.momentum == "nesterov":
            _C.nesterov(x, self._slot(name, "momentum", x), cfg.mu)
        payload = _C.new_payload(info.kernel_id, x, kp)
        if info.state_slots:  # the codec's own state stands in for error feedback
            _C.encode_with_state(info.kernel_id, x, [self._slot(name, s, x) for s in
                                                     info.state_slots], kp, payload)
        elif cfg.ef == "vanilla":
            e_in, e = self._rewrite(name, "ef", x)
            _C.ef_encode(info.kernel_id, x, e, self._carry(name, x), kp, payload, e_in)
            self._mask_momentum(name, x, e)
        else:
            _C.encode(info.kernel_id, x, kp, payload)
        if info.samples:
            payload = self.mark_nonfinite(None, x, payload)
        if info.variable_size:
            # 1-D: Horovod gathers payloads of any length back to back.
            payload = payload[:_C.encoded_bytes(info.kernel_id, payload, x, kp)]
        elif not info.linear:
            # [1, bytes]: ranks whose payload sizes differ fail Horovod's allgather shape check.
            payload = payload.view(torch.uint8).view(1, -1)
        return Encoded(payload, kp, grad.shape, grad.dtype, grad.device)

    def _mask_momentum(self, name: str, like: torch.Tensor, e: torch.Tensor,
                       part: Part | None = None) -> None:
        """spec.masks_momentum: the momentum cleared where the residual e (of the part) is
        zero."""
        if not masks_momentum(self.config):
            return
        m = self._slot(name, "momentum", like).view(-1)
        if part is not None:
            m = m[part.start:part.stop]
        m.masked_fill_(e.view(-1) == 0, 0)

    def _carry(self, name: str, like: torch.Tensor, parts: int = 1) -> torch.Tensor:
        size = self.info.ef_carry
        if not size:
            return _NO_CARRY
        return self._slot(name, carry_kind(parts), torch.zeros(size * parts, device=like.device))

    def settle(self) -> None:
        """Bring every lazily kept residual to its plain form (a no-op for the state's meaning);
        called before the state is read or checkpointed."""
        if self.store is None or self.config.ef != "vanilla" or not self.info.ef_carry:
            return
        size = self.info.ef_carry
        for name in self.store.names():
            e = self.store.peek(name, "ef")
            if e is None:
                continue
            for kind in self.store.kinds(name):
                parts = carry_parts(kind)
                if parts:
                    bounds, carry = chunk_bounds(e.numel(), parts), self.store.peek(name, kind)
                    for j in range(parts):
                        _C.ef_settle(self.info.kernel_id, e.view(-1)[bounds[j]:bounds[j + 1]],
                                     carry[j * size:(j + 1) * size])

    def _rewrite(self, name: str, kind: str,
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """StateStore.rewrite for a kernel that writes the whole slot (not a bucket's view)."""
        if self.store is None or name in self._views:
            e = self._slot(name, kind, like)
            return e, e
        return self.store.rewrite(name, kind, like)

    def _slot(self, name: str, kind: str, like: torch.Tensor) -> torch.Tensor:
        if self.store is None:
            raise ValueError(f"{kind} state needs parameter names: use "
                             f"hvd_compress.torch.DistributedOptimizer")
        members = self._views.get(name)
        if members is None or kind not in self._elementwise:
            return self.store.slot(name, kind, like)
        gathered = self._gathered[name]
        if kind not in gathered:
            gathered[kind] = self._bucket_state(name, kind, members)
        return gathered[kind]

    def _bucket_state(self, name: str, kind: str, members: list) -> torch.Tensor:
        """The bucket's `kind` state as one flat tensor that is its members' own slots: a piece
        of one parameter is a view of its slot; whole parameters have their slots placed, once,
        as consecutive views of one buffer (StateStore.place), so that no step copies the state
        into the bucket and back (two passes over it on top of the codec's one). A slot replaced
        since (a checkpoint loaded, a rolled-back step that created it) is placed again."""
        slots = [self.store.slot(m, kind, g) for m, g, _, _ in members]  # the step's backups
        if len(members) == 1:
            _, _, a, b = members[0]
            return slots[0].view(-1)[a:b]
        held = self._buffers.get((name, kind))
        if held is None or any(s is not v for s, v in zip(slots, held[1])):
            like = slots[0]
            buffer = torch.empty(sum(s.numel() for s in slots), dtype=like.dtype,
                                 device=like.device)
            views, at = [], 0
            for (m, _, _, _), s in zip(members, slots):
                views.append(self.store.place(m, kind, buffer[at:at + s.numel()].view(s.shape)))
                at += s.numel()
            held = self._buffers[name, kind] = (buffer, views)
            self._spare_buffers.pop((name, kind), None)
        return held[0]

    def _bucket_rewrite(self, name: str, like: torch.Tensor,
                        kind: str = "ef") -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's residual (or other elementwise state `kind`) for a kernel that reads it and
        writes all of it: (src, dst). Where
        every member's slot is a live view of the bucket's buffer that this step has not touched,
        dst is a second buffer of the same layout, which the members' slots move to
        (StateStore.move), and src is left as it was as the step's backup: the kernel's pass
        replaces a backup's copy. A bucket of one member does the same with its member's slot
        (StateStore.rewrite; every piece of a gradient is encoded in the step its gradient
        arrives, so all of the slot is written). Otherwise (the bucket's first step, a slot
        already touched) both are the bucket's state, updated in place after a backup."""
        gathered, src_key = self._gathered[name], kind + "/src"
        if kind in gathered:  # a later part of the same step
            return gathered.get(src_key, gathered[kind]), gathered[kind]
        members, store = self._views[name], self.store
        if len(members) == 1:  # a piece of its member's slot, or all of it: the slot alternates
            m, g, a, b = members[0]
            src, dst = (t.view(-1)[a:b] for t in store.rewrite(m, kind, g))
            gathered[kind], gathered[src_key] = dst, src
            return src, dst
        held, other = self._buffers.get((name, kind)), self._spare_buffers.get((name, kind))
        slots = [store.peek(m, kind) for m, _, _, _ in members]
        if other is not None and all(s is v for s, v in zip(slots, other[1])):
            # a rolled-back step left the slots in the other buffer
            held, other = other, held
            self._buffers[name, kind], self._spare_buffers[name, kind] = held, other
        if (held is None or any(s is not v for s, v in zip(slots, held[1]))
                or not all(store.movable(m, kind) for m, _, _, _ in members)):
            e = self._slot(name, kind, like)
            return e, e
        if other is None:
            buffer = torch.empty_like(held[0])
            views, at = [], 0
            for s in slots:
                views.append(buffer[at:at + s.numel()].view(s.shape))
                at += s.numel()
            other = (buffer, views)
        for (m, _, _, _), v in zip(members, other[1]):
            store.move(m, kind, v)
        self._buffers[name, kind], self._spare_buffers[name, kind] = other, held
        gathered[kind], gathered[src_key] = other[0], held[0]
        return held[0], other[0]

    def _end_bucket(self, name: str) -> None:
        """The bucket's view of its members' state, dropped at the end of its step."""
        if self._views.pop(name, None) is not None:
            self._gathered.pop(name)

    def decode(self, reduced: torch.Tensor, enc: Encoded, alpha: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """out = alpha * D(reduced): the allreduced payload of a linear codec."""
        out = self._out(enc, out)
        _decode(self.info.kernel_id, reduced, out, enc.params, alpha)
        return out

    def aggregate(self, gathered: torch.Tensor, enc: Encoded, alpha: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce the [ranks, bytes] allgather result of a non-linear codec."""
        out = self._out(enc, out)
        if self.info.variable_size:
            _C.aggregate_concat(self.info.kernel_id, gathered, self.world, out, enc.params, alpha)
        else:
            _C.aggregate(self.info.kernel_id, gathered, out, enc.params, alpha)
        return out

    @staticmethod
    def _out(enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
        if out is None or not out.is_contiguous():
            return torch.empty(enc.shape, dtype=enc.dtype, device=enc.device)
        return out


    # ---- the reduction plans' operations (hvd_compress.collectives.Ops) -------------------------
    @staticmethod
    def flat(job: Job) -> torch.Tensor:
        grad = job.extra["grad"]
        check_gradient(grad)
        return grad.contiguous().view(-1)

    @staticmethod
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)

    @staticmethod
    def from_bytes(b: torch.Tensor, job: Job, half: bool = False) -> torch.Tensor:
        return b.view(-1).view(torch.float16 if half else job.extra["grad"].dtype)

    @staticmethod
    def own_size(payload: torch.Tensor, rank: int) -> torch.Tensor:
        sizes = torch.zeros(2, dtype=torch.int32)
        sizes[rank] = payload.numel() * payload.element_size()
        return sizes

    def _scratch(self, job: Job, role: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """nbytes of a uint8 buffer kept for this collective (job.opname) and role across steps,
        grown when a step needs more: a fresh one costs more in page faults than the pass that
        fills it (32 MB on one core of the development VM: 30 ms fresh, 4 ms reused). The step's
        collective and reduction are done with it before the next step writes it. A buffer
        that must grow at least doubles: threshold's payloads grow over its first steps as
        error feedback raises its density, and each regrowth was a fresh buffer again."""
        held = self._scratch_buffers.get((job.opname, role))
        if held is None or held.device != device:
            held = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._scratch_buffers[job.opname, role] = held
        elif held.numel() < nbytes:
            held = torch.empty(max(nbytes, 2 * held.numel()), dtype=torch.uint8, device=device)
            self._scratch_buffers[job.opname, role] = held
        return held[:nbytes]

    def _payload(self, job: Job, part: Part, state: str | None, info: CodecInfo,
                 x: torch.Tensor, kp: _C.Params) -> torch.Tensor:
        """The part's payload buffer. On the CPU it is kept across steps, as _scratch's are:
        a codec whose payload is allocated at its worst case (threshold's: every element sent)
        and filled in part made glibc hand pages back and fault them in again every step, its
        own and the model's (ResNet-50: about 3000 faults a step, 2.5 kept). On a GPU the
        caching allocator reuses blocks already, and a kept buffer would only hold memory."""
        if x.device.type != "cpu":
            return _C.new_payload(info.kernel_id, x, kp)
        key = (job.opname, f"payload {state} {part.index}")
        sig = (info.kernel_id, x.numel(), x.dtype, x.device, part.fields)
        held = self._payloads.get(key)
        if held is None or held[0] != sig:
            held = self._payloads[key] = (sig, _C.new_payload(info.kernel_id, x, kp))
        return held[1]

    def words(self, job: Job, payload: torch.Tensor,
              sizes: torch.Tensor | None = None) -> torch.Tensor:
        b = payload.contiguous().view(-1).view(torch.uint8)
        nbytes = b.numel() if sizes is None else int(sizes.max())
        w = self._scratch(job, "words", -(-nbytes // 4) * 4, b.device)
        w[:b.numel()].copy_(b)
        w[b.numel():].zero_()
        return w.view(torch.int32)

    def pair_rows(self, job: Job, payload: torch.Tensor, sent: torch.Tensor,
                  summed: torch.Tensor, rank: int,
                  sizes: torch.Tensor | None = None) -> torch.Tensor:
        # Horovod summed `sent` in place: this rank's words are gone from it, so they come
        # from the payload.
        own = payload.contiguous().view(-1).view(torch.uint8)
        n = own.numel()
        m = n if sizes is None else int(sizes[1 - rank])
        out = self._scratch(job, "rows", n + m, own.device)
        mine, theirs = (out[:n], out[n:]) if rank == 0 else (out[m:], out[:m])
        mine.copy_(own)
        if n % 4 == 0 and m % 4 == 0 and _whole_words(own) and _whole_words(theirs):
            k = min(n, m) // 4  # words that both payloads fill
            torch.sub(summed[:k], own.view(torch.int32)[:k], out=theirs.view(torch.int32)[:k])
            # past this rank's payload the sum is the other's alone
            theirs[4 * k:].copy_(summed.view(torch.uint8)[4 * k:m])
        else:  # summed is this plan's own: this rank's words come off it in place
            k = n // 4
            head = own[:4 * k]
            if k:
                summed[:k].sub_((head if _whole_words(head) else head.clone()).view(torch.int32))
            if n % 4:
                last = torch.zeros(1, dtype=torch.int32, device=own.device)
                last.view(torch.uint8)[:n % 4].copy_(own[4 * k:])
                summed[k:k + 1].sub_(last)
            theirs.copy_(summed.view(torch.uint8)[:m])
        return out

    @staticmethod
    def to_half(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16)

    @staticmethod
    def widen(t: torch.Tensor, job: Job) -> torch.Tensor:
        return t.to(job.extra["grad"].dtype)

    @staticmethod
    def sum_rows(job: Job, rows: torch.Tensor, ranks: int, n: int, alpha: float) -> torch.Tensor:
        acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
        rows = rows.view(ranks, n)
        total = rows[0].to(acc, copy=True)
        for r in range(1, ranks):
            total += rows[r]
        total *= alpha
        return total.to(job.extra["grad"].dtype)

    def prepare(self, job: Job) -> torch.Tensor:
        grad = job.extra["grad"]
        check_gradient(grad)
        x = grad if grad.is_contiguous() else grad.contiguous()
        if self.config.momentum == "nesterov":
            _C.nesterov(x, self._slot(job.name, "momentum", x), self.config.mu)
        flat = x.view(-1)
        # The reduced gradient is written over the gradient itself where that is one buffer.
        job.extra["out"] = flat if x is grad else None
        return flat

    def encode_part(self, job: Job, x: torch.Tensor, part: Part, info: CodecInfo,
                    state: str | None) -> torch.Tensor:
        cfg, name, grad = self.config, job.name, job.extra["grad"]
        kp = self._part_params(job, part, info)
        payload = self._payload(job, part, state, info, x, kp)
        chunked = job.strategy == COMPRESSED_ALLREDUCE
        if state == "worker" and info.state_slots:  # the codec's own state stands in for EF
            # Read from one buffer and written to another, as the residual is below: the old
            # state is the step's backup, and no copy of it is made.
            bucket = bool(job.members) or name in self._views
            pairs = [self._bucket_rewrite(name, grad, s) if bucket else self._rewrite(name, s, grad)
                     for s in info.state_slots]
            src, dst = ([t.view(-1)[part.start:part.stop] for t in ts] for ts in zip(*pairs))
            _C.encode_with_state(info.kernel_id, x, dst, kp, payload, state_in=src)
        elif state == "worker" and cfg.ef == "vanilla" and (job.members or name in self._views):
            # A bucket's lazy scales belong to this step's encoding of it, not to any member:
            # each part's is settled into the residual at once, whatever the parts (whole,
            # chunks, or its members under granularity=tensor).
            e_in, e = (t.view(-1)[part.start:part.stop] for t in self._bucket_rewrite(name, grad))
            carry = torch.zeros(info.ef_carry, device=x.device) if info.ef_carry else _NO_CARRY
            _C.ef_encode(info.kernel_id, x, e, carry, kp, payload, e_in)
            if info.ef_carry:
                _C.ef_settle(info.kernel_id, e, carry)
            self._mask_momentum(name, grad, e, part)
        elif state == "worker" and cfg.ef == "vanilla":
            e_in, e = (t.view(-1)[part.start:part.stop] for t in self._rewrite(name, "ef", grad))
            carry = self._carry(name, grad, job.world if chunked else 1)
            size = info.ef_carry
            _C.ef_encode(info.kernel_id, x, e, carry[part.index * size:(part.index + 1) * size],
                         kp, payload, e_in)
            self._mask_momentum(name, grad, e, part)
        elif state == "owner" and cfg.ef == "vanilla":
            e_in, e = self.store.rewrite(name, f"owner_ef[{part.start}:{part.stop}]", x)
            carry = torch.zeros(_C.ef_carry_size(info.kernel_id), device=x.device)
            _C.ef_encode(info.kernel_id, x, e, carry, kp, payload, e_in)
            if carry.numel():
                _C.ef_settle(info.kernel_id, e, carry)
        else:
            _C.encode(info.kernel_id, x, kp, payload)
        if info.variable_size:
            payload = payload[:_C.encoded_bytes(info.kernel_id, payload, x, kp)]
        if job.strategy != ALLREDUCE:
            payload = payload.view(torch.uint8)
        return payload

    @staticmethod
    def mark_nonfinite(job: Job | None, x: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        if payload.numel():  # a flag on the device: no wait for the kernels here
            head = payload[:1]
            head.copy_(torch.where(all_finite(x), head, float("nan")))
        return payload

    def _part_params(self, job: Job, part: Part, info: CodecInfo) -> _C.Params:
        seed = derive_seed(self.config.seed, part.seed_key, job.step) if info.uses_seed else 0
        return _params(part.field_dict, seed, job.extra.get("prescale", 1.0))

    @staticmethod
    def size(payload: torch.Tensor) -> int:
        return payload.numel() * payload.element_size()

    @staticmethod
    def concat(tensors: list) -> torch.Tensor:
        return torch.cat(tensors)

    @staticmethod
    def split(t: torch.Tensor, sizes: list[int]) -> list:
        return list(torch.split(t.view(-1), sizes))

    @staticmethod
    def columns(gathered: torch.Tensor, ranks: int, start: int, stop: int) -> torch.Tensor:
        return gathered.view(ranks, -1)[:, start:stop].contiguous()

    def _part_out(self, job: Job, part: Part) -> torch.Tensor:
        out = job.extra.get("out")
        if out is None:
            out = job.extra["out"] = torch.empty(job.n, dtype=job.extra["grad"].dtype,
                                                 device=job.extra["grad"].device)
        return out[part.start:part.stop]

    def reduce(self, job: Job, payloads: torch.Tensor, part: Part, info: CodecInfo, ranks: int,
               alpha: float, out: torch.Tensor | None = None, final: bool = False) -> torch.Tensor:
        kp = self._part_params(job, part, info)
        if out is None:
            grad = job.extra["grad"]
            out = torch.empty(part.n, dtype=grad.dtype, device=grad.device)
        # Only a piece of the result is checked: a sum the plan encodes again (the compressed
        # allreduce's chunk) is not the gradient.
        check = final and out.device.type == "cpu"
        if info.variable_size:
            finite = _C.aggregate_concat(info.kernel_id, payloads.view(-1), ranks, out, kp, alpha,
                                         check_finite=check)
        else:
            finite = _C.aggregate(info.kernel_id, payloads.view(ranks, -1), out, kp, alpha,
                                  check_finite=check)
        if check:
            _checked(job, out, finite)
        return out

    def reduce_into(self, job: Job, payloads: torch.Tensor, part: Part, info: CodecInfo,
                    ranks: int, alpha: float) -> torch.Tensor:
        return self.reduce(job, payloads, part, info, ranks, alpha, self._part_out(job, part),
                           final=True)

    def reduce_pair(self, job: Job, payload: torch.Tensor, summed: torch.Tensor, part: Part,
                    info: CodecInfo, alpha: float) -> torch.Tensor:
        out = self._part_out(job, part)
        check = out.device.type == "cpu"
        finite = _C.aggregate_pair(info.kernel_id, payload, summed, job.rank, out,
                                   self._part_params(job, part, info), alpha, check_finite=check)
        if check:
            _checked(job, out, finite)
        return out

    def decode_part(self, job: Job, payload: torch.Tensor, part: Part, info: CodecInfo,
                    alpha: float) -> torch.Tensor:
        out = self._part_out(job, part)
        kp = self._part_params(job, part, info)
        if info.variable_size:
            _C.aggregate_concat(info.kernel_id, payload, 1, out, kp, alpha)
        else:
            _decode(info.kernel_id, payload, out, kp, alpha)
        return out

    @staticmethod
    def walk(job: Job, gathered: torch.Tensor, parts: list[Part], info: CodecInfo) -> list[int]:
        """Sizes of variable-size payloads gathered back to back (threshold: [tag][count]...)."""
        sizes, off = [], 0
        for _ in parts:
            count = int.from_bytes(bytes(gathered[off + 4:off + 8].tolist()), "little")
            size = info.payload_bytes(job.itemsize, count, {})
            sizes.append(size)
            off += size
        return sizes

    def homo_source(self, job: Job, x: torch.Tensor) -> torch.Tensor:
        if self.config.ef != "vanilla":
            return x
        e = self._slot(job.name, "ef", job.extra["grad"]).view(-1)
        return e.add_(x)  # p = x + e, kept in the residual until encode takes D(own codes) off

    @staticmethod
    def homo_absmax(job: Job, p: torch.Tensor, block: int) -> torch.Tensor:
        # A NaN block becomes inf: Horovod's max would not carry a NaN to every rank.
        inf = float("inf")
        return torch.nan_to_num(_C.homo_block_absmax(p, block), nan=inf, posinf=inf)

    def homo_encode(self, job: Job, p: torch.Tensor, scales: torch.Tensor, block: int,
                    levels: int, seed_key: str) -> torch.Tensor:
        seed = derive_seed(self.config.seed, seed_key, job.step)
        # One words buffer per tensor, reused every step: a fresh one costs as much in page
        # faults as the encode itself. The step's allreduce and decode are done with it before
        # the next step encodes into it.
        kept = self._homo_words.get(job.name)
        need = _C.homo_words(job.n, levels, job.world)
        if kept is None or kept.numel() != need or kept.device != p.device:
            kept = None
        words = _C.homo_encode(p, scales, block, levels, job.world, seed, words=kept)
        self._homo_words[job.name] = words
        if self.config.ef == "vanilla":  # e = p - D(own codes)
            _C.homo_decode(words, scales, p, block, levels, job.world, 1, -1.0, True)
        return words

    def homo_decode(self, job: Job, words: torch.Tensor, scales: torch.Tensor, block: int,
                    levels: int, alpha: float) -> torch.Tensor:
        out = self._part_out(job, Part(0, job.n, (), ""))
        _C.homo_decode(words, scales, out, block, levels, job.world, job.world, alpha, False)
        return out

    def finish(self, job: Job, pieces: list) -> torch.Tensor:
        grad = job.extra["grad"]
        out = job.extra.get("out")
        if out is None:  # the pieces were not written in place (two-level)
            out = torch.cat(pieces)
        if out.data_ptr() != grad.data_ptr() or not grad.is_contiguous():
            grad.copy_(out.view(grad.shape))
        # Whether the result is finite, where the kernels that wrote every piece found out.
        checked = job.extra.pop("checked", [])
        found = [next((f for t, f in checked if t is piece), None) for piece in pieces]
        if pieces and None not in found:
            job.extra["finite"] = all(found)
        self._end_bucket(job.name)
        return grad


def _checked(job: Job, out: torch.Tensor, finite: bool) -> None:
    """Notes that the aggregation that wrote out found it finite or not (TorchCodec.finish)."""
    job.extra.setdefault("checked", []).append((out, finite))


class TorchAdapter:
    """StateStore adapter: torch tensors <-> numpy arrays."""

    traced = False

    def zeros_like(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=like.dtype, device=like.device)

    def describe(self, t: torch.Tensor) -> tuple[tuple[int, ...], str]:
        return tuple(t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype))

    def to_numpy(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype in _NUMPY_VIEW:
            t = t.to(_NUMPY_VIEW[t.dtype])
        return t.numpy().copy()

    def from_numpy(self, a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        # A copy: a slot sharing the loaded array's memory would change the caller's state dict
        # (an elastic commit, a checkpoint kept in memory) as training goes on.
        return torch.from_numpy(np.array(a)).to(dtype=like.dtype, device=like.device)

    def new_counter(self, value: int) -> list:
        return [value]

    def advance(self, counter: list) -> int:
        counter[0] += 1
        return counter[0] - 1

    def counter_value(self, counter: list) -> int:
        return counter[0]

    def set_counter(self, counter: list, value: int) -> None:
        counter[0] = value

    def backup(self, t: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
        if spare is None:
            return t.clone()
        return spare.copy_(t)

    def restore(self, t: torch.Tensor, saved: torch.Tensor) -> None:
        t.copy_(saved)

    def backup_counter(self, counter: list, spare) -> int:
        return counter[0]

    def restore_counter(self, counter: list, saved: int) -> None:
        counter[0] = saved

    def scale(self, t: torch.Tensor, factor: float) -> None:
        t.mul_(factor)
