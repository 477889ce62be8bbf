import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs: the memory soak (`make soak` runs "
                                       "it in full, `make test` shortened) and the Keras "
                                       "ResNet-50 bench smoke (`make bench-quick`)")


def pytest_collection_modifyitems(config, items):
    """HVDC_FIRST_CASES=1 keeps the first case of each test function: `make test` runs a suite
    in full under one launcher and, under the other, every test once, because what the launcher
    changes (Horovod's transport and controller) is exercised by any case of a test, while the
    cases themselves multiply the codecs, dtypes and modes that the full run covers already.
    A comma-separated list of module file names (test_tf_buckets.py,...) does so for those
    modules only, so that one job (one interpreter start per rank) runs some modules in full
    and others each test once."""
    only = os.environ.get("HVDC_FIRST_CASES", "")
    if only in ("", "0"):
        return
    modules = None if only == "1" else set(only.split(","))
    collected = {os.path.basename(item.nodeid.split("::")[0]) for item in items}
    if modules is not None and not modules <= collected:
        raise pytest.UsageError(f"HVDC_FIRST_CASES names {sorted(modules - collected)}, which "
                                f"this run did not collect; its modules: {sorted(collected)} "
                                f"(or 1 for all of them)")
    kept, dropped, seen = [], [], set()
    for item in items:
        path = item.nodeid.split("::")[0]
        key = (path, getattr(item, "originalname", item.name))
        first = modules is None or os.path.basename(path) in modules
        (dropped if first and key in seen else kept).append(item)
        seen.add(key)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _launched_ranks() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("HOROVOD_SIZE") or 1)


def pytest_runtest_logreport(report):
    """Under a launcher, a test that fails on one rank leaves the others waiting in a collective
    it will never issue: the job would hang until the outer time limit, and the failure's text,
    printed at the end of the session, would be lost with it. The failing rank prints it now and
    exits, and the launcher then stops the job with its exit status."""
    if report.failed and _launched_ranks() > 1:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("HOROVOD_RANK") or "?"
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}); stopping the "
                         f"job: the other ranks cannot go on without this one\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
