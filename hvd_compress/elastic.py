"""Elastic Horovod, for every frontend: which part of the compression state a reset keeps.

After a reset every rank must hold the same compression state. Step counters and the state every
rank holds alike (PowerSGD's Q, the loss-scale units) are rank 0's; the per-rank accumulators
(error-feedback residuals, momenta, DGC velocities, owner residuals of the compressed allreduce)
start again from zero on every rank. A residual is the part of that rank's own gradient not yet
sent: a new worker has none, and handing it rank 0's would send rank 0's unsent gradient once per
rank. Owner residuals are kept per chunk of a world-size-dependent chunking and mean nothing in
another world. Zeroing them loses at most the unsent remainder of the steps before the reset, as
when training starts.
"""
from __future__ import annotations

# Slot kinds every rank holds alike and that stay valid in a world of another size.
SHARED_KINDS = ("powersgd_qt",)


def shared_part(state: dict) -> dict:
    """`state` (a compression state dict) without the per-rank accumulators."""
    def keep(table):
        return {name: {k: v for k, v in kinds.items() if k in SHARED_KINDS}
                for name, kinds in table.items()}
    return {**state, "slots": keep(state["slots"]), "dtypes": keep(state["dtypes"])}
