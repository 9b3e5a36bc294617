"""The cluster tier's box: 2 nodes built once for the session, torn down after it."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import box as box_


@pytest.fixture(scope="session")
def box():
    ok, reason = box_.available()
    if not ok:
        pytest.skip(f"cluster in a box not available here: {reason}")
    with box_.Box(nodes=2, profile="unshaped") as built:
        yield built
