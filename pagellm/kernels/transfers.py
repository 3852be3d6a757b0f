"""Copies between the host and the device that never make the host wait for the device's queue.

Why: on CUDA a copy from pageable host memory to the device first waits for every kernel already queued (a
stream sync), and so does a blocking read back. A step that copies a sampling mask after queueing its forward
would wait for the whole forward there, and a step prepared while the previous one runs (overlap) would wait
for it. From pinned memory a copy is queued like a kernel. A tensor for the host's own memory (a CPU device) is
used as is: what these test is where memory lives, not which backend runs.

torch's pinned allocator keeps a block until the copies queued from it have run, so a pinned staging tensor
may be dropped as soon as its copy is queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HOST = torch.device("cpu")


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or a CPU tensor) as a tensor on `device`, queued without a host sync."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device) == HOST:
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(destination: torch.Tensor, values: Sequence | torch.Tensor) -> None:
    """destination[...] = values (host), in place, queued without a host sync."""
    destination.copy_(to_device(values, destination.dtype, destination.device), non_blocking=True)


class HostRead:
    """A device tensor's copy to the host, started at once (into pinned memory on CUDA) and waited for only
    when its values are asked: the one blocking wait of a step."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if not tensor.is_cpu:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
