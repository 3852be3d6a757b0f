"""Random weights in place of a checkpoint (`--load-format dummy`, vLLM's name and meaning): any model shape can
be run and measured from its config.json alone, without downloading its weights.

Each parameter of the model built on the meta device is drawn uniform in [-1e-3, 1e-3] (vLLM's range: small
enough that activations stay finite through any depth), directly on the device the model loads to, from one
seeded generator, so two loads of the same config in the same layout are the same model (under tensor
parallel each rank draws its own shards: not slices of the one-process model).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

DUMMY_RANGE = 1e-3


def dummy_weights(model: nn.Module, device: torch.device | str, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every parameter of `model` under its own name, which is the checkpoint's for every
    family (load_weights takes both: tests/loader/test_dummy_load.py), for `model.load_weights`."""
    # The names now: quantized loading swaps placeholders in for the layers it quantizes before it reads any
    # weight, and they would hide those layers' weights from a lazy walk over the parameters.
    shapes = [(name, parameter.shape, parameter.dtype) for name, parameter in model.named_parameters()]
    return _drawn(shapes, torch.device(device), seed)


def _drawn(shapes, device: torch.device, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape, dtype in shapes:
        yield name, torch.empty(shape, dtype=dtype, device=device).uniform_(-DUMMY_RANGE, DUMMY_RANGE,
                                                                            generator=generator)
