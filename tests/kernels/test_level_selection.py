"""The per-level runs of tests/kernels really run at their level (conftest.py's parametrization)."""

from pagellm.kernels import native


def test_each_run_selects_its_level(cpu_isa):
    assert cpu_isa in native.host_levels() and native.level() == cpu_isa


def test_every_host_level_is_run(request):
    runs = {item.callspec.params["cpu_isa"] for item in request.session.items
            if item.originalname == "test_each_run_selects_its_level"}
    assert not runs or runs == set(native.host_levels())  # (none: deselected)
