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
