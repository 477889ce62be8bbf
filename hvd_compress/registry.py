"""The codec registry: one entry per codec, the single place that states its name, parameters,
defaults, collective and wire layout. Frontends and optimizers read entries; they never branch
on a codec's name, so adding a codec means one kernel family in csrc/ plus one entry here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

# Gradient dtypes known to the kernels (codes match csrc/include/hvdc/kernels.h).
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Param:
    """One codec parameter: its type, default and the range it must lie in."""

    name: str
    kind: type
    default: Any
    valid: str
    doc: str
    check: Callable[[Any], bool] = field(default=lambda v: True, compare=False)
    choices: tuple[str, ...] = ()  # a named choice; the kernel gets its position
    kernel: bool = True  # passed to the kernels (else used by the frontend, e.g. a schedule)

    def describe(self) -> str:
        return f"{self.name} ({self.valid}, default {self.default!r})"

    def kernel_value(self, value: Any) -> Any:
        return self.choices.index(value) if self.choices else value


def choice(name: str, choices: tuple[str, ...], doc: str) -> Param:
    return Param(name, str, choices[0], " or ".join(choices), doc, lambda v: v in choices,
                 choices)


@dataclass(frozen=True)
class CodecInfo:
    """What a frontend needs to run a codec.

    collective: "allreduce" when payloads may be summed as they travel (linear codecs), else
    "allgather": every rank's payload is gathered and reduced locally by `aggregate`.
    aggregation: how gathered payloads combine: "mean" of the decoded values, or "majority"
    (sign of the vote, signSGD). Allreduce codecs sum (then average) their payloads.
    builtin_ef: error feedback is part of the codec (efsignsgd); ef=none is refused.
    uses_seed: the codec draws random numbers from the spec's seed (randomk).
    seed_per_rank: the draws differ between ranks (stochastic rounding: independent noise
    averages out), else every rank draws the same (randomk: the same indices everywhere).
    fixed: kernel fields the codec sets itself (qsgd and terngrad are fixed dithering settings).
    rejects: (decorator setting, why) pairs the spec refuses, e.g. ("momentum=nesterov", ...).
    variable_size: payload sizes differ between ranks and steps (threshold): gathered back to
    back, each payload's header giving its length.
    state_slots: per-parameter state tensors the kernel updates itself (DGC), kept in the store.
    min_dim: tensors with fewer dimensions travel uncompressed (DGC compresses weights only).
    replaces_momentum: set when the codec applies momentum itself (the optimizer's is turned
    off): (the parameter giving its momentum factor, the state slot holding the velocity). The
    frontends apply that heavy-ball momentum, in that slot, to the gradients the codec leaves
    uncompressed (spec.spec_momentum).
    strategies: the collective strategies (hvd_compress.collectives) its payloads can travel
    by; `collective=auto` picks among them per tensor by the bytes each rank sends.
    server_codec: what the owner of a chunk re-encodes its chunk's sum with under the compressed
    allreduce (DGC's sum is sent as plain top-k: the owner has no momentum to correct); None:
    the codec itself.
    homomorphic_levels: for quantisers whose levels are evenly spaced, the number of level gaps
    L (codes 0..L) their homomorphic variant uses, from the codec's parameters; None where the
    codec has no such variant.
    rounds: collectives per step. 1: compress, one collective, decode. 2 (PowerSGD): the
    frontend runs the codec's own two-allreduce pipeline (kernel_id is then unused).
    prescale_average: with op=Average the payload is divided by the world size before the sum
    (fp16: the sum of many ranks could overflow half precision).
    samples: the codec keeps elements drawn at random whatever their values (randomk), so a
    non-finite element not drawn would vanish from the step unseen: its payload (values in the
    gradient's dtype) gets a NaN first value when the input holds one, and the sum of payloads
    is NaN on every rank. Codecs that select by value send NaN and inf themselves.
    elementwise: each element is encoded from its own value alone (a cast), so a bucket gives
    the per-tensor result whatever its granularity.
    pair_aggregates: two ranks' payloads are reduced straight from the int32 sum of their words
    (the kernels' aggregate_pair: fp16, bf16, minmax8, natural and the dithering family),
    where two Gloo ranks gather by that sum (collectives.gather_rows): the other rank's payload
    is never written out whole.
    masks_momentum: under momentum=nesterov with error feedback, the momentum of every element
    left with a zero residual (each one sent whole, and any whose value to send was zero) is
    cleared as it is sent: DGC's momentum factor masking (Lin et al. 2018). Top-k sends an
    element once its residual has grown large, momentum included; the velocity left behind
    would push it on in the same direction, stale, until it is sent again (measured on the
    digits CNN, each tensor alone, momentum 0.9 over 5 seeds: 95.06% without, 97.39% with,
    uncompressed 96.78%). Not for codecs that send the same elements step after step
    (threshold): cleared every step, their momentum would be none (measured: MLP 97.22% to
    95.00%).
    """

    name: str
    kernel_id: int
    collective: str
    aggregation: str
    params: tuple[Param, ...]
    wire: str
    doc: str
    bits_per_element: Callable[[int], float]  # of the gradient itemsize; per kept element
                                              # for codecs with a `k`
    builtin_ef: bool = False
    uses_seed: bool = False
    prescale_average: bool = False
    collective_note: str = ""
    wire_dtype: str | None = None  # allreduce payload element type; None: the gradient's
    ef_carry: int = 0  # floats of lazy error-feedback state beside the residual (sign codecs)
    seed_per_rank: bool = False
    fixed: tuple[tuple[str, Any], ...] = ()
    rejects: tuple[tuple[str, str], ...] = ()
    variable_size: bool = False
    state_slots: tuple[str, ...] = ()
    scale_free_slots: tuple[str, ...] = ()  # state not in gradient units (loss scaling)
    min_dim: int = 0
    replaces_momentum: tuple[str, str] = ()
    strategies: tuple[str, ...] = ()
    server_codec: str | None = None
    homomorphic_levels: Callable[[dict], int | None] | None = None  # of the kernel fields
    rounds: int = 1
    samples: bool = False
    elementwise: bool = False  # each output element from its own input element alone (a cast)
    masks_momentum: bool = False
    pair_aggregates: bool = False

    def __post_init__(self):
        if not self.strategies:  # the codec's own collective, and for non-linear codecs the
            # compressed allreduce, whose owners decode, sum and encode again
            default = (("allreduce",) if self.linear
                       else ("allgather", "compressed_allreduce"))
            object.__setattr__(self, "strategies", default)

    @property
    def per_member(self) -> bool:
        """Whether encoding a bucket whole or member by member changes its result (the spec's
        granularity): for every codec that travels by allgather and does more than cast each
        element. It selects (top-k, DGC), takes a scale or norm over what it is given (the sign
        codecs, the quantisers) or draws from seeds of the tensor's name."""
        return not self.linear and self.rounds == 1 and not self.elementwise

    def payload_bytes(self, itemsize: int, n: int, fields: dict) -> int:
        """Bytes of one payload for n elements with these kernel fields, as the kernels'
        payload_bytes computes them (variable-size codecs: the capacity)."""
        return _PAYLOAD_BYTES[self.kernel_id](itemsize, n, fields)

    @property
    def linear(self) -> bool:
        return self.collective == "allreduce"

    def average_factors(self, average: bool, world: int) -> tuple[float, float]:
        """(prescale before the collective, alpha applied when decoding) for a reduction over
        `world` ranks: averaging divides up front where the codec asks for it, else at decode."""
        if not average:
            return 1.0, 1.0
        return (1.0 / world, 1.0) if self.prescale_average else (1.0, 1.0 / world)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def kept(self, params: dict, n: int, step: int = 0) -> int:
        """Elements kept out of n for the sparsifiers (`k`: fraction < 1, or count >= 1). With
        a `warmup_steps` parameter (DGC), a fraction starts at 25% and falls geometrically to k
        over that many steps (the paper's exponential warm-up, by step instead of epoch)."""
        k = params.get("k")
        if k is None:
            return n
        warmup = params.get("warmup_steps", 0)
        if k < 1 and step < warmup and k < WARMUP_START:
            k = WARMUP_START * (k / WARMUP_START) ** (step / warmup)
        if k < 1:
            return min(n, max(1, math.ceil(k * n))) if n > 0 else 0
        return min(n, int(k))


def _k_ok(v: float) -> bool:
    return v > 0 and (v < 1 or float(v).is_integer())


WARMUP_START = 0.25
K_PARAM = Param("k", float, 0.01, "a fraction in (0, 1) or an integer count >= 1",
                "elements kept: k < 1 is a fraction of the tensor, k >= 1 a count", _k_ok)
SCALING = Param("scaling", bool, True, "true or false",
                "decode to +-mean|x| (true) or +-1 (false)")
PARTITION = ("linear", "natural")
NORMALIZE = ("max", "l2", "clipped")  # "clipped" is TernGrad's, set by that codec only


def levels_param(default: int) -> Param:
    return Param("s", int, default, "an integer in [1, 127]",
                 "quantisation levels per sign", lambda v: 1 <= v <= 127)


def code_bits(s: int) -> int:
    """Bits of one dithering code: values -s..s, stored offset by s."""
    return (2 * s).bit_length()

def _round8(b: int) -> int:
    return (b + 7) // 8 * 8


def _dither_bytes(isz: int, n: int, f: dict) -> int:
    return 16 + _round8((n + 7) // 8 * code_bits(f["s"]))


# Payload sizes by kernel id, mirroring payload_bytes() in csrc/cpu (tests/unit compares them).
_PAYLOAD_BYTES: dict[int, Callable[[int, int, dict], int]] = {
    0: lambda isz, n, f: n * isz,
    1: lambda isz, n, f: 2 * n,
    2: lambda isz, n, f: 2 * n,
    3: lambda isz, n, f: 8 + 8 * ((n + 63) // 64),
    4: lambda isz, n, f: 8 + 8 * ((n + 63) // 64),
    5: lambda isz, n, f: 8 + 8 * ((n + 63) // 64),
    6: lambda isz, n, f: 8 + _round8(4 * f["k"]) + f["k"] * isz,
    7: lambda isz, n, f: f["k"] * isz,
    8: lambda isz, n, f: 8 + 8 * ((n + f["chunk"] - 1) // f["chunk"]) + _round8(n),
    9: _dither_bytes,
    10: lambda isz, n, f: 8 + _round8(n),
    11: lambda isz, n, f: 8 + _round8(4 * n) + n * isz,
    12: lambda isz, n, f: 16 + _round8(4 * f["k"]) + f["k"] * isz,
}

_REGISTRY: dict[str, CodecInfo] = {}


def register(info: CodecInfo) -> CodecInfo:
    if info.name in _REGISTRY:
        raise ValueError(f"codec {info.name!r} is already registered")
    _REGISTRY[info.name] = info
    return info


def codecs() -> list[CodecInfo]:
    """All registered codecs, in registration order."""
    return list(_REGISTRY.values())


def get_codec(name: str) -> CodecInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(_REGISTRY)}") from None


def _sign_bits(itemsize: int) -> float:
    return 1.0


register(CodecInfo(
    name="none", kernel_id=0, collective="allreduce", aggregation="mean", params=(),
    wire="the gradient itself", doc="no compression: Horovod's plain allreduce",
    bits_per_element=lambda isz: 8.0 * isz))
register(CodecInfo(
    name="fp16", kernel_id=1, collective="allreduce", aggregation="mean", params=(),
    wire="float16[n], pre-divided by the world size (overflow guard)",
    doc="cast to IEEE half precision, round to nearest even",
    bits_per_element=lambda isz: 16.0, prescale_average=True, wire_dtype="float16",
    strategies=("allreduce", "allgather", "compressed_allreduce"), pair_aggregates=True,
    collective_note="Horovod's allreduce, but gathered between two ranks over Gloo; "
                    "collective=allgather sums the gathered halves in float32 with our kernels"))
register(CodecInfo(
    name="bf16", kernel_id=2, collective="allgather", aggregation="mean", params=(),
    wire="bfloat16[n]", doc="cast to bfloat16, round to nearest even",
    bits_per_element=lambda isz: 16.0, elementwise=True, pair_aggregates=True,
    collective_note="linear, but Horovod 0.28.1 has no bfloat16 reduction: payloads are "
                    "decoded and summed in float32 by our kernels"))
register(CodecInfo(
    name="onebit", kernel_id=3, collective="allgather", aggregation="mean", params=(SCALING,),
    wire="[u32 tag][f32 scale][sign bits, 64 per u64 word]",
    doc="1 bit per element (x < 0), decoded to +-scale, scale = mean|x| (BytePS onebit)",
    bits_per_element=_sign_bits, ef_carry=1))
register(CodecInfo(
    name="signsgd", kernel_id=4, collective="allgather", aggregation="majority",
    params=(SCALING,), wire="[u32 tag][f32 scale][sign bits, 64 per u64 word]",
    doc="signSGD with majority vote: sign of the summed signs, times the mean scale",
    bits_per_element=_sign_bits, ef_carry=1))
register(CodecInfo(
    name="efsignsgd", kernel_id=5, collective="allgather", aggregation="mean", params=(),
    wire="[u32 tag][f32 scale][sign bits, 64 per u64 word]",
    doc="EF-signSGD (Karimireddy et al. 2019): p = g + e, sign(p) * |p|_1/n, e = p - decoded; "
        "error feedback fused into the kernel",
    bits_per_element=_sign_bits, builtin_ef=True, ef_carry=1))
register(CodecInfo(
    name="topk", kernel_id=6, collective="allgather", aggregation="mean", params=(K_PARAM,),
    wire="[u32 tag][u32 k][i32 indices, ascending][k values, gradient dtype]",
    doc="the k largest magnitudes (ties: lower index first), fixed k per tensor",
    bits_per_element=lambda isz: 32 + 8 * isz, masks_momentum=True))
register(CodecInfo(
    name="randomk", kernel_id=7, collective="allreduce", aggregation="mean",
    params=(K_PARAM, Param("rescale", bool, False, "true or false",
                           "multiply kept values by n/k (unbiased; not with ef)")),
    wire="k values in the gradient dtype; indices regenerated from the shared seed",
    doc="one random element per stratum of ~n/k, indices from (seed, step, parameter name) "
        "identical on all ranks, so values are allreduced and no index is sent",
    bits_per_element=lambda isz: 8 * isz, uses_seed=True, samples=True,
    rejects=(("rescale=true,ef=vanilla",
              "error feedback would carry the n/k-scaled values back as residual and grow them "
              "every step; use rescale=true without ef, or ef=vanilla with rescale=false"),)))
# Quantisers with evenly spaced levels can also be summed as integer codes (homomorphic).
_QUANTISER_STRATEGIES = ("allgather", "compressed_allreduce", "homomorphic")


def _dither_levels(fields: dict) -> int | None:
    """Codes 0..2s for linear levels; natural (power-of-two) levels are not evenly spaced."""
    return 2 * fields["s"] if fields["partition"] == 0 else None


register(CodecInfo(
    name="minmax8", kernel_id=8, collective="allgather", aggregation="mean",
    params=(Param("chunk", int, 4096, "an integer in [1, 2^31-1]",
                  "elements sharing one min/max pair", lambda v: 1 <= v < 2**31),),
    wire="[u32 tag][u32 chunk][f32 min, f32 max per chunk][u8 codes]",
    doc="8-bit min-max quantisation (Bagua ByteGrad): per chunk, 256 evenly spaced levels "
        "between its min and max, rounded to nearest",
    bits_per_element=lambda isz: 8.0 + 64.0 / 4096,  # + a min/max pair per default chunk
    strategies=_QUANTISER_STRATEGIES, homomorphic_levels=lambda f: 255, pair_aggregates=True))

_DITHER_WIRE = ("[u32 tag][u8 s, partition, normalize, 0][f32 norm][u32 0][codes s+-level, "
                "bit width of 2s each, 8 codes per that many bytes]")
register(CodecInfo(
    name="dithering", kernel_id=9, collective="allgather", aggregation="mean",
    params=(levels_param(8),
            choice("partition", PARTITION, "level spacing: l/s, or 0 and 2^(l-s)"),
            Param("normalize", str, "max", "max or l2", "what |x| is divided by",
                  lambda v: v in ("max", "l2"), NORMALIZE)),
    wire=_DITHER_WIRE,
    doc="random dithering (Horvath et al. 2019): |x|/norm rounded stochastically to one of s "
        "levels, unbiased; codes bit-packed",
    bits_per_element=lambda isz: float(code_bits(8)), uses_seed=True, seed_per_rank=True,
    strategies=_QUANTISER_STRATEGIES, homomorphic_levels=_dither_levels, pair_aggregates=True))
register(CodecInfo(
    name="qsgd", kernel_id=9, collective="allgather", aggregation="mean",
    params=(levels_param(127),), wire=_DITHER_WIRE,
    doc="QSGD (Alistarh et al. 2017): dithering with s linear levels of |x|/||x||_2",
    bits_per_element=lambda isz: float(code_bits(127)), uses_seed=True, seed_per_rank=True,
    fixed=(("partition", 0), ("normalize", 1)),
    strategies=_QUANTISER_STRATEGIES, homomorphic_levels=_dither_levels, pair_aggregates=True))
register(CodecInfo(
    name="terngrad", kernel_id=9, collective="allgather", aggregation="mean",
    params=(Param("clip", float, 2.5, "a number > 0",
                  "clip |x| at clip * std(x) before scaling (Wen et al.)", lambda v: v > 0),),
    wire=_DITHER_WIRE,
    doc="TernGrad (Wen et al. 2017): {-1, 0, +1} x max|x| after clipping at clip * std(x), "
        "stochastic and unbiased for the clipped gradient",
    bits_per_element=lambda isz: float(code_bits(1)), uses_seed=True, seed_per_rank=True,
    fixed=(("s", 1), ("partition", 0), ("normalize", 2)),
    strategies=_QUANTISER_STRATEGIES, homomorphic_levels=_dither_levels, pair_aggregates=True))
register(CodecInfo(
    name="natural", kernel_id=10, collective="allgather", aggregation="mean", params=(),
    wire="[u32 tag][i32 top exponent][u8 sign << 7 | exponent code per element]",
    doc="natural compression (Horvath et al. 2019): stochastic rounding to a power of two, "
        "unbiased; sign and 7-bit exponent in one byte",
    bits_per_element=lambda isz: 8.0, uses_seed=True, seed_per_rank=True, pair_aggregates=True))


register(CodecInfo(
    name="threshold", kernel_id=11, collective="allgather", aggregation="mean",
    params=(Param("threshold", float, 0.01, "a number >= 0", "send elements with |x| > threshold",
                  lambda v: v >= 0),),
    wire="[u32 tag][u32 count][i32 indices, ascending][count values, gradient dtype]; size "
         "varies by rank and step",
    doc="every element above a fixed magnitude; payloads of any size, never empty (a header "
        "always travels)",
    bits_per_element=lambda isz: 32 + 8 * isz, variable_size=True,
    collective_note="variable-size payloads gathered back to back"))
register(CodecInfo(
    name="dgc", kernel_id=12, collective="allgather", aggregation="mean",
    params=(Param("k", float, 0.001, K_PARAM.valid, "target density (fraction) or count",
                  _k_ok),
            Param("momentum_factor", float, 0.9, "a number in [0, 1)",
                  "momentum correction: u = m*u + g, v = v + u", lambda v: 0 <= v < 1),
            Param("clip_norm", float, 0.0, "a number >= 0 (0: off)",
                  "local gradient clipping to this L2 norm before momentum", lambda v: v >= 0),
            Param("warmup_steps", int, 0, "an integer >= 0",
                  "density falls from 25% to k over this many steps", lambda v: v >= 0,
                  kernel=False)),
    wire="[u32 tag][u32 k][u32 count][u32 0][i32 indices[k], ascending][k values]; fixed size",
    doc="Deep Gradient Compression (Lin et al. 2018): momentum correction, threshold from a 1% "
        "sample adapted to the target density, momentum factor masking, optional clipping and "
        "warm-up; weights only (dim > 1)",
    bits_per_element=lambda isz: 32 + 8 * isz, builtin_ef=True,
    state_slots=("dgc_velocity", "dgc_accumulator"), min_dim=2,
    replaces_momentum=("momentum_factor", "dgc_velocity"), server_codec="topk",
    rejects=(("momentum=nesterov", "DGC corrects momentum itself (momentum_factor); a second, "
              "worker-side momentum would apply it twice"),)))


register(CodecInfo(
    name="powersgd", kernel_id=-1, collective="allreduce", aggregation="mean",
    params=(Param("rank", int, 1, "an integer >= 1", "rank of the approximation P Q^T",
                  lambda v: v >= 1, kernel=False),
            Param("start_iter", int, 1000, "an integer >= 0",
                  "plain allreduce for this many steps first (as PyTorch's PowerSGDState)",
                  lambda v: v >= 0, kernel=False),
            Param("min_compression_rate", float, 2.0, "a number >= 1",
                  "compress a matrix only if rows*cols / ((rows+cols)*rank) reaches this",
                  lambda v: v >= 1, kernel=False),
            Param("error_feedback", bool, True, "true or false",
                  "keep what the approximation missed and add it next step", kernel=False),
            Param("warm_start", bool, True, "true or false",
                  "start each step's power iteration from the last Q", kernel=False),
            Param("orthogonalization_epsilon", float, 0.0, "a number >= 0",
                  "added to column norms in Gram-Schmidt (guards zero columns)",
                  lambda v: v >= 0, kernel=False),
            Param("batch_same_shape", bool, False, "true or false",
                  "stack matrices of equal shape: one kernel call and one allreduce per shape "
                  "and round", kernel=False)),
    wire="P (rows x rank) then Q (cols x rank), float32 (float64 for float64 gradients)",
    doc="PowerSGD (Vogels et al. 2019): rank-r power iteration, P and Q allreduced in two rounds, "
        "error feedback and warm start; 1-D and weakly compressible tensors go uncompressed",
    bits_per_element=lambda isz: 0.0, builtin_ef=False, uses_seed=True,
    rounds=2, scale_free_slots=("powersgd_qt",),
    collective_note="two allreduces per step, P then Q",
    rejects=(("ef=vanilla", "PowerSGD keeps its own residual (error_feedback=true, the "
              "default); a second one would add it twice"),)))


_STRATEGY_NAMES = {"allreduce": "allreduce", "allgather": "allgather",
                   "compressed_allreduce": "compressed allreduce",
                   "homomorphic": "homomorphic allreduce"}


def codec_table() -> str:
    """The README's codec table, generated so the documentation cannot drift from the registry."""
    lines = ["| codec | parameters (default) | collective | bytes on the wire per fp32 element | "
             "what it sends |",
             "|---|---|---|---|---|"]
    for c in codecs():
        params = ", ".join(f"`{p.name}` ({p.default!r})" for p in c.params) or "-"
        if c.builtin_ef:
            params += "; error feedback built in"
        if c.uses_seed:
            params += "; uses `seed`" + (" (per rank)" if c.seed_per_rank else "")
        if c.rounds == 2:
            wire = "(rows + cols) * rank * 4 per matrix"
        elif c.variable_size:
            wire = f"{c.bits_per_element(4) / 8:g} per sent element + 8-byte header"
        elif "k" in [p.name for p in c.params]:
            per_kept = c.bits_per_element(4) / 8
            k = c.param("k").default
            wire = f"{per_kept:g} per kept element ({per_kept * k:g} at k={k:g})"
        else:
            wire = f"{c.bits_per_element(4) / 8:g}"
            if c.collective == "allgather":
                wire += " + 8-byte header" if c.name != "bf16" else ""
        collective = " / ".join(_STRATEGY_NAMES[s] for s in c.strategies)
        collective += f" ({c.collective_note})" if c.collective_note else ""
        if c.aggregation == "majority":
            collective += ", majority vote"
        lines.append(f"| `{c.name}` | {params} | {collective} | {wire} | {c.wire} |")
    return "\n".join(lines)
