import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs (the memory soak); `make soak` runs "
                                       "them in full, `make test` shortened")
