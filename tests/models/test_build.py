"""harness.models.build.cast_model: what a deployed model keeps in which dtype."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.llama4.configuration_llama4 import Llama4VisionConfig
from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding

from harness.models.build import cast_model


@pytest.mark.parametrize("dtype,want", [(torch.bfloat16, torch.complex64), (torch.float32, torch.complex64),
                                        (torch.float64, torch.complex128)])
def test_complex_rotary_tables_stay_complex(dtype, want):
    # Llama-4's vision rotary holds its table as a complex64 buffer [patches + 1, 1, head_dim / 2];
    # Module.to(real dtype) would keep only the real part (cos), and the vision tower would rotate
    # every patch by the wrong angle.
    rot = Llama4VisionRotaryEmbedding(Llama4VisionConfig(image_size=32, patch_size=8, hidden_size=32,
                                                          num_attention_heads=2))
    table = rot.freqs_ci.clone()
    assert table.is_complex() and table.imag.abs().max() > 0.5
    model = torch.nn.Sequential(rot, torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real discards the imaginary part"
        out = cast_model(model, dtype)
    assert out[0].freqs_ci.dtype == want and out[1].weight.dtype == dtype
    torch.testing.assert_close(out[0].freqs_ci.to(torch.complex128), table.to(torch.complex128), rtol=0, atol=0)
    assert "freqs_ci" in out[0]._buffers  # still a buffer, still non-persistent
    assert "freqs_ci" in out[0]._non_persistent_buffers_set
