"""Compression specs: one format for every entry point.

    "topk,k=0.01,ef=vanilla,momentum=nesterov,mu=0.9"
    {"compressor": "topk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov", "seed": 7}

Both parse into a frozen, hashable `CompressionConfig`. Dict keys follow BytePS
(`compressor`, `k`, `scaling`, `ef`, `momentum`, `seed`); `codec` is accepted for `compressor`.
Anything unknown, missing or out of range raises ValueError naming the item and the valid ones.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping

from .registry import CodecInfo, codecs, get_codec

EF_CHOICES = ("none", "vanilla")
# auto: per tensor, the strategy that moves the fewest bytes; allreduce: the codec's allreduce
# family (Horovod's allreduce for linear codecs, else the compressed or homomorphic allreduce).
COLLECTIVE_CHOICES = ("auto", "allgather", "allreduce", "homomorphic")
MOMENTUM_CHOICES = ("none", "nesterov")
# How an allgather codec encodes a gradient bucket: as one tensor (one selection, scale or norm
# over the bucket; DGC's layer-free selection), or each member on its own, as without buckets.
GRANULARITY_CHOICES = ("bucket", "tensor")
DEFAULT_MU = 0.9
# Keys that decorate any codec rather than parametrise one.
DECORATOR_KEYS = ("ef", "momentum", "mu", "seed", "collective", "hierarchical", "bucket_mb",
                  "granularity", "autotune")


@dataclass(frozen=True)
class CompressionConfig:
    codec: str
    params: tuple[tuple[str, Any], ...]
    ef: str = "none"
    momentum: str = "none"
    mu: float = DEFAULT_MU
    seed: int = 0
    collective: str = "auto"
    hierarchical: bool = False
    node_fp16: bool = False  # hierarchical=fp16: a node's own legs carry float32 gradients as fp16
    # Gradient buckets of this many MiB (hvd_compress.buckets); None: the optimizer's argument
    # decides. How gradients are grouped for the wire, not what the state means: canonical()
    # leaves it out, so a checkpoint loads under another bucket size.
    bucket_mb: float | None = None
    granularity: str = "bucket"
    # Probe steps per arm of hvd_compress.autotune (0: always compress). Whether a step
    # compresses, not what the state means: canonical() leaves it out too.
    autotune: int = 0

    @property
    def info(self) -> CodecInfo:
        return get_codec(self.codec)

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def kernel_fields(self, n: int, step: int = 0) -> dict[str, Any]:
        """The codec's parameters as kernel arguments for a tensor of n elements at its
        step-th compression. Codec parameters are kernel fields of the same name (hvdc::Params,
        the TF op attributes); `k` is first resolved from a fraction to a count."""
        params = self.param_dict
        fields = {p.name: self.info.kept(params, n, step) if p.name == "k"
                  else p.kernel_value(params[p.name]) for p in self.info.params if p.kernel}
        fields.update(self.info.fixed)
        return fields

    @property
    def stepwise(self) -> bool:
        """Whether the kernel fields change from step to step (DGC's warm-up shrinks k)."""
        return self.param_dict.get("warmup_steps", 0) > 0

    def canonical(self) -> str:
        """The spec as a string with every default spelled out; equal configs, equal strings."""
        items = [self.codec] + [f"{k}={_fmt(v)}" for k, v in self.params]
        items += [f"ef={self.ef}", f"momentum={self.momentum}"]
        if self.momentum != "none":
            items.append(f"mu={_fmt(self.mu)}")
        items.append(f"seed={self.seed}")
        if self.collective != "auto":  # absent when default: specs saved before it still match
            items.append(f"collective={self.collective}")
        if self.hierarchical:
            items.append(f"hierarchical={'fp16' if self.node_fp16 else 'true'}")
        if self.granularity != "bucket":  # absent when default: specs saved before it match
            items.append(f"granularity={self.granularity}")
        return ",".join(items)

    def fingerprint(self) -> int:
        """A 31-bit digest of canonical(), for checking that all ranks run the same spec."""
        return zlib.crc32(self.canonical().encode()) & 0x7FFFFFFF

    def __str__(self) -> str:
        """Short form for logs and tables: the codec's parameters, decorators only when set."""
        items = [self.codec] + [f"{k}={_fmt(v)}" for k, v in self.params]
        if self.ef != "none" and not self.info.builtin_ef:
            items.append(f"ef={self.ef}")
        if self.momentum != "none":
            items += [f"momentum={self.momentum}", f"mu={_fmt(self.mu)}"]
        if self.seed:
            items.append(f"seed={self.seed}")
        if self.collective != "auto":
            items.append(f"collective={self.collective}")
        if self.hierarchical:
            items.append(f"hierarchical={'fp16' if self.node_fp16 else 'true'}")
        if self.granularity != "bucket":
            items.append(f"granularity={self.granularity}")
        if self.bucket_mb is not None:
            items.append(f"bucket_mb={_fmt(self.bucket_mb)}")
        if self.autotune:
            items.append(f"autotune={self.autotune}")
        return ",".join(items)


def momentum_fix(config: CompressionConfig, momentum: float) -> str | None:
    """The spec that trains where the optimizer applies momentum after an error-feedback codec,
    or None where nothing needs fixing. The residual holds what earlier steps did not send;
    momentum applied to the decoded gradient then amplifies each step's compression error for
    1/(1-mu) steps on top of it (measured: onebit,ef=vanilla with SGD momentum 0.9 diverges on
    digits, 10% accuracy). Moving the momentum before the codec, into the spec, compresses the
    momentum-corrected gradient instead (DGC's momentum correction).

    Codecs that sample elements whatever their values (random-k) get top-k instead: their
    residual sends each element in a burst about once every 1/k steps, and momentum on either
    side of the codec multiplies the bursts (measured on digits with momentum 0.9, randomk 1%:
    10% accuracy with the optimizer's momentum, NaN with momentum=nesterov,mu=0.9). Top-k with
    the spec's momentum trains there (96.7%, uncompressed 97.2%).

    PowerSGD's residual (its error_feedback parameter) amplifies alike: on the digits CNN with
    SGD momentum 0.9, rank 2 ended 3.36 points below uncompressed over 10 seeds, and 0.67 above
    it with momentum=nesterov,mu=0.9."""
    feeds_back = (config.ef == "vanilla" or config.info.builtin_ef
                  or config.param_dict.get("error_feedback") is True)
    if not feeds_back or config.info.replaces_momentum:
        return None
    if config.info.samples and (momentum or config.momentum != "none"):
        k = dict(config.params).get("k")
        topk = f"topk,k={_fmt(k)}" if k is not None else "topk"
        return f"{topk},ef=vanilla,momentum=nesterov,mu={_fmt(float(momentum or config.mu))}"
    if not momentum or config.momentum != "none":
        return None
    return f"{config},momentum=nesterov,mu={_fmt(float(momentum))}"


def spec_momentum(config: CompressionConfig) -> tuple[str, float, str] | None:
    """The momentum the spec takes over from the optimizer (whose own the frontends set to 0),
    as (kind, factor, state slot): ("nesterov", mu, "momentum") for momentum=nesterov, and
    ("heavy_ball", factor, velocity slot) for a codec that corrects momentum itself (DGC:
    u = m*u + g). The codec applies it to what it encodes; the frontends apply it, in the same
    slot, to every gradient that travels uncompressed (smaller than min_compress_bytes, fewer
    dimensions than the codec takes, codec none), which would otherwise train with no momentum
    at all. None: the optimizer keeps its own."""
    if config.momentum == "nesterov":
        return "nesterov", float(config.mu), "momentum"
    if config.info.replaces_momentum:
        param, slot = config.info.replaces_momentum
        return "heavy_ball", float(config.param_dict[param]), slot
    return None


def masks_momentum(config: CompressionConfig) -> bool:
    """Whether the spec's momentum is cleared wherever the codec leaves the residual zero
    (registry.CodecInfo.masks_momentum)."""
    return config.momentum == "nesterov" and config.ef == "vanilla" and config.info.masks_momentum


def sparse_momentum_error(config: CompressionConfig, name: str) -> str:
    """Why a sparse gradient cannot travel under a spec that took the optimizer's momentum."""
    what = config.codec if config.info.replaces_momentum else "momentum=nesterov"
    return (f"parameter {name!r} has a sparse gradient, which Horovod gathers uncompressed, and "
            f"{what} in the compression spec has replaced the optimizer's momentum, which it "
            f"could then not get: pass sparse_as_dense=True (the gradient is then compressed "
            f"like any other), or leave momentum to the optimizer")


def momentum_advice(config: CompressionConfig, momentum: float) -> str | None:
    """The warning that names momentum_fix's spec, or None."""
    fixed = momentum_fix(config, momentum)
    if fixed is None:
        return None
    if config.info.samples:
        return (f"{config.codec} with error feedback does not train with momentum (the "
                f"optimizer's, or momentum=nesterov in the spec): its residual sends each element "
                f"in bursts that momentum multiplies, and training diverges; use "
                f"compression=\"{fixed}\" or train {config.codec} without momentum")
    return (f"the optimizer applies momentum ({momentum}) after {config.codec}'s error feedback, "
            f"which amplifies the compression error and can diverge; move it into the "
            f"compression spec: compression=\"{fixed}\" (the optimizer's own momentum is then "
            f"set to 0)")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(where: str, kind: type, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if kind in (int, float):
        what = "an integer" if kind is int else "a number"
        if isinstance(value, bool):
            raise ValueError(f"{where} must be {what}, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be {what}, got {value!r}") from None
        if f != f or f in (float("inf"), float("-inf")):
            raise ValueError(f"{where} must be a finite number, got {value!r}")
        if kind is int:
            if not f.is_integer():
                raise ValueError(f"{where} must be an integer, got {value!r}")
            return int(f)
        return f
    return str(value)


def _split_string(spec: str) -> dict[str, Any]:
    parts = [p.strip() for p in spec.split(",")]
    if not parts or not parts[0]:
        raise ValueError(f"empty compression spec {spec!r}; it starts with a codec name, one of: "
                         f"{', '.join(c.name for c in codecs())}")
    out: dict[str, Any] = {}
    first = parts[0]
    rest = parts[1:]
    if "=" in first:
        rest = parts
    else:
        out["compressor"] = first
    for item in rest:
        if not item:
            raise ValueError(f"empty item in compression spec {spec!r}")
        if "=" not in item:
            raise ValueError(f"spec item {item!r} has no value: write {item}=VALUE")
        key, value = (s.strip() for s in item.split("=", 1))
        if not key or value == "":
            raise ValueError(f"spec item {item!r} needs both a name and a value")
        if key in out:
            raise ValueError(f"spec item {key!r} is given twice in {spec!r}")
        out[key] = value
    return out


def parse_spec(spec: Any) -> CompressionConfig:
    """Parse a string, dict or CompressionConfig (None means no compression)."""
    if isinstance(spec, CompressionConfig):
        return spec
    if spec is None:
        spec = "none"
    if isinstance(spec, str):
        items = _split_string(spec)
    elif isinstance(spec, Mapping):
        items = dict(spec)
        if "codec" in items:
            if "compressor" in items:
                raise ValueError("give the codec once: 'compressor' or 'codec', not both")
            items["compressor"] = items.pop("codec")
    else:
        raise ValueError(f"compression spec must be a string, a dict or a CompressionConfig, "
                         f"got {type(spec).__name__}")

    if "compressor" not in items:
        raise ValueError("compression spec names no codec: add compressor=NAME; valid codecs: "
                         + ", ".join(c.name for c in codecs()))
    info = get_codec(str(items.pop("compressor")).strip())

    ef = _coerce("ef", str, items.pop("ef", "vanilla" if info.builtin_ef else "none"))
    if ef not in EF_CHOICES:
        raise ValueError(f"ef={ef!r} is not valid; valid: {', '.join(EF_CHOICES)}")
    if info.builtin_ef and ef != "vanilla":
        raise ValueError(f"{info.name} has error feedback built in (it keeps what it did not "
                         f"send), so ef={ef} is not valid; leave ef unset")
    momentum = _coerce("momentum", str, items.pop("momentum", "none"))
    if momentum not in MOMENTUM_CHOICES:
        raise ValueError(f"momentum={momentum!r} is not valid; valid: {', '.join(MOMENTUM_CHOICES)}")
    if "mu" in items and momentum == "none":
        raise ValueError("mu is the momentum factor of momentum=nesterov; it has no effect "
                         "without it: add momentum=nesterov or drop mu")
    mu = _coerce("mu", float, items.pop("mu", DEFAULT_MU))
    if not 0.0 <= mu < 1.0:
        raise ValueError(f"mu must be in [0, 1), got {mu}")
    seed = _coerce("seed", int, items.pop("seed", 0))
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2^63), got {seed}")

    collective = _coerce("collective", str, items.pop("collective", "auto"))
    raw = items.pop("hierarchical", False)
    node_fp16 = isinstance(raw, str) and raw.strip().lower() == "fp16"
    try:
        hierarchical = node_fp16 or _coerce("hierarchical", bool, raw)
    except ValueError:
        raise ValueError(f"hierarchical must be true, false or fp16 (two-level, the node's own "
                         f"legs in float16), got {raw!r}") from None
    if hierarchical and info.rounds != 1:
        raise ValueError(f"{info.name} runs its own {info.rounds}-round pipeline; "
                         f"hierarchical=true is not supported with it")

    bucket_mb = None
    if "bucket_mb" in items:
        bucket_mb = _coerce("bucket_mb", float, items.pop("bucket_mb"))
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb must be a number of MiB >= 0 (0: no buckets), got "
                             f"{_fmt(bucket_mb)}")

    autotune = _coerce("autotune", int, items.pop("autotune", 0))
    if autotune < 0:
        raise ValueError(f"autotune must be a number of probe steps per arm >= 0 (0: always "
                         f"compress), got {autotune}")
    if autotune and info.name == "none":
        raise ValueError("autotune compares compressed steps with uncompressed ones; codec none "
                         "compresses nothing: drop autotune or name a codec")

    granularity = _coerce("granularity", str, items.pop("granularity", "bucket"))
    if granularity not in GRANULARITY_CHOICES:
        raise ValueError(f"granularity={granularity!r} is not valid; valid: "
                         f"{', '.join(GRANULARITY_CHOICES)}")
    if granularity != "bucket":
        if not info.per_member:
            valid = [c.name for c in codecs() if c.per_member]
            why = ("encodes each element on its own, the same either way" if info.elementwise
                   else "batches its matrices itself" if info.rounds != 1
                   else "travels by allreduce")
            raise ValueError(f"granularity=tensor encodes each member of a bucket as if it "
                             f"travelled alone, in one allgather; {info.name} {why}: valid for "
                             f"{', '.join(valid)}")
        if collective not in ("auto", "allgather"):
            raise ValueError(f"granularity={granularity} sends a bucket's members as one "
                             f"allgather: collective={collective} is not valid with it; valid: "
                             f"auto, allgather")

    params = []
    for p in info.params:
        if p.name in items:
            value = _coerce(f"{info.name}: {p.name}", p.kind, items.pop(p.name))
            if not p.check(value):
                raise ValueError(f"{info.name}: {p.name} must be {p.valid}, got {value!r}")
        else:
            value = p.default
        params.append((p.name, value))
    _check_rejects(info, dict(params), ef, momentum)
    fields = {p.name: p.kernel_value(v) for p, (_, v) in zip(info.params, params) if p.kernel}
    _check_collective(info, collective, {**fields, **dict(info.fixed)})
    if items:
        bad = sorted(items)[0]
        valid = [p.describe() for p in info.params] + list(DECORATOR_KEYS)
        raise ValueError(f"codec {info.name!r} has no parameter {bad!r}; valid: {', '.join(valid)}")
    return CompressionConfig(codec=info.name, params=tuple(params), ef=ef, momentum=momentum,
                             mu=mu, seed=seed, collective=collective, hierarchical=hierarchical,
                             node_fp16=node_fp16, bucket_mb=bucket_mb, granularity=granularity,
                             autotune=autotune)


def _check_collective(info: CodecInfo, collective: str, fields: dict) -> None:
    if collective not in COLLECTIVE_CHOICES:
        raise ValueError(f"collective={collective!r} is not valid; valid: "
                         f"{', '.join(COLLECTIVE_CHOICES)}")
    from .collectives import family
    if collective != "auto" and not family(info, collective, fields):
        valid = ["auto"] + [c for c in COLLECTIVE_CHOICES[1:] if family(info, c, fields)]
        raise ValueError(f"{info.name} cannot travel by collective={collective}; valid for "
                         f"{info.name}: {', '.join(valid)}")


def _check_rejects(info: CodecInfo, params: dict, ef: str, momentum: str) -> None:
    """Refuse combinations the codec's registry entry names as meaningless."""
    settings = {k: _fmt(v) for k, v in params.items()}
    settings.update(ef=ef, momentum=momentum)
    for combo, why in info.rejects:
        if all(settings.get(k) == v for k, v in (c.split("=") for c in combo.split(","))):
            raise ValueError(f"{info.name} with {combo} is refused: {why}")
