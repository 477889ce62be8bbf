import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs: the memory soak (`make soak` runs "
                                       "it in full, `make test` shortened) and the Keras "
                                       "ResNet-50 bench smoke (`make bench-quick`)")


def pytest_collection_modifyitems(config, items):
    """HVDC_FIRST_CASES=1 keeps the first case of each test function: `make test` runs a suite
    in full under one launcher and, under the other, every test once, because what the launcher
    changes (Horovod's transport and controller) is exercised by any case of a test, while the
    cases themselves multiply the codecs, dtypes and modes that the full run covers already."""
    if os.environ.get("HVDC_FIRST_CASES") != "1":
        return
    kept, dropped, seen = [], [], set()
    for item in items:
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        (dropped if key in seen else kept).append(item)
        seen.add(key)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
