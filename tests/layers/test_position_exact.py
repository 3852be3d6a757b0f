"""layers/position_exact.py: a token's value is the same bits at any place in any step (a MoE layer's shared-expert
gate [T, 1], Gated DeltaNet's beta and decay [T, Hv])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.layers.position_exact import sigmoid_any_position, softplus_any_position


@pytest.mark.parametrize("exact, torch_fn", [(softplus_any_position, F.softplus),
                                             (sigmoid_any_position, torch.sigmoid)], ids=["softplus", "sigmoid"])
# [T, 1] a shared-expert gate, [T, Hv] Gated DeltaNet's heads; 23 rows of 12 leave a tail in fp32 and fp64 vectors
@pytest.mark.parametrize("width", [1, 12])
def test_a_value_does_not_depend_on_its_place(exact, torch_fn, width):
    """torch's own function on a CPU differs where a tensor's tail runs its scalar path; these do not."""
    x = torch.randn(400, width, generator=torch.Generator().manual_seed(1)) * 4  # the functions' whole range
    whole = exact(x)
    for start in range(1, 320, 8):  # 23 rows each: a whole vector's and a tail's
        assert torch.equal(exact(x[start:start + 23].clone()), whole[start:start + 23])
    torch.testing.assert_close(whole, torch_fn(x), rtol=2e-7, atol=0)  # torch's function, to fp32's ulp

