"""Waiting on Horovod handles without taking a core from the collective being waited for.

Horovod 0.28's `synchronize()` spins (poll, yield) until its background thread marks the
handle done. For CPU tensors that thread does the collective's work itself: copies into the
fusion buffer, Gloo's sums and socket I/O. Where ranks share cores (training on CPUs, or data
loader workers beside the ranks) the spinning main thread competes with it for the core. So the
optimizer polls instead and sleeps between polls, as Horovod itself did before (1 ms then);
the sleeps grow from 20 us to 200 us, so a wait ends at most about 0.2 ms late.
"""
from __future__ import annotations

import time

import horovod.torch as hvd

FIRST_SLEEP_S = 20e-6
MAX_SLEEP_S = 200e-6


def wait(handle):
    """hvd.synchronize(handle), sleeping rather than spinning while it is in flight."""
    delay = FIRST_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, MAX_SLEEP_S)
    return hvd.synchronize(handle)


def waiter(handle):
    """A callable for Horovod's optimizer loop, which calls callable handles for their result
    and would spin in synchronize() on a plain one."""
    return lambda: wait(handle)
