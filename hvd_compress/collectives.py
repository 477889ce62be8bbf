"""Collective strategies: how one gradient's payloads travel between ranks and are reduced.

A strategy is a named piece that any codec's registry entry can list in `strategies`. The spec's
`collective=auto|allgather|allreduce|homomorphic` narrows the choice, and `choose()` picks per
tensor the strategy under which this rank sends the fewest bytes (a tie keeps the earlier one in
the entry: one compression and no second error, so at 2 ranks nothing changes).

Each strategy is a plan written once for every frontend: a generator that calls the frontend's
kernel operations (`ops`, see `Ops`) and yields the Horovod collectives it needs (`Allreduce`,
`Alltoall`, `Allgather`), receiving each one's result. PyTorch issues each yielded collective
asynchronously and resumes the plan only when the result is needed, so communication overlaps
backward; TensorFlow resumes it at once (its graph runs Horovod's ops asynchronously itself).

allreduce: Horovod's allreduce of the payload, for linear codecs (a sum of payloads is the
    payload of the sum). Bytes per rank: 2(n-1)/n payloads.
allgather: every rank's payload to every rank, decoded and reduced locally.
    Bytes per rank: (n-1) payloads, growing with the rank count. Between two ranks over Gloo,
    the payloads travel as a sum instead (`gather_rows`, `gather_sized`): Gloo's allgather
    sends one direction at a time there, its allreduce both at once.
compressed_allreduce (BytePS two-level compression, DeepSpeed 1-bit Adam, Bagua ByteGrad):
    1. each rank encodes its gradient in n chunks (n = ranks of the process set), with its
       worker residual (or the codec's own state) for each chunk;
    2. alltoall sends chunk j to rank j;
    3. rank j decodes the n payloads of its chunk and sums them in the kernels' accumulator
       (float32, float64 for float64 gradients);
    4. rank j encodes that sum again, with its own owner residual for the chunk when error
       feedback is on (BytePS's server-side EF; DeepSpeed's server error), and allgather shares
       the encoded chunks;
    5. every rank decodes all chunks into the gradient, so all ranks hold identical results.
    Bytes per rank: about 2(n-1)/n payloads, flat as ranks grow.
homomorphic (THC, NSDI 2024), for quantisers with evenly spaced levels (minmax8, dithering with
    linear levels, qsgd, terngrad):
    1. ranks agree on one scale per block of the gradient: the max of |x| over all ranks, by a
       small allreduce (op max) of every rank's block maxima;
    2. each rank quantises with the shared scales into unsigned codes 0..L by unbiased
       stochastic rounding, packed into lanes of int32 words wide enough that the sum of n
       ranks' codes cannot carry into the next lane (lane bits: those of L * n);
    3. Horovod's plain allreduce sums the words (it wraps modulo 2^32, lanes never carry), with
       its own fusion, ring or tree, on any transport;
    4. every rank decodes the summed words once.
    No decode or encode in between, and no second error. Bytes per rank: 2(n-1)/n of the
    words, which widen by log2(n) bits per element as ranks grow.
two-level (`hierarchical=true`, for nodes of several ranks; Horovod's hierarchical allreduce
    splits the work the same way):
    1. the ranks of a node alltoall the gradient, uncompressed, so that local rank l holds the
       node's shard l of every rank's gradient, and sum it (local process set);
    2. shard l travels between nodes by the codec's own strategy (any of the above, chosen by
       cost for the node count) among the ranks of local rank l (cross process set), with its
       error feedback and momentum state kept per shard;
    3. the node allgathers the reduced shards (local process set): as the encoded bytes that
       step 2 left on every rank of the cross set (the allgather's payloads, the compressed
       allreduce's owner chunks), each rank decoding every shard, where those are fewer bytes
       than the decoded shards; otherwise the decoded shards (in float16 under fp16).
    Only step 2 crosses nodes: the codec's bytes per rank fall by the node's rank count.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, Generator, Protocol

from .registry import CodecInfo, get_codec
from .seeds import seed_name
from .spec import CompressionConfig

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
COMPRESSED_ALLREDUCE = "compressed_allreduce"
HOMOMORPHIC = "homomorphic"

# Which strategies each value of the spec's `collective` admits.
_FAMILIES = {"allgather": (ALLGATHER,),
             "allreduce": (ALLREDUCE, COMPRESSED_ALLREDUCE, HOMOMORPHIC),
             "homomorphic": (HOMOMORPHIC,)}

# Elements that share one agreed scale under the homomorphic strategy (minmax8: its chunk).
HOMOMORPHIC_BLOCK = 4096

# Chunk boundaries fall on multiples of this many elements, so no 64-bit word of packed sign
# bits or codes straddles two owners and no chunk is split finer than a cache line of floats.
CHUNK_ALIGN = 64


def family(info: CodecInfo, collective: str, fields: dict,
           pair_sum: bool = False) -> tuple[str, ...]:
    """The codec's strategies, for these kernel fields, that `collective` admits. auto: all of
    them, except that linear codecs keep Horovod's allreduce unless the allgather travels as a
    sum (`pair_sum`: two ranks over Gloo), which then goes first. Horovod's Gloo sums half
    precision slowly, so fp16 by our gathered sum wins there; under MPI the gathered sum was
    slower (docs/benchmarks.md). allreduce: ours (compressed or homomorphic) where the codec
    has one, so that forcing it on fp16 sums in float32 instead of Horovod's half precision."""
    own = tuple(s for s in info.strategies
                if s != HOMOMORPHIC or info.homomorphic_levels(fields) is not None)
    if collective == "auto":
        if not info.linear:
            return own
        return (ALLGATHER, ALLREDUCE) if pair_sum and ALLGATHER in own else (ALLREDUCE,)
    admitted = tuple(s for s in own if s in _FAMILIES[collective])
    ours = tuple(s for s in admitted if s != ALLREDUCE)
    return ours or admitted


