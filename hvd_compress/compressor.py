"""What the frontends' Horovod-protocol compressors share: a parsed spec, variants by keyword,
value equality and hashing (Horovod's TF layer caches functions keyed on the compressor), the
refusals for uses Horovod's stock optimizers cannot serve, and the `Compression.<codec>`
namespace."""
from __future__ import annotations

from typing import Any, Callable

from .registry import codecs
from .spec import CompressionConfig, parse_spec


class CompressorBase:
    def __init__(self, config: CompressionConfig):
        self.config = config

    def __call__(self, **params: Any):
        """A variant with some parameters changed: `Compression.topk(k=0.001, ef="vanilla")`."""
        cfg = self.config
        spec = {"compressor": cfg.codec, **dict(cfg.params), "momentum": cfg.momentum,
                "seed": cfg.seed, "collective": cfg.collective,
                "hierarchical": "fp16" if cfg.node_fp16 else cfg.hierarchical}
        if not cfg.info.builtin_ef:
            spec["ef"] = cfg.ef
        if cfg.momentum != "none":
            spec["mu"] = cfg.mu
        spec.update(params)
        return type(self)(parse_spec(spec))

    def __repr__(self) -> str:
        return f"Compressor({self.config.canonical()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompressorBase) and type(other) is type(self) \
            and other.config == self.config

    def __hash__(self) -> int:
        return hash(self.config)

    def check_stock_use(self, ours: str) -> None:
        """Raise unless Horovod's own optimizer can carry this spec: it allreduces whatever
        compress() returns and passes no parameter name."""
        cfg, info = self.config, self.config.info
        if not info.linear:
            why = f" ({info.collective_note})" if info.collective_note else ""
            raise RuntimeError(
                f"{cfg.codec} payloads travel by allgather{why}; Horovod's stock optimizer would "
                f"allreduce them and sum packed bits. Use {ours}")
        if cfg.ef != "none" or cfg.momentum != "none":
            raise RuntimeError(
                f"ef={cfg.ef}, momentum={cfg.momentum}: error feedback and momentum keep state "
                f"per parameter name, which Horovod's stock optimizer does not pass to "
                f"compress(). Use {ours}")


class CompressionNamespace:
    """`Compression.<codec>` for every registered codec, plus `Compression.from_spec(spec)`."""

    def __init__(self, make: Callable[[CompressionConfig], CompressorBase]):
        self._make = make

    def from_spec(self, spec: Any) -> CompressorBase:
        if isinstance(spec, CompressorBase):
            return spec
        return self._make(parse_spec(spec))

    def __getattr__(self, name: str) -> CompressorBase:
        if name.startswith("_"):
            raise AttributeError(name)
        known = [c.name for c in codecs()]
        if name not in known:
            raise AttributeError(f"no codec {name!r}; valid codecs: {', '.join(known)}")
        return self._make(parse_spec(name))

    def __dir__(self):
        return ["from_spec"] + [c.name for c in codecs()]
