"""The per-level runs of tests/kernels really run at their level (conftest.py's parametrization), and a test that
runs once gets the process's own level: the one its environment ($PAGELLM_CPU_ISA, $PAGELLM_NATIVE) configures,
which tests/lower_levels.py sets for each pass it starts."""

import os

import pytest

from pagellm.config import KernelConfig
from pagellm.kernels.cpu import elementwise
from pagellm.kernels.build import native


def test_each_run_selects_its_level(cpu_isa):
    assert cpu_isa in native.host_levels()
    # What a wrapper given it loads is that level's build (compiled with its flags), not the process default's.
    library = elementwise._LIBRARIES["rms_norm"]
    built = native.load(library.name, cpu_isa)
    if native.compiler() is None:  # nothing native at any level: the torch references run
        assert built is None and not library.available(cpu_isa)
    else:
        flags = native.build_flags(cpu_isa, native.host_extensions(cpu_isa, library.extensions))
        assert built._name == str(native.library_path(library.name, flags, native.compiler()))
        assert library.available(cpu_isa)


def test_every_host_level_is_run(request):
    runs = {item.callspec.params["cpu_isa"] for item in request.session.items
            if item.originalname == "test_each_run_selects_its_level"}
    assert not runs or runs == set(native.host_levels())  # (none: deselected)


@pytest.mark.across_levels
def test_a_single_run_gets_the_level_its_environment_configures(cpu_isa):
    # The level of KernelConfig()'s defaults, read from the environment as an engine's config reads it: a pass
    # that lower_levels.py starts with PAGELLM_CPU_ISA=avx2 runs avx2, one with PAGELLM_NATIVE=0 no kernels.
    off = os.environ.get("PAGELLM_NATIVE", "1") == "0"
    configured = None if off else native.resolve(os.environ.get("PAGELLM_CPU_ISA") or "auto")
    assert cpu_isa == native.default_level() == native.level_of(KernelConfig()) == configured
