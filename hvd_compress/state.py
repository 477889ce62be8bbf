"""Per-parameter compression state (error-feedback residuals, momentum buffers, step counters),
keyed by parameter name so it survives `zero_grad(set_to_none=True)` and checkpoints.

The store is framework-neutral: a frontend hands it an adapter that makes and converts its own
tensors. `state_dict()` holds plain numpy arrays so a checkpoint written by one frontend loads
into the other for a model with the same parameter names and shapes.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

FORMAT = "hvd_compress.state/1"


class TensorAdapter(Protocol):
    def zeros_like(self, like: Any) -> Any: ...
    def describe(self, t: Any) -> tuple[tuple[int, ...], str]: ...   # (shape, dtype name)
    def to_numpy(self, t: Any) -> np.ndarray: ...
    def from_numpy(self, a: np.ndarray, like: Any) -> Any: ...
    # Step counters: a Python int for eager frontends, a variable where steps run in a graph.
    def new_counter(self, value: int) -> Any: ...
    def advance(self, counter: Any) -> Any: ...      # the count before this call, then +1
    def counter_value(self, counter: Any) -> int: ...
    def set_counter(self, counter: Any, value: int) -> None: ...


class StateStore:
    """Slots are (parameter name, kind) -> tensor; kinds used today: "ef", "momentum"."""

    def __init__(self, adapter: TensorAdapter, spec: str = ""):
        self._adapter = adapter
        self._spec = spec
        self._slots: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, dict[str, np.ndarray]] = {}
        self._steps: dict[str, Any] = {}
        self._pending_steps: dict[str, int] = {}

    @property
    def spec(self) -> str:
        return self._spec

    @spec.setter
    def spec(self, value: str) -> None:
        """The spec the state now belongs to (a schedule switched codec parameters)."""
        self._spec = value

    def slot(self, name: str, kind: str, like: Any) -> Any:
        """The slot's tensor, created as zeros shaped like `like` on first use."""
        shape, dtype = self._adapter.describe(like)
        held = self._slots.setdefault(name, {}).get(kind)
        if held is not None:
            have = self._adapter.describe(held)
            if have != (shape, dtype):
                raise ValueError(f"parameter {name!r}: {kind} state is {have[1]}{list(have[0])} "
                                 f"but its gradient is now {dtype}{list(shape)}; parameter names "
                                 f"must identify the same tensors from step to step")
            return held
        saved = self._pending.get(name, {}).pop(kind, None)
        if saved is not None:
            if tuple(saved.shape) != tuple(shape):
                raise ValueError(f"parameter {name!r}: checkpointed {kind} state has shape "
                                 f"{list(saved.shape)}, the gradient has {list(shape)}")
            held = self._adapter.from_numpy(saved, like)
        else:
            held = self._adapter.zeros_like(like)
        self._slots[name][kind] = held
        return held

    def contains(self, name: str, kind: str) -> bool:
        """Whether the slot exists, live or waiting in a loaded checkpoint."""
        return kind in self._slots.get(name, {}) or kind in self._pending.get(name, {})

    def kinds(self, name: str) -> list[str]:
        """The live slots of a parameter."""
        return list(self._slots.get(name, {}))

    def peek(self, name: str, kind: str) -> Any:
        """The live slot, or None when it does not exist (yet)."""
        return self._slots.get(name, {}).get(kind)

    def next_step(self, name: str) -> Any:
        """This parameter's compression count so far, then counts one more."""
        counter = self._steps.get(name)
        if counter is None:
            counter = self._adapter.new_counter(self._pending_steps.pop(name, 0))
            self._steps[name] = counter
        return self._adapter.advance(counter)

    def names(self) -> list[str]:
        return sorted(set(self._slots) | set(self._steps))

    def state_dict(self) -> dict:
        slots: dict[str, dict[str, np.ndarray]] = {}
        dtypes: dict[str, dict[str, str]] = {}
        for name, kinds in self._pending.items():
            for kind, arr in kinds.items():
                slots.setdefault(name, {})[kind] = arr.copy()
        for name, kinds in self._slots.items():
            for kind, t in kinds.items():
                slots.setdefault(name, {})[kind] = self._adapter.to_numpy(t)
                dtypes.setdefault(name, {})[kind] = self._adapter.describe(t)[1]
        steps = dict(self._pending_steps)
        steps.update({name: self._adapter.counter_value(c) for name, c in self._steps.items()})
        return {"format": FORMAT, "spec": self._spec, "steps": steps, "slots": slots,
                "dtypes": dtypes}

    def load_state_dict(self, state: dict, strict_spec: bool = True) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not an hvd_compress state dict (format {got!r}, expected {FORMAT!r})")
        if strict_spec and state.get("spec") and self._spec and state["spec"] != self._spec:
            raise ValueError(f"compression state was saved with spec {state['spec']!r} but this "
                             f"optimizer runs {self._spec!r}; pass strict_spec=False to load "
                             f"it anyway")
        steps = {str(k): int(v) for k, v in state.get("steps", {}).items()}
        incoming: dict[str, dict[str, np.ndarray]] = {}
        for name, kinds in state.get("slots", {}).items():
            for kind, arr in kinds.items():
                incoming.setdefault(name, {})[kind] = np.asarray(arr)
        # Check every live slot before touching any, so a bad checkpoint changes nothing.
        for name, kinds in incoming.items():
            for kind, arr in kinds.items():
                held = self._slots.get(name, {}).get(kind)
                if held is not None:
                    shape, _ = self._adapter.describe(held)
                    if tuple(arr.shape) != tuple(shape):
                        raise ValueError(f"parameter {name!r}: checkpointed {kind} state has "
                                         f"shape {list(arr.shape)}, the live one {list(shape)}")
        # Live slots the checkpoint lacks start again from zero, as they did when it was saved.
        slots: dict[str, dict[str, Any]] = {}
        self._pending = {}
        for name, kinds in incoming.items():
            for kind, arr in kinds.items():
                held = self._slots.get(name, {}).get(kind)
                if held is not None:
                    slots.setdefault(name, {})[kind] = self._adapter.from_numpy(arr, held)
                else:
                    self._pending.setdefault(name, {})[kind] = arr
        self._slots = slots
        self._pending_steps = {}
        for name, counter in self._steps.items():
            self._adapter.set_counter(counter, steps.pop(name, 0))
        self._pending_steps = steps
