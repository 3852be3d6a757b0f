"""No import goes back up the layering (docs/ARCHITECTURE.md, "Layers"): the face (cli, server, bench, eval, llm)
-> the engine -> core and distributed -> runner and loader -> models -> layers -> kernels, with the config, the
platform and plain data types under everything. Function-level and TYPE_CHECKING imports count too: an annotation
that needs a higher layer's type is the same coupling."""

from __future__ import annotations

from tests.test_import_cycles import import_graph

# Higher imports lower; a module's layer is its own entry, else its folder's (pagellm.<folder>).
LAYERS = {
    "pagellm": 9, "pagellm.__main__": 9, "pagellm.cli": 8,
    "pagellm.server": 7, "pagellm.bench": 7,
    "pagellm.eval": 6, "pagellm.llm": 6,
    "pagellm.engine": 5, "pagellm.engine_errors": 5, "pagellm.engine_stats": 5, "pagellm.engine_steps": 5,
    "pagellm.engine_draft": 5,
    "pagellm.output_processor": 5,
    "pagellm.core": 4, "pagellm.distributed": 4,
    "pagellm.runner": 3, "pagellm.loader": 3,
    "pagellm.models": 2,
    "pagellm.layers": 1,
    "pagellm.kernels": 0,
    # under everything: settings, the host, plain data
    "pagellm.config": -1, "pagellm.platform": -1, "pagellm.collector": -1, "pagellm.sampling_params": -1,
    "pagellm.request": -1, "pagellm.outputs": -1, "pagellm.core.types": -1,
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"{module} has no layer: add it to LAYERS")


def test_no_import_goes_up_the_layering():
    upward = sorted(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
                    for module, targets in import_graph().items() for target in targets
                    if layer_of(target) > layer_of(module))
    assert not upward, "\n".join(upward)


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)
