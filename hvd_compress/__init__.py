"""hvd_compress: gradient compression for Horovod.

This package is the framework-neutral core (spec parsing, codec registry, state store,
statistics); it imports without Horovod, torch or TensorFlow. Frontends:
`hvd_compress.torch`.
"""
from .registry import CodecInfo, Param, codecs, get_codec
from .spec import CompressionConfig, parse_spec
from .state import StateStore
from .stats import CompressionStats
from .seeds import derive_seed, seed_name

__all__ = ["CodecInfo", "Param", "codecs", "get_codec", "CompressionConfig", "parse_spec",
           "StateStore", "CompressionStats", "derive_seed", "seed_name"]
__version__ = "0.1.0"
