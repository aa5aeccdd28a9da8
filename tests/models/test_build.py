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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_router_kept_in_float32_as_deployed(dtype):
    """DeepSeek-V3 declares ``_keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]``:
    ``from_pretrained(dtype=bf16 or fp16)`` keeps its router in float32, so the harness's build does too
    (it rounded them to bf16, and chose experts the deployed model does not); float64 casts everything."""
    from harness.models.build import build_model
    from harness.suite.loader import load_suite
    from tests_support import REPO

    model, _ = build_model(load_suite(REPO / "suites" / "deepseek-v3.toml"), dtype)
    kept = {n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_floating_point() and t.dtype == torch.float32 and not n.endswith("inv_freq")}
    routers = {n for n, _ in [*model.named_parameters(), *model.named_buffers()]
               if n.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))}
    assert routers and kept == (routers if dtype != torch.float64 else set())
    assert all(t.dtype == dtype for n, t in model.named_parameters() if n not in routers)


def test_cpu_threads_for_the_pruned_models_is_set_and_restored(monkeypatch):
    """Checks on the pruned models (and golden generate) run with one intra-op thread unless
    $HARNESS_CPU_THREADS says otherwise (0: leave it); the process's count comes back after."""
    import torch

    from harness.checks import registry
    from harness.models.build import cpu_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.delenv("HARNESS_CPU_THREADS", raising=False)
        with cpu_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("HARNESS_CPU_THREADS", "0")
        with cpu_threads(1):
            assert torch.get_num_threads() == 2
        monkeypatch.setenv("HARNESS_CPU_THREADS", "3")
        with cpu_threads(1):
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # serve: its float64 reference of the exported pruned model (the engine runs in its own process)
    # longctx: its float64 reference at 4096 positions; rehearse: meta tensors, nothing to spin threads for
    numerics = {"smoke", "precision", "decode", "training", "compile", "quantization", "ops", "serve", "longctx",
                "rehearse"}
    assert {c for c in registry().names() if registry().get(c).cpu_threads == 1} == numerics
    assert registry().get("perf").cpu_threads is None  # perf pins its own threads