# ---- collectives a plan asks for ------------------------------------------------------------
# `group` of a request: None for the job's process set, LOCAL for the ranks of this rank's node,
# CROSS for the ranks of this rank's local rank on every node (the two-level strategy's sets).
LOCAL, CROSS = "local", "cross"


@dataclass
class Allreduce:
    tensor: Any
    name: str
    op: str = "sum"  # or "max"
    group: str | None = None


@dataclass
class Allgather:
    """1-D payloads, concatenated in rank order. `rows`: every rank's payload has this rank's
    size, so the frontend sends it as one row and Horovod refuses ranks whose sizes differ."""
    tensor: Any
    name: str
    rows: bool = False
    group: str | None = None


@dataclass
class Alltoall:
    """1-D bytes; splits[j] of them go to rank j. The result is what every rank sent this one,
    concatenated in rank order."""
    tensor: Any
    splits: list[int]
    name: str
    group: str | None = None


# ---- one gradient's reduction -----------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """Elements [start, stop) of the flattened gradient, encoded as one tensor."""
    start: int
    stop: int
    fields: tuple  # kernel fields as sorted (name, value) pairs
    seed_key: str  # the name seeds are derived from (seeds.derive_seed / seed_base)
    index: int = 0  # which of the tensor's parts (empty chunks share a start)

    @property
    def n(self) -> int:
        return self.stop - self.start

    @property
    def field_dict(self) -> dict:
        return dict(self.fields)


@dataclass
class Job:
    """What a plan knows of one gradient in one step. `step` is the frontend's step counter
    (an int, or a graph tensor) for seeds; `fields_step` the Python int that step-dependent
    kernel fields (DGC's warm-up) are computed from."""
    name: str
    n: int
    itemsize: int
    config: CompressionConfig
    rank: int
    world: int
    average: bool
    opname: str
    step: Any = 0
    fields_step: int = 0
    # The node layout for the two-level strategy: (local rank, local size, cross rank, cross size).
    nodes: tuple[int, int, int, int] | None = None
    strategy: str = ALLGATHER
    # Horovod runs its collectives over Gloo (hvd.gloo_enabled()): see gather_rows.
    gloo: bool = False
    wire_bytes: float = 0.0  # this rank's bytes on the wire by the cost model, for stats
    payload_bytes: int = 0   # bytes of this rank's own payloads (all chunks), for stats
    extra: dict = field(default_factory=dict)  # the frontend's own per-job data
    # A gradient bucket's members as (name, elements), in the order they fill it; empty for a
    # gradient alone. Read under granularity=tensor (selections).
    members: tuple[tuple[str, int], ...] = ()

    @property
    def info(self) -> CodecInfo:
        return self.config.info


