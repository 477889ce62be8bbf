"""Per-parameter compression state (error-feedback residuals, momentum buffers, step counters),
keyed by parameter name so it survives `zero_grad(set_to_none=True)` and checkpoints.

A training step is a transaction on the store: between `begin()` and `commit()` the first touch
of a slot or step counter keeps a backup of it, and `rollback()` puts every touched one back, so
a step that is skipped (a non-finite gradient, or the user's choice) leaves no trace, not even in
the step counters that seed random draws. Only what the step touches is copied; each backup
buffer is kept for the next step (one per slot that steps touch: the state's memory doubles).
A slot that a kernel reads whole and writes whole (`rewrite()`) is not copied: the kernel writes
into the kept buffer, and the slot's old tensor becomes the backup.

The store is framework-neutral: a frontend hands it an adapter that makes and converts its own
tensors. `state_dict()` holds plain numpy arrays so a checkpoint written by one frontend loads
into the other for a model with the same parameter names and shapes.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

FORMAT = "hvd_compress.state/1"
_COUNTER = object()  # the kind under which a transaction keeps a step counter's backup
_UNITS = ("", object())  # the transaction's key for the loss scale and the waiting slots


class _Made:
    """A slot or counter created by the open step, and the checkpointed value it took."""

    def __init__(self, pending: Any):
        self.pending = pending


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
    # Step transactions: copy into `spare` (a backup this adapter made before, or None) and back.
    def backup(self, t: Any, spare: Any) -> Any: ...
    def restore(self, t: Any, saved: Any) -> None: ...
    def backup_counter(self, counter: Any, spare: Any) -> Any: ...
    def restore_counter(self, counter: Any, saved: Any) -> None: ...
    def scale(self, t: Any, factor: float) -> None: ...   # in place (StateStore.rescale)
    # True where steps run as traced graphs: a slot made during a step is a variable the trace
    # keeps using, so a rollback resets its value instead of removing it.
    traced: bool
    # Traced adapters only. scope(): the graph being built, which a conditional's branch has of
    # its own; restore_if(ran, t, saved): restore() where the tensor `ran` holds.
    def scope(self) -> Any: ...
    def restore_if(self, ran: Any, t: Any, saved: Any) -> None: ...


class StateStore:
    """Slots are (parameter name, kind) -> tensor; kinds used today: "ef", "momentum"."""

    def __init__(self, adapter: TensorAdapter, spec: str = ""):
        self._adapter = adapter
        self._spec = spec
        self._slots: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, dict[str, np.ndarray]] = {}
        self._steps: dict[str, Any] = {}
        self._pending_steps: dict[str, int] = {}
        # The open step: (name, kind) -> backup, or _Made for a slot the step created; counter
        # backups under (name, _COUNTER). None outside a step.
        self._txn: dict[tuple[str, str], Any] | None = None
        self._spares: dict[tuple[str, str], Any] = {}
        # The open step's rewritten slots (rewrite()): their backup is the slot's old tensor.
        self._rewritten: set[tuple[str, str]] = set()
        # Traced: the scope the step began in, and what it first touched inside a conditional
        # branch, whose backup is taken only where that branch runs.
        self._outer: Any = None
        self._inner: set = set()
        # The loss scale the gradient-unit state was accumulated at (None: no loss scaling).
        self._units: float | None = None

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
            self._check_like(name, kind, held, like)
            self._touch(name, kind, held)
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
        if self._txn is not None and not self._adapter.traced:
            # from_numpy may share the array's memory with the slot the step then changes
            self._txn[name, kind] = _Made(None if saved is None else saved.copy())
        else:
            self._touch(name, kind, held)
        return held

    def _check_like(self, name: str, kind: str, held: Any, like: Any) -> None:
        have, want = self._adapter.describe(held), self._adapter.describe(like)
        if have != want:
            raise ValueError(f"parameter {name!r}: {kind} state is {have[1]}{list(have[0])} "
                             f"but its gradient is now {want[1]}{list(want[0])}; parameter names "
                             f"must identify the same tensors from step to step")

    def rewrite(self, name: str, kind: str, like: Any) -> tuple[Any, Any]:
        """The slot for a kernel that reads it and writes every element of it: (src, dst), src
        holding the value and dst where the kernel writes, which is the slot from now on.

        The first time an open step touches the slot, dst is the buffer kept from earlier
        steps' backups and src, left as it was, is this step's backup: the kernel's own pass
        replaces the copy a backup costs. Otherwise (no step open, a traced frontend, a slot the
        step already touched or just created) src and dst are the slot, updated in place. A
        later call in the same step returns the same pair, for a kernel that writes the slot
        part by part."""
        key = (name, kind)
        if key in self._rewritten:
            return self._txn[key], self._slots[name][kind]
        if not self.movable(name, kind):
            held = self.slot(name, kind, like)
            return held, held
        held = self._slots[name][kind]
        self._check_like(name, kind, held, like)
        spare = self._spares.pop(key, None)
        if spare is None:
            spare = self._adapter.zeros_like(held)
        self.move(name, kind, spare)
        return held, spare

    def movable(self, name: str, kind: str) -> bool:
        """Whether move() can take the slot: a live slot the open (untraced) step has not
        touched yet."""
        return (self._txn is not None and not self._adapter.traced
                and kind in self._slots.get(name, {}) and (name, kind) not in self._txn)

    def move(self, name: str, kind: str, storage: Any) -> None:
        """For a kernel that reads the slot and writes every element of it into `storage`:
        `storage` holds the slot from now on, and the old tensor, left as it was, is the open
        step's backup. rewrite() moves a slot into a spare of its own; a frontend gives a view
        into a second buffer that a bucket's members share. Only where movable()."""
        if not self.movable(name, kind):
            raise RuntimeError(f"slot {kind} of {name!r} cannot move: it is not live or the "
                               f"open step already touched it")
        held = self._slots[name][kind]
        self._check_like(name, kind, held, storage)
        self._txn[name, kind] = held
        self._rewritten.add((name, kind))
        self._slots[name][kind] = storage

    def place(self, name: str, kind: str, storage: Any) -> Any:
        """Let `storage` (shaped like the slot: a frontend's view into a larger buffer) hold the
        slot from now on, with the value the slot has (live, checkpointed or zeros). The open
        step's backup stays valid: a rollback copies it back into `storage`."""
        held = self.slot(name, kind, storage)
        if held is not storage:
            self._adapter.restore(storage, held)
            self._slots[name][kind] = storage
        return storage

    def _touch(self, name: str, kind: str, held: Any) -> None:
        key = (name, kind)
        if self._txn is not None and key not in self._txn:
            self._txn[key] = self._adapter.backup(held, self._spares.get(key))
            self._note_scope(key)

    def _note_scope(self, key) -> None:
        if self._adapter.traced and self._adapter.scope() is not self._outer:
            self._inner.add(key)

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
        key = (name, _COUNTER)
        if counter is None:
            pending = self._pending_steps.pop(name, None)
            counter = self._adapter.new_counter(pending or 0)
            self._steps[name] = counter
            if self._txn is not None and not self._adapter.traced:
                self._txn[key] = _Made(pending)
        if self._txn is not None and key not in self._txn:
            self._txn[key] = self._adapter.backup_counter(counter, self._spares.get(key))
            self._note_scope(key)
        return self._adapter.advance(counter)

    # ---- step transactions ------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        return self._txn is not None

    def touched(self) -> bool:
        """Whether the open step has touched any state."""
        return bool(self._txn)

    def begin(self) -> None:
        """Open a step: what it touches from now on can be rolled back."""
        if self._txn is not None:
            raise RuntimeError("a compression step is already open; commit() or rollback() it")
        self._txn = {}
        self._rewritten = set()
        self._outer = self._adapter.scope() if self._adapter.traced else None
        self._inner = set()

    def touched_in_branches(self) -> bool:
        """Whether the open (traced) step first touched state inside a conditional branch."""
        return bool(self._inner)

    def touched_only_in_branches(self) -> bool:
        """Whether all the open (traced) step touched, it touched inside conditional branches:
        a step whose branches did not run has changed nothing."""
        return bool(self._txn) and all(key in self._inner for key in self._txn)

    def commit(self) -> None:
        """Keep what the open step did (no-op when none is open)."""
        if self._txn is None:
            return
        self._spares.update((k, v) for k, v in self._txn.items() if not isinstance(v, _Made))
        self._txn = None
        self._rewritten = set()

    def rollback(self, ran: Any = None) -> None:
        """Put every slot and counter the open step touched back as they were before it; slots
        and counters it created are removed (traced frontends: reset), and checkpointed values
        they had taken wait again (no-op when no step is open).

        ran (traced): a boolean tensor, whether the branches that touched state inside a
        conditional ran in this step. Where they did not, their backups were not taken and
        hold an older step's values, and the state they cover did not change: it is left."""
        txn, self._txn = self._txn, None
        rewritten, self._rewritten = self._rewritten, set()
        if txn is None:
            return
        inner, self._inner = self._inner, set()
        units = txn.pop(_UNITS, None)
        for (name, kind), saved in txn.items():
            if kind is _COUNTER:
                if isinstance(saved, _Made):
                    del self._steps[name]
                    if saved.pending is not None:
                        self._pending_steps[name] = saved.pending
                else:
                    self._restore(self._adapter.restore_counter, self._steps[name], saved,
                                  (name, kind) in inner, ran)
                    self._spares[name, kind] = saved
            elif isinstance(saved, _Made):
                del self._slots[name][kind]
                if saved.pending is not None:
                    self._pending.setdefault(name, {})[kind] = saved.pending
            elif (name, kind) in rewritten:  # the untouched old tensor is the slot again
                self._spares[name, kind] = self._slots[name][kind]
                self._slots[name][kind] = saved
            else:
                self._restore(self._adapter.restore, self._slots[name][kind], saved,
                              (name, kind) in inner, ran)
                self._spares[name, kind] = saved
        if units is not None:  # last: the waiting slots as they were before the step, whole
            self._units, self._pending = units

    def _restore(self, restore, t: Any, saved: Any, in_branch: bool, ran: Any) -> None:
        if in_branch and ran is not None:
            self._adapter.restore_if(ran, t, saved)
        else:
            restore(t, saved)

    # ---- dynamic loss scaling ---------------------------------------------------------------
    @property
    def loss_scale(self) -> float | None:
        return self._units

    def rescale(self, scale: float, scale_free: tuple[str, ...] = ()) -> None:
        """This step's gradients arrive multiplied by the loss scale `scale`: state kept at
        another scale (residuals, momenta, velocities, carries: every kind but `scale_free`) is
        multiplied by the ratio, so a residual saved at 2^16 is not added to a gradient at 2^15
        as if the units were the same. Part of the open step: a rollback undoes it."""
        old = self._units
        if old == scale:
            return
        if self._txn is not None and _UNITS not in self._txn:
            self._txn[_UNITS] = (old, {name: dict(kinds) for name, kinds in self._pending.items()})
        self._units = scale
        if old is None:  # the first scaled step: the state so far is taken to be at this scale
            return
        factor = scale / old
        for held in self.touch_scaled(scale_free):
            self._adapter.scale(held, factor)
        for kinds in self._pending.values():
            for kind, arr in kinds.items():
                if kind not in scale_free:
                    kinds[kind] = (arr * factor).astype(arr.dtype)

    def touch_scaled(self, scale_free: tuple[str, ...] = ()) -> list:
        """Every live slot in gradient units, touched by the open step: what a loss-scale
        change multiplies (a graph frontend, whose scale is a tensor, multiplies them itself)."""
        out = []
        for name, kinds in self._slots.items():
            for kind, held in kinds.items():
                if kind not in scale_free:
                    self._touch(name, kind, held)
                    out.append(held)
        return out

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
                "dtypes": dtypes, "loss_scale": self._units}

    def load_state_dict(self, state: dict, strict_spec: bool = True) -> None:
        """Replace the state; a step still open is forgotten (its rollback would undo the load)."""
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
        self._units = state.get("loss_scale")
        self._txn = None
        self._rewritten = set()
        self._spares = {}
        self._pending_steps = {}
        for name, counter in self._steps.items():
            self._adapter.set_counter(counter, steps.pop(name, 0))
        self._pending_steps = steps
