"""Seeds shared by all ranks without communication: a pure function of the user's seed, the
parameter's name and its compression count. Python's hash() is salted per process, so names are
hashed with FNV-1a; nothing here touches a global random generator.
"""
from __future__ import annotations

_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:  # splitmix64 finaliser, as in csrc/cpu/randomk.cc
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def fnv1a64(text: str) -> int:
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h


def seed_base(seed: int, name: str) -> int:
    """The per-parameter part of derive_seed (csrc's step_seed adds the step)."""
    return _mix64((seed ^ fnv1a64(name)) & _MASK)


def derive_seed(seed: int, name: str, step: int) -> int:
    """64-bit kernel seed for one parameter at one step."""
    return _mix64((seed_base(seed, name) + step * 0x9E3779B97F4A7C15) & _MASK)


def seed_name(name: str, rank: int, per_rank: bool) -> str:
    """The name seeds are derived from: the parameter's own, or per rank for codecs whose draws
    must be independent across ranks (registry: seed_per_rank)."""
    return f"{name}@rank{rank}" if per_rank else name
