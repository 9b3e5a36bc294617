"""Stand-in for the `conftest` module at the root of the Keras repository, which some of the
tests shipped in the wheel import (`from conftest import skip_if_backend`)."""

import pytest
from keras.src.backend import backend


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
