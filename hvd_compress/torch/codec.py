"""One codec bound to torch tensors: the per-parameter compress / reduce / decode steps that the
optimizer and the stock-protocol compressors share. Everything numeric happens in the kernels
of csrc/; this module only allocates tensors and picks kernel arguments from the registry.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..seeds import derive_seed, seed_name
from ..spec import CompressionConfig
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
    p = _C.Params()
    for name, value in cfg.kernel_fields(n, step).items():
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


class TorchCodec:
    def __init__(self, config: CompressionConfig, store: StateStore | None, rank: int = 0,
                 world: int = 1):
        self.config = config
        self.info = config.info
        self.store = store
        self.rank, self.world = rank, world

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
            _C.ef_encode(info.kernel_id, x, self._slot(name, "ef", x), self._carry(name, x), kp,
                         payload)
        else:
            _C.encode(info.kernel_id, x, kp, payload)
        if info.variable_size:
            # 1-D: Horovod gathers payloads of any length back to back.
            payload = payload[:_C.encoded_bytes(info.kernel_id, payload, x, kp)]
        elif not info.linear:
            # [1, bytes]: ranks whose payload sizes differ fail Horovod's allgather shape check.
            payload = payload.view(torch.uint8).view(1, -1)
        return Encoded(payload, kp, grad.shape, grad.dtype, grad.device)

    def _carry(self, name: str, like: torch.Tensor) -> torch.Tensor:
        size = self.info.ef_carry
        if not size:
            return _NO_CARRY
        return self._slot(name, "ef_carry", torch.zeros(size, device=like.device))

    def settle(self) -> None:
        """Bring every lazily kept residual to its plain form (a no-op for the state's meaning);
        called before the state is read or checkpointed."""
        if self.store is None or self.config.ef != "vanilla" or not self.info.ef_carry:
            return
        for name in self.store.names():
            e = self.store.peek(name, "ef")
            if e is not None:
                _C.ef_settle(self.info.kernel_id, e, self._carry(name, e))

    def _slot(self, name: str, kind: str, like: torch.Tensor) -> torch.Tensor:
        if self.store is None:
            raise ValueError(f"{kind} state needs parameter names: use "
                             f"hvd_compress.torch.DistributedOptimizer")
        return self.store.slot(name, kind, like)

    def decode(self, reduced: torch.Tensor, enc: Encoded, alpha: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """out = alpha * D(reduced): the allreduced payload of a linear codec."""
        out = self._out(enc, out)
        _C.decode(self.info.kernel_id, reduced, out, enc.params, alpha, False)
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


class TorchAdapter:
    """StateStore adapter: torch tensors <-> numpy arrays."""

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
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=like.dtype, device=like.device)

    def new_counter(self, value: int) -> list:
        return [value]

    def advance(self, counter: list) -> int:
        counter[0] += 1
        return counter[0] - 1

    def counter_value(self, counter: list) -> int:
        return counter[0]

    def set_counter(self, counter: list, value: int) -> None:
        counter[0] = value