class Ops(Protocol):
    """What a frontend provides to the plans (hvd_compress.torch.codec.TorchCodec,
    hvd_compress.tensorflow.codec.TFCodec)."""

    def prepare(self, job: Job) -> Any: ...
    """The gradient as a 1-D contiguous tensor, worker-side momentum applied."""

    def flat(self, job: Job) -> Any: ...
    """The gradient as a 1-D contiguous tensor, as it is."""

    def as_bytes(self, t: Any) -> Any: ...
    def from_bytes(self, b: Any, job: Job, half: bool = False) -> Any: ...
    """A 1-D tensor as bytes, and back to the gradient's dtype (to float16 with half)."""

    def own_size(self, payload: Any, rank: int) -> Any: ...
    """int32 [2]: the payload's bytes at index rank, 0 at the other (summed: both sizes)."""

    def words(self, job: Job, payload: Any, sizes: Any = None) -> Any: ...
    """The payload's bytes as int32 words: a copy, zero-padded to a whole word, or to the
    larger of own_size()'s summed sizes. The frontend may keep its buffer for the job's next
    step (torch does), as it may pair_rows' result."""

    def pair_rows(self, job: Job, payload: Any, sent: Any, summed: Any, rank: int,
                  sizes: Any = None) -> Any: ...
    """From the sum of two ranks' words(), both payloads in rank order, flat: what an allgather
    of them returns (the other's of its size in sizes, else of this one's). sent: this rank's
    words as given to the allreduce, where it left them (torch's sums in place: the sum)."""

    def reduce_pair(self, job: Job, payload: Any, summed: Any, part: Part, info: CodecInfo,
                    alpha: float) -> Any: ...
    """What reduce_into gives for both ranks' payloads (codecs with pair_aggregates), from
    this rank's payload and the sum of both payloads' words(), without gathering them."""

    def to_half(self, t: Any) -> Any: ...
    def widen(self, t: Any, job: Job) -> Any: ...
    """A tensor cast to float16, and from float16 to the gradient's dtype
    (hierarchical=fp16)."""

    def sum_rows(self, job: Job, rows: Any, ranks: int, n: int, alpha: float) -> Any: ...
    """alpha * (row 0 + row 1 + ...) of `ranks` rows of n elements laid back to back (the
    gradient's dtype or float16), added in rank order in the kernels' accumulator type, in the
    gradient's dtype."""

    def encode_part(self, job: Job, x: Any, part: Part, info: CodecInfo,
                    state: str | None) -> Any: ...
    """The payload of x (the part's elements) as a 1-D tensor: the wire dtype for linear codecs,
    else bytes. state: "worker" uses the tensor's residual or codec state sliced to the part,
    "owner" the owner residual of the part, None none."""

    def mark_nonfinite(self, job: Job, x: Any, payload: Any) -> Any: ...
    """The payload (values in x's dtype) with its first value NaN where x holds a NaN or inf."""

    def size(self, payload: Any) -> int: ...
    def concat(self, tensors: list) -> Any: ...
    def split(self, t: Any, sizes: list[int]) -> list: ...
    def columns(self, gathered: Any, ranks: int, start: int, stop: int) -> Any: ...
    """Bytes [start, stop) of every rank's row of an allgather of equal-size payloads, as
    `ranks` rows."""

    def reduce(self, job: Job, payloads: Any, part: Part, info: CodecInfo, ranks: int,
               alpha: float) -> Any: ...
    """alpha * the reduction (aggregation) of `ranks` payloads of the part laid back to back."""

    def reduce_into(self, job: Job, payloads: Any, part: Part, info: CodecInfo, ranks: int,
                    alpha: float) -> Any: ...
    """The same, written into the output where the frontend can."""

    def decode_part(self, job: Job, payload: Any, part: Part, info: CodecInfo,
                    alpha: float) -> Any: ...
    """alpha * D(payload) for the part; written into the output where the frontend can."""

    def walk(self, job: Job, gathered: Any, parts: list[Part], info: CodecInfo) -> list[int]: ...
    """Sizes of variable-size payloads (one per part) gathered back to back."""

    def homo_source(self, job: Job, x: Any) -> Any: ...
    """What the homomorphic strategy quantises: x, or x + the residual (kept in the residual)."""

    def homo_absmax(self, job: Job, p: Any, block: int) -> Any: ...
    def homo_encode(self, job: Job, p: Any, scales: Any, block: int, levels: int,
                    seed_key: str) -> Any: ...
    """int32 words of p's codes (error feedback: the residual becomes p - D(own codes))."""

    def homo_decode(self, job: Job, words: Any, scales: Any, block: int, levels: int,
                    alpha: float) -> Any: ...

    def finish(self, job: Job, pieces: list) -> Any: ...
    """The reduced gradient from the decoded parts, in order, shaped like the gradient."""


Plan = Generator[Any, Any, Any]


