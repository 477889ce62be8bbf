"""What the elastic training scripts share: the schedule of the job and the discovery file
they rewrite as it goes (tests/elastic/test_elastic.py describes the job)."""
import os
import time

HOSTS = os.environ["HVDC_ELASTIC_HOSTS"]
# kill: the worker dies (a failure: restore, then sync); remove: its host leaves the discovery
# output and it is let go (Horovod skips the sync when workers were only removed).
MODE = os.environ.get("HVDC_ELASTIC_MODE", "kill")
KILL_AT, GROW_AT, STEPS = 4, 8, 14


def write_hosts(text):
    with open(HOSTS + ".tmp", "w") as f:
        f.write(text)
    os.replace(HOSTS + ".tmp", HOSTS)


def wait_for_hosts(state):
    # Held here until the driver has seen the new hosts: check_host_updates() raises
    # HostsUpdatedInterrupt then, and the reset brings in the new world.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.2)
        state.check_host_updates()
    raise RuntimeError("the discovery script's change never came")


def after_step(state, dump, size):
    """The schedule, run by both scripts after each training step: at KILL_AT the second
    worker is killed (or its host removed), the step after is dumped, and at GROW_AT the slot is
    given back; every step is committed. `dump(event)` saves the state, `size()` is Horovod's."""
    state.step += 1
    if state.step == KILL_AT and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
        write_hosts("localhost:1\n")
        if MODE == "kill":
            os._exit(17)
    if state.step == KILL_AT + 1:
        dump(f"step{state.step}")
    state.commit()
    if state.step == KILL_AT and MODE == "remove" and size() == 2:
        wait_for_hosts(state)
    if state.step == GROW_AT and size() == 1:
        write_hosts("localhost:2\n")
        wait_for_hosts(state)
