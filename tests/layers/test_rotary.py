"""RoPE frequencies: the per-dimension freq_factors (llama.cpp's rope_freqs.weight) on top of every rope type."""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.rotary import RotaryEmbedding, compute_rope

HEAD_DIM = 16
FACTORS = [1.0, 1.0, 1.25, 2.0, 3.5, 8.0, 8.0, 8.0]  # one per frequency: HEAD_DIM / 2
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_freq_factors_divide_each_frequency_after_the_types_own_scaling(rope):
    """As llama.cpp's freq_factors do: its linear and YaRN scaling act on the angle already divided."""
    scaled, attention = compute_rope(HEAD_DIM, ROPES[rope], 256)
    divided, attention_with_factors = compute_rope(HEAD_DIM, {**ROPES[rope], "freq_factors": FACTORS}, 256)
    assert torch.equal(divided, scaled / torch.tensor(FACTORS))
    assert attention_with_factors == attention


def test_rotary_embedding_built_on_meta_materializes_the_divided_frequencies():
    params = {**ROPES["default"], "freq_factors": FACTORS}
    rotary = RotaryEmbedding(HEAD_DIM, params, 256)
    rotary.materialize("cpu")
    plain, _ = compute_rope(HEAD_DIM, ROPES["default"], 256)
    assert torch.equal(rotary.inv_freq, plain / torch.tensor(FACTORS))


def test_freq_factors_of_the_wrong_length_are_an_error_at_build():
    with pytest.raises(ValueError, match=r"freq_factors has 4 values; head_dim 16 needs 8"):
        RotaryEmbedding(HEAD_DIM, {**ROPES["default"], "freq_factors": FACTORS[:4]}, 256)
