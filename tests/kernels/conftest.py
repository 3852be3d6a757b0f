"""Every kernel test runs once per instruction-set level this CPU can execute (native.host_levels()): the
wrappers load the level's build of each library, so a host with AVX-512 proves the avx2 and generic code too."""

import pytest

from pagellm.kernels import native


@pytest.fixture(autouse=True, params=native.host_levels())
def cpu_isa(request):
    """The level under test, selected for the test's duration."""
    with native.using(request.param) as level:
        yield level
