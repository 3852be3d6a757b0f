"""Every test here runs its Triton launches under the interpreter where there is no CUDA device."""

import pytest

from tests.gpu import ON_GPU, interpreter


@pytest.fixture(autouse=True)
def _interpreted():
    with interpreter(not ON_GPU):
        yield