# ---- parts --------------------------------------------------------------------------------------
def chunk_bounds(n: int, world: int, align: int = CHUNK_ALIGN) -> list[int]:
    """world + 1 boundaries splitting n elements into contiguous, nearly equal chunks on
    multiples of `align`; chunks past the end are empty (n < world * align)."""
    bounds = [min(n, (j * n // world + align - 1) // align * align) for j in range(world)]
    return bounds + [n]


def carry_kind(parts: int) -> str:
    """The state kind of the sign codecs' lazy residual scales (csrc ef_encode's carry) for a
    tensor encoded in `parts` parts, one scale each: each chunk of the compressed allreduce keeps
    its own, so no chunk settles another's. A kind per count, so a checkpoint (saved settled,
    its carries zero) still loads under another world size."""
    return "ef_carry" if parts == 1 else f"ef_carry/{parts}"


def carry_parts(kind: str) -> int:
    """How many parts a carry kind serves; 0 when `kind` is not one."""
    if kind == "ef_carry":
        return 1
    return int(kind[len("ef_carry/"):]) if kind.startswith("ef_carry/") else 0


def _fields(config: CompressionConfig, n: int, step: int, k: int | None) -> tuple:
    # Every tensor asks for its fields several times a step, and they change with the step
    # only under a warm-up: cached, so that a model of many small tensors does not pay for
    # them in Python on every call.
    return _fields_of(config, n, step if config.stepwise else 0, k)


@functools.lru_cache(maxsize=4096)
def _fields_of(config: CompressionConfig, n: int, step: int, k: int | None) -> tuple:
    f = config.kernel_fields(n, step)
    if k is not None and "k" in f:
        f["k"] = k
    return tuple(sorted(f.items()))


def whole(job: Job) -> Part:
    cfg, info = job.config, job.info
    return Part(0, job.n, _fields(cfg, job.n, job.fields_step, None),
                seed_name(job.name, job.rank, info.seed_per_rank))


def selections(job: Job) -> list[Part]:
    """The parts the allgather strategy encodes a gradient in: the whole of it, or under
    granularity=tensor each member of a bucket as if it travelled alone (its own k and
    selection, its own scale or norm, seeds of its own name), their payloads back to back in
    one collective.
    Threshold selects element by element, so it is the same either way: it stays whole."""
    if not _per_member(job):
        return [whole(job)]
    cfg, info = job.config, job.info
    parts, at = [], 0
    for i, (name, n) in enumerate(job.members):
        parts.append(Part(at, at + n, _fields(cfg, n, job.fields_step, None),
                          seed_name(name, job.rank, info.seed_per_rank), i))
        at += n
    return parts


def _per_member(job: Job) -> bool:
    # asked of every tensor every step: no parts are made to answer it
    return (len(job.members) > 1 and job.config.granularity == "tensor"
            and not job.info.variable_size)


def part_bounds(job: Job) -> list[int]:
    """Where the chosen strategy's plan cuts the gradient into the parts it encodes."""
    if job.strategy == COMPRESSED_ALLREDUCE:
        return chunk_bounds(job.n, job.world)
    if job.strategy == ALLGATHER:
        return [p.start for p in selections(job)] + [job.n]
    return [0, job.n]


def chunks(job: Job, owner_key: bool = False) -> list[Part]:
    """The world chunks of the gradient. A kept count k (top-k, DGC) is shared out in proportion
    to chunk length, summing to the whole tensor's k. owner_key: seeds of the owners' second
    encoding (each chunk by its owner) instead of this rank's first."""
    cfg, info = job.config, job.info
    bounds = chunk_bounds(job.n, job.world)
    total = info.kept(cfg.param_dict, job.n, job.fields_step) if "k" in cfg.param_dict else None
    parts = []
    for j in range(job.world):
        a, b = bounds[j], bounds[j + 1]
        k = None
        if total is not None and job.n:
            k = total * b // job.n - total * a // job.n
        key = (seed_name(f"{job.name}/owner{j}", j, info.seed_per_rank) if owner_key
               else seed_name(f"{job.name}/chunk{j}", job.rank, info.seed_per_rank))
        parts.append(Part(a, b, _fields(cfg, b - a, job.fields_step, k), key, j))
    return parts


def server_info(info: CodecInfo) -> CodecInfo:
    return get_codec(info.server_codec) if info.server_codec else info


# ---- cost model -------------------------------------------------------------------------------
def wire_bytes(strategy: str, info: CodecInfo, itemsize: int, parts_whole: Part,
               parts: list[Part], world: int) -> float:
    """Bytes one rank sends per step under a strategy (averaged over ranks), from the codec's
    payload sizes: ring allreduce 2(w-1)/w of the payload, ring allgather (w-1)/w of all
    payloads, pairwise alltoall (w-1)/w of one rank's chunks."""
    w = world
    if w == 1:
        return 0.0
    if strategy == ALLREDUCE:
        return 2.0 * (w - 1) / w * info.payload_bytes(itemsize, parts_whole.n,
                                                      parts_whole.field_dict)
    if strategy == ALLGATHER:
        return (w - 1) * info.payload_bytes(itemsize, parts_whole.n, parts_whole.field_dict)
    if strategy == HOMOMORPHIC:
        levels, block = homomorphic_settings(info, parts_whole.field_dict)
        n = parts_whole.n
        words = homomorphic_words(n, levels, w)
        return 2.0 * (w - 1) / w * 4 * (words + -(-n // block))
    if strategy == COMPRESSED_ALLREDUCE:
        first = sum(info.payload_bytes(itemsize, p.n, p.field_dict) for p in parts)
        second = sum(server_info(info).payload_bytes(itemsize, p.n, p.field_dict) for p in parts)
        return (w - 1) / w * (first + second)
    raise ValueError(f"unknown collective strategy {strategy!r}")


def homomorphic_settings(info: CodecInfo, fields: dict) -> tuple[int, int]:
    """(L, block): codes 0..L, one agreed scale per block."""
    return info.homomorphic_levels(fields), fields.get("chunk", HOMOMORPHIC_BLOCK)


def homomorphic_words(n: int, levels: int, ranks: int) -> int:
    """int32 words for n codes whose sum over `ranks` ranks must fit its lane."""
    lanes = 32 // (levels * ranks).bit_length()
    if lanes < 1:
        raise ValueError(f"homomorphic: {levels} levels over {ranks} ranks need "
                         f"{(levels * ranks).bit_length()}-bit lanes, more than a 32-bit word")
    return -(-n // lanes)


def choose(job: Job) -> str:
    """The strategy for this gradient (sets job.strategy and job.wire_bytes)."""
    if job.config.hierarchical and job.nodes is not None:
        job.strategy = TWO_LEVEL
        job.wire_bytes = _inner(job, None).wire_bytes
        return TWO_LEVEL
    if _per_member(job):  # the members' payloads back to back: one allgather
        parts = selections(job)
        job.strategy = ALLGATHER
        job.wire_bytes = (job.world - 1) * sum(
            job.info.payload_bytes(job.itemsize, p.n, p.field_dict) for p in parts)
        return ALLGATHER
    job.strategy, job.wire_bytes = _cheapest(job.config, job.n, job.itemsize, job.world,
                                             job.fields_step if job.config.stepwise else 0,
                                             pair_sum(job))
    return job.strategy


@functools.lru_cache(maxsize=4096)
def _cheapest(config: CompressionConfig, n: int, itemsize: int, world: int,
              fields_step: int, pairs: bool) -> tuple[str, float]:
    """(strategy, its wire bytes): the costs depend on sizes only (not on the name or the rank),
    so every tensor of a shape shares one decision, made once."""
    job = Job(name="", n=n, itemsize=itemsize, config=config, rank=0, world=world,
              average=True, opname="", fields_step=fields_step)
    info = config.info
    allowed = family(info, config.collective, whole(job).field_dict, pairs)
    if world == 1 or len(allowed) == 1:
        best = allowed[0]
    else:
        parts = chunks(job)
        costs = [(wire_bytes(s, info, itemsize, whole(job), parts, world), i, s)
                 for i, s in enumerate(allowed)]
        best = min(costs)[2]
    return best, wire_bytes(best, info, itemsize, whole(job),
                            chunks(job) if best == COMPRESSED_ALLREDUCE else [], world)


# ---- the plans ----------------------------------------------------------------------------------
def _encode_whole(job: Job, ops: Ops) -> tuple[Part, Any, float]:
    """The gradient as one payload: (its part, the payload, alpha for the reduced result)."""
    prescale, alpha = job.info.average_factors(job.average, job.world)
    part = whole(job)
    job.extra["prescale"] = prescale
    x = ops.prepare(job)
    payload = ops.encode_part(job, x, part, job.info, "worker")
    if job.info.samples:
        payload = ops.mark_nonfinite(job, x, payload)
    job.payload_bytes = ops.size(payload)
    return part, payload, alpha


def run_allreduce(job: Job, ops: Ops) -> Plan:
    part, payload, alpha = _encode_whole(job, ops)
    reduced = yield Allreduce(payload, job.opname)
    return ops.finish(job, [ops.decode_part(job, reduced, part, job.info, alpha)])


def pair_sum(job: Job) -> bool:
    """Whether this job's equal-size allgathers travel as a sum (gather_rows)."""
    return job.gloo and job.world == 2


def gather_rows(job: Job, ops: Ops, payload: Any, name: str) -> Plan:
    """Every rank's payload, all of one size, concatenated in rank order: an allgather, or
    between two ranks over Gloo an allreduce of the payload's bytes as int32 words, from whose
    sum (modulo 2^32, as the homomorphic strategy relies on) each rank takes its own away to
    get the other's, bit for bit. Gloo's allgather between two ranks sends one way and then
    the other (the second rank to start sends its payload at once, and the notice that it can
    receive, which the first one waits for, queues behind it), so it took twice the link time;
    its allreduce sends both ways at once. Same bytes on the wire, plus up to 3 of padding."""
    if not pair_sum(job):
        return (yield Allgather(payload, name, rows=True))
    sent = ops.words(job, payload)
    summed = yield Allreduce(sent, name)
    return ops.pair_rows(job, payload, sent, summed, job.rank)


def gather_sized(job: Job, ops: Ops, payload: Any, name: str) -> Plan:
    """gather_rows for payloads whose sizes differ by rank (threshold): between two ranks over
    Gloo, a small allreduce tells each rank both sizes first, and the words of both payloads
    are as many as the larger one needs."""
    if not pair_sum(job):
        return (yield Allgather(payload, name))
    sizes = yield Allreduce(ops.own_size(payload, job.rank), name + ".sizes")
    sent = ops.words(job, payload, sizes)
    summed = yield Allreduce(sent, name)
    return ops.pair_rows(job, payload, sent, summed, job.rank, sizes)


def run_allgather(job: Job, ops: Ops) -> Plan:
    info = job.info
    if _per_member(job):
        return (yield from _allgather_selections(job, ops, selections(job)))
    part, payload, alpha = _encode_whole(job, ops)
    if info.variable_size:  # the size formula gave the capacity; this is what is sent
        job.wire_bytes = (job.world - 1) * job.payload_bytes
        gathered = yield from gather_sized(job, ops, payload, job.opname)
    elif info.pair_aggregates and pair_sum(job) and "blob" not in job.extra:
        # gather_rows' sum, decoded where it lands: the other rank's payload is not written out
        # and read back (25M elements on one core: 5 ms, against 50 ms for pair_rows and the
        # aggregation).
        summed = yield Allreduce(ops.words(job, payload), job.opname)
        return ops.finish(job, [ops.reduce_pair(job, payload, summed, part, info, alpha)])
    else:
        gathered = yield from gather_rows(job, ops, payload, job.opname)
    _keep(job, gathered)
    return ops.finish(job, _reduce_gathered(job, ops, gathered))


def _allgather_selections(job: Job, ops: Ops, parts: list[Part]) -> Plan:
    """A bucket under granularity=tensor: each member encoded and reduced as it would be alone,
    every rank's payloads of all members gathered in one collective."""
    info = job.info
    prescale, alpha = info.average_factors(job.average, job.world)
    job.extra["prescale"] = prescale
    x = ops.prepare(job)
    payloads = [ops.encode_part(job, xs, p, info, "worker")
                for xs, p in zip(ops.split(x, [p.n for p in parts]), parts)]
    payload = ops.concat(payloads)
    if info.samples:
        payload = ops.mark_nonfinite(job, x, payload)
    job.payload_bytes = ops.size(payload)
    gathered = yield from gather_rows(job, ops, payload, job.opname)
    pieces, at = [], 0
    for p, pl in zip(parts, payloads):
        size = ops.size(pl)
        rows = ops.columns(gathered, job.world, at, at + size)
        pieces.append(ops.reduce_into(job, rows, p, info, job.world, alpha))
        at += size
    return ops.finish(job, pieces)


def _reduce_gathered(job: Job, ops: Ops, gathered: Any) -> list:
    """Every rank's payload of the whole gradient, decoded and summed."""
    _, alpha = job.info.average_factors(job.average, job.world)
    return [ops.reduce_into(job, gathered, whole(job), job.info, job.world, alpha)]


def _gathered_bytes(job: Job) -> int:
    return job.world * job.info.payload_bytes(job.itemsize, job.n, whole(job).field_dict)


def run_compressed_allreduce(job: Job, ops: Ops) -> Plan:
    info, w, r = job.info, job.world, job.rank
    owner_codec = server_info(info)
    alpha = 1.0 / w if job.average else 1.0
    parts = chunks(job)
    x = ops.prepare(job)
    # 1. every chunk encoded by this rank, with its worker residual
    payloads = [ops.encode_part(job, xs, p, info, "worker")
                for xs, p in zip(ops.split(x, [p.n for p in parts]), parts)]
    splits = [ops.size(pl) for pl in payloads]
    job.payload_bytes = sum(splits)
    if info.variable_size:  # taking the owners' sums to be as sparse as what this rank sent
        job.wire_bytes = 2.0 * (w - 1) / w * job.payload_bytes
    # 2. chunk j to rank j
    received = yield Alltoall(ops.concat(payloads), splits, job.opname + ".scatter")
    # 3. this rank's chunk: every rank's payload decoded and summed
    mine = parts[r]
    summed = ops.reduce(job, received, mine, info, w, alpha)
    # 4. the sum encoded again by its owner, with the owner residual; shared with every rank
    owners = chunks(job, owner_key=True)
    again = ops.encode_part(job, summed, owners[r], owner_codec, "owner")
    gathered = yield Allgather(again, job.opname + ".gather")
    _keep(job, gathered)
    # 5. every chunk decoded into the gradient
    return ops.finish(job, _decode_owners(job, ops, gathered))


def _decode_owners(job: Job, ops: Ops, gathered: Any) -> list:
    """The owners' encoded chunks, decoded."""
    owner_codec, owners = server_info(job.info), chunks(job, owner_key=True)
    if owner_codec.variable_size:
        sizes = ops.walk(job, gathered, owners, owner_codec)
    else:
        sizes = [owner_codec.payload_bytes(job.itemsize, p.n, p.field_dict) for p in owners]
    return [ops.decode_part(job, pl, p, owner_codec, 1.0)
            for pl, p in zip(ops.split(gathered, sizes), owners)]


def _owner_bytes(job: Job) -> int:
    owner_codec = server_info(job.info)
    return sum(owner_codec.payload_bytes(job.itemsize, p.n, p.field_dict)
               for p in chunks(job, owner_key=True))


def run_homomorphic(job: Job, ops: Ops) -> Plan:
    info = job.info
    part = whole(job)
    levels, block = homomorphic_settings(info, part.field_dict)
    # Stochastic rounding draws independently on every rank, whatever the codec's own seeding.
    key = seed_name(f"{job.name}/homomorphic", job.rank, True)
    p = ops.homo_source(job, ops.prepare(job))
    # 1. one scale per block, agreed by all ranks
    scales = yield Allreduce(ops.homo_absmax(job, p, block), job.opname + ".scales", "max")
    # 2. codes packed into lanes that the sum over all ranks cannot overflow
    words = ops.homo_encode(job, p, scales, block, levels, key)
    job.payload_bytes = ops.size(words) + ops.size(scales)
    # 3. Horovod's allreduce adds the words, lane by lane
    summed = yield Allreduce(words, job.opname)
    # 4. decoded once
    alpha = 1.0 / job.world if job.average else 1.0
    return ops.finish(job, [ops.homo_decode(job, summed, scales, block, levels, alpha)])


def node_groups(layout: list[list[int]]) -> tuple[list[tuple], list[tuple]]:
    """The two-level strategy's groups from every rank's [local rank, local size, cross rank,
    cross size]: the ranks of each node (same cross rank) and of each local rank (same local
    rank on every node), each group's ranks in order. Frontends register them as Horovod
    process sets, every rank all of them in this order."""
    if len({row[1] for row in layout}) > 1:
        sizes = ", ".join(f"rank {r}: {row[1]}" for r, row in enumerate(layout))
        raise ValueError(f"hierarchical=true needs the same number of ranks on every node "
                         f"(local sizes {sizes})")
    nodes = sorted({tuple(r for r, row in enumerate(layout) if row[2] == c)
                    for c in {row[2] for row in layout}})
    crosses = sorted({tuple(r for r, row in enumerate(layout) if row[0] == lr)
                      for lr in {row[0] for row in layout}})
    return nodes, crosses


def register_node_sets(layout: list[list[int]], rank: int, add_process_set, everyone_set,
                       registered: dict) -> tuple[tuple, Any, Any]:
    """(this rank's layout row, its node's process set, its local rank's process set). Every
    group is registered with the frontend's `add_process_set` once per job (`registered`
    remembers them), on every rank in the same order; the group of all ranks is the global
    set, which Horovod refuses to register twice."""
    nodes, crosses = node_groups(layout)
    everyone = tuple(range(len(layout)))
    for ranks in nodes + crosses:
        if ranks not in registered:
            registered[ranks] = everyone_set if ranks == everyone else add_process_set(list(ranks))
    local = next(registered[r] for r in nodes if rank in r)
    cross = next(registered[r] for r in crosses if rank in r)
    return tuple(layout[rank]), local, cross


def check_node_sets_possible(global_set: bool) -> None:
    """Refuse hierarchical=true where its process sets cannot be registered."""
    if not global_set:
        raise ValueError("hierarchical=true builds its node process sets from all ranks; it "
                         "works with the global process set only")
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").lower() not in ("1", "true"):
        raise ValueError(
            "hierarchical=true registers a process set per node and per local rank, which "
            "needs Horovod's dynamic process sets: call hvd.init(process_sets='dynamic'), or "
            "launch with HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment (horovodrun passes "
            "it on; mpirun -x HOROVOD_DYNAMIC_PROCESS_SETS=1)")


def _inner(job: Job, shard: Any, local_rank: int | None = None) -> Job:
    """The cross-node job of a shard under the two-level strategy (this rank's by default)."""
    mine, local_size, cross_rank, cross_size = job.nodes
    local_rank = mine if local_rank is None else local_rank
    bounds = chunk_bounds(job.n, local_size)
    inner = Job(name=f"{job.name}/shard{local_rank}", n=bounds[local_rank + 1] - bounds[local_rank],
                itemsize=job.itemsize, config=replace(job.config, hierarchical=False),
                rank=cross_rank, world=cross_size, average=job.average,
                opname=f"{job.opname}.shard", step=job.step, fields_step=job.fields_step,
                gloo=job.gloo, extra={"grad": shard})
    choose(inner)
    return inner


def _in_group(gen: Plan, group: str) -> Plan:
    """A plan whose collectives run among `group` instead of the job's process set."""
    try:
        request = next(gen)
        while True:
            request.group = group
            request = gen.send((yield request))
    except StopIteration as done:
        return done.value


def _keep(job: Job, gathered: Any) -> None:
    """Hold a plan's last collective's result for the two-level strategy's node to share."""
    if "blob" in job.extra:
        job.extra["blob"] = gathered


# Strategies whose last collective leaves every rank the same encoded bytes of the whole
# result: (their size, from the registry's formulas; their decoder).
_SHAREABLE = {ALLGATHER: (_gathered_bytes, _reduce_gathered),
              COMPRESSED_ALLREDUCE: (_owner_bytes, _decode_owners)}


def node_share(job: Job) -> list[Job] | None:
    """Every shard's cross-node job when the node shares the encoded results of step 2 rather
    than the decoded shards (fewer bytes in step 3 for every shard together), else None.
    Every rank of a node computes the same answer from sizes alone."""
    _, local_size, _, cross_size = job.nodes
    if cross_size == 1:
        return None
    jobs = [_inner(job, None, j) for j in range(local_size)]
    if any(j.strategy not in _SHAREABLE or j.info.variable_size for j in jobs):
        return None
    width = 2 if job.config.node_fp16 and job.itemsize == 4 else job.itemsize
    encoded = sum(_SHAREABLE[j.strategy][0](j) for j in jobs)
    return jobs if encoded < job.n * width else None


def run_two_level(job: Job, ops: Ops) -> Plan:
    local_rank, local_size, _, cross_size = job.nodes
    bounds = chunk_bounds(job.n, local_size)
    x = ops.flat(job)
    # hierarchical=fp16: float32 gradients cross the node in float16 (summed in float32), half
    # the bytes of the legs that only the codec's inter-node leg compresses otherwise.
    half = job.config.node_fp16 and job.itemsize == 4
    shares = node_share(job)
    if half:
        x = ops.to_half(x)
    # 1. shard j of every rank's gradient to local rank j, summed (averaged over the node)
    pieces = [ops.as_bytes(x[bounds[j]:bounds[j + 1]]) for j in range(local_size)]
    received = yield Alltoall(ops.concat(pieces), [ops.size(p) for p in pieces],
                              job.opname + ".node_scatter", LOCAL)
    shard = ops.sum_rows(job, ops.from_bytes(received, job, half), local_size,
                         bounds[local_rank + 1] - bounds[local_rank],
                         1.0 / local_size if job.average else 1.0)
    # 2. the shard between nodes, by the codec's own strategy
    if cross_size > 1:
        inner = _inner(job, shard)
        if shares:
            inner.extra["blob"] = None
        shard = yield from _in_group(plan(inner, ops), CROSS)
        job.payload_bytes = inner.payload_bytes
    # 3. every shard to every rank of the node: encoded, decoded by each rank as its owner did
    if shares:
        gathered = yield Allgather(ops.as_bytes(inner.extra["blob"]),
                                   job.opname + ".node_gather", group=LOCAL)
        blobs = ops.split(gathered, [_SHAREABLE[j.strategy][0](j) for j in shares])
        pieces = []
        for j, (other, blob) in enumerate(zip(shares, blobs)):
            if j == local_rank:
                pieces.append(shard)
                continue
            other.extra.update(grad=shard, prescale=inner.extra.get("prescale", 1.0))
            pieces += _SHAREABLE[other.strategy][1](other, ops, blob)
        return ops.finish(job, pieces)
    gathered = yield Allgather(ops.as_bytes(ops.to_half(shard) if half else shard),
                               job.opname + ".node_gather", group=LOCAL)
    width = 2 if half else job.itemsize
    sizes = [(bounds[j + 1] - bounds[j]) * width for j in range(local_size)]
    return ops.finish(job, [ops.widen(ops.from_bytes(b, job, half), job)
                            for b in ops.split(gathered, sizes)])


TWO_LEVEL = "two_level"
PLANS = {ALLREDUCE: run_allreduce, ALLGATHER: run_allgather,
         COMPRESSED_ALLREDUCE: run_compressed_allreduce, HOMOMORPHIC: run_homomorphic,
         TWO_LEVEL: run_two_level}


def plan(job: Job, ops: Ops) -> Plan:
    """The chosen strategy's plan for this gradient (choose() first)."""
    return PLANS[job.strategy](job, ops)


def run_now(gen: Plan, perform) -> Any:
    """Drive a plan to its end, performing each collective at once (graph frontends)."""
    try:
        request = next(gen)
        while True:
            request = gen.send(perform(request))
    except StopIteration as done:
        return done.value
