"""Every kernel test runs once per instruction-set level this CPU can execute (native.host_levels()): its
`cpu_isa` fixture is the level it passes the wrappers (their `at`), so a host with AVX-512 proves the avx2 and
generic code too.
A test marked `across_levels` runs once and compares the levels itself (native.each_level); one marked
`levels(name, ...)` runs at those of them only (a kernel that exists at some levels, e.g. AVX-512 BF16 only)."""

import pytest

from pagellm.kernels.build import native


def pytest_configure(config):
    config.addinivalue_line("markers", "across_levels: runs once, comparing every host level itself")
    config.addinivalue_line("markers", "levels(*names): runs at these instruction-set levels only")


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("across_levels") is None:
        only = metafunc.definition.get_closest_marker("levels")
        levels = [lv for lv in native.host_levels() if only is None or lv in only.args]
        if not levels:  # e.g. an AVX-512-only kernel on an AVX2 CPU: say so rather than "empty parameter set"
            levels = [pytest.param(only.args[0], marks=pytest.mark.skip(
                reason=f"exists at the {', '.join(only.args)} level only, which this CPU cannot run"))]
        metafunc.parametrize("cpu_isa", levels, indirect=True)


@pytest.fixture(autouse=True)  # autouse: in every test's fixtures, so pytest_generate_tests can parametrize it
def cpu_isa(request):
    """The level under test (the process default where a test runs once)."""
    return getattr(request, "param", native.default_level())

