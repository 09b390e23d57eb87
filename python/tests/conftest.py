"""Fixtures: the package from this source tree, a real kvd per session.

The library and the daemon: $KVD_LIBKVCLIENT and $KVD_BIN (make check-python
sets both to its build dir), else the source tree's build/."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import kvd  # noqa: E402

# Load the library now, while $KVD_LIBKVCLIENT says which: a test that
# unsets it (test_library_lookup_order) would otherwise make the first load
# pick another tree's build/libkvclient.so, and every test would run
# against that one.
kvd._lib.load()


@pytest.fixture(scope="session")
def daemon():
    d = kvd.Daemon()
    yield d
    # a clean drain and exit is part of every run (as in the C tests)
    rc = d.stop()
    assert rc == 0, "kvd exited %s" % rc


@pytest.fixture
def sock(daemon):
    return daemon.socket
