"""Gradient buckets: many gradients compressed and sent as one tensor.

Each compressed tensor costs a chain of kernel launches, a plan and a collective; a model of many
small tensors pays that cost per tensor (ResNet-50: 161, most of them small). A bucket gathers
the gradients that backward produces one after the other into one flat tensor, which goes
through the codec and the collective strategy like any gradient, once.

The layout is fixed at construction, from the parameters in the order backward is expected to
produce them (the reverse of the model's order, as DDP assumes), so that every rank builds the
same buckets and names them alike:
  1. a parameter joins the open bucket while the bucket stays within `bucket_bytes`, and of the
     same dtype;
  2. a parameter larger than `bucket_bytes` is cut into pieces of at most that size (BytePS
     partitions large tensors the same way), each piece its own bucket, so one embedding is not
     one long serial compression and collective;
  3. buckets smaller than the smallest size worth compressing are dissolved: their parameters
     travel uncompressed, as they would alone.

State stays keyed by parameter name: a bucket's error-feedback residual, momentum and codec state
are the concatenation of its members' own slots (the frontend gathers them for the step and
scatters them back), so checkpoints, elastic state and the other frontend keep reading state per
parameter, whatever the buckets.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """Elements [start, stop) of parameter `name`'s flattened gradient."""
    name: str
    start: int
    stop: int

    @property
    def n(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Bucket:
    index: int
    members: tuple[Member, ...]
    dtype: str

    @property
    def name(self) -> str:
        return f"hvd_compress.bucket{self.index}"

    @property
    def n(self) -> int:
        return sum(m.n for m in self.members)

    def named(self, present: list[Member]) -> str:
        """The name of the bucket sent with only `present` of its members (a step in which no
        rank has a gradient for the others): another composition, so another collective."""
        if len(present) == len(self.members):
            return self.name
        return f"{self.name}[{','.join(m.name for m in present)}]"


def bucket_bytes(bucket_mb: float | None, config=None) -> int:
    """The bucket size in bytes from an optimizer's `bucket_mb` argument (None: not given) and
    the spec's `bucket_mb` (CompressionConfig.bucket_mb), which set it alike; no buckets when
    neither does. Both given and different is an error, not a silent choice of one."""
    spec_mb = None if config is None else config.bucket_mb
    if bucket_mb is None:
        bucket_mb = 0 if spec_mb is None else spec_mb
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb < 0:
        raise ValueError(f"bucket_mb must be a number of MiB >= 0 (0: no buckets), got "
                         f"{bucket_mb!r}")
    if spec_mb is not None and spec_mb != bucket_mb:
        raise ValueError(f"bucket_mb={bucket_mb!r} is given to the optimizer but the compression "
                         f"spec says bucket_mb={spec_mb!r}; set it in one place")
    return int(bucket_mb * (1 << 20))


def layout(params: list[tuple[str, int, str, int]], max_bytes: int,
           min_bytes: int = 0) -> list[Bucket]:
    """Buckets over `params`, given as (name, elements, dtype, itemsize) in backward order."""
    groups: list[tuple[list[Member], str, int]] = []
    open_members: list[Member] = []
    open_bytes, open_dtype = 0, None

    def close():
        nonlocal open_members, open_bytes
        if open_members:
            groups.append((open_members, open_dtype, open_bytes))
        open_members, open_bytes = [], 0

    for name, n, dtype, itemsize in params:
        nbytes = n * itemsize
        if nbytes > max_bytes:
            close()
            pieces = -(-nbytes // max_bytes)
            bounds = [n * j // pieces for j in range(pieces + 1)]
            for a, b in zip(bounds, bounds[1:]):
                groups.append(([Member(name, a, b)], dtype, (b - a) * itemsize))
            continue
        if dtype != open_dtype or open_bytes + nbytes > max_bytes:
            close()
            open_dtype = dtype
        open_members.append(Member(name, 0, n))
        open_bytes += nbytes
    close()
    kept = [(members, dtype) for members, dtype, nbytes in groups if nbytes >= min_bytes]
    return [Bucket(i, tuple(members), dtype) for i, (members, dtype) in enumerate(kept)]
