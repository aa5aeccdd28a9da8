"""Real-weight builds skip the random init: the pruned model is built with its parameters on the meta
device, materialized empty and filled from the checkpoint, and equals, tensor for tensor, what the
former build (seeded random init, then the load) gave; nothing is left unwritten."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from harness.models.build import build_model, cast_model, instantiate, model_config
from harness.suite.loader import load_suite
from harness.weights.layout import WeightsError
from harness.weights.load import load_pruned
from tests.weights.conftest import KIMI_SMALL, make_model, save_checkpoint, small_config, write_suite

SMALL = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
CASES = {
    # rope_type llama3 (published rope_scaling): inv_freq is rescaled per frequency band
    "llama3-rope": ("Llama-3.1-8B.json", SMALL),
    # Qwen3 with tied embeddings: lm_head must stay the embedding's tensor
    "tied": ("Qwen3-8B.json", dict(SMALL, tie_word_embeddings=True)),
    # DeepSeek-V3 layout (MLA, MoE with fused experts, router correction-bias buffer), yarn rope
    "yarn-moe": ("Kimi-K2-Instruct.json", KIMI_SMALL),
}


def _former_build(ls, dtype: torch.dtype) -> torch.nn.Module:
    """build_model as it was before the meta build: seeded random init, then the load, then the cast."""
    mc = model_config(ls)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = instantiate(ls, mc, dtype)
    load_pruned(model, ls, mc, dtype=dtype)
    return cast_model(model, dtype)


def _all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))  # persistent and non-persistent (inv_freq)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    cfg, over = CASES[request.param]
    raw = small_config(cfg, **over)
    d = tmp_path_factory.mktemp(request.param)
    root = save_checkpoint(make_model(raw, seed=5), raw, d / "ckpt", shard="40KB")
    prune = "[prune]\nnum_hidden_layers = 2\n" + ("num_experts = 4\n" if "moe" in request.param else "")
    return request.param, load_suite(write_suite(d, "s", raw, f'weights = "{root}"\n{prune}'))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_meta_build_equals_the_former_random_then_load_build(case, dtype):
    name, ls = case
    new, _ = build_model(ls, dtype)
    old = _former_build(ls, dtype)
    a, b = _all_tensors(new), _all_tensors(old)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
        assert torch.equal(a[k], b[k]), k
    rot = [k for k in a if k.endswith("inv_freq")]
    assert rot and all(a[k].dtype == (torch.float64 if dtype == torch.float64 else torch.float32) for k in rot)
    if name == "tied":
        assert new.lm_head.weight is new.model.embed_tokens.weight
    if name == "llama3-rope":
        assert ls.raw_config["rope_scaling"]["rope_type"] == "llama3"


class _InitOps(TorchDispatchMode):
    """Random-init kernels (normal_, uniform_, ...) that ran on real (non-meta) tensors."""

    RANDOM = ("normal_", "uniform_", "random_", "bernoulli_", "exponential_")

    def __init__(self):
        super().__init__()
        self.real: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.RANDOM and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            self.real.append(f"{name}{list(args[0].shape)}")
        return func(*args, **(kwargs or {}))


def test_real_weight_build_runs_no_random_init(case):
    _, ls = case
    with _InitOps() as ops:
        build_model(ls, "float32")
    assert ops.real == []
    with _InitOps() as ops:  # the witness sees the random build's init
        _former_build(ls, torch.float32)
    assert len(ops.real) > 3


# --- refusals: nothing may stay uninitialised -------------------------------------------------------


class _DerivedBuffer(torch.nn.Module):
    """A model computing a non-persistent buffer from a parameter in __init__ (no checkpoint holds it)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("row_norm", self.proj.weight.detach().norm(dim=1), persistent=False)

    def forward(self, x):
        return self.proj(x) * self.row_norm


def derived_buffer_model(config, dtype=torch.float32, device="cpu"):
    return _DerivedBuffer()


def test_a_buffer_computed_from_parameters_is_refused_by_name(tmp_path):
    raw = small_config("Llama-3.1-8B.json", **SMALL)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in _DerivedBuffer().state_dict().items()}, str(ckpt / "model.safetensors"),
              metadata={"format": "pt"})
    body = f'adapter = "tests.weights.test_build_meta:derived_buffer_model"\nweights = "{ckpt}"\n'
    with pytest.raises(WeightsError, match=r"^row_norm: a non-persistent buffer computed from the parameters"):
        build_model(load_suite(write_suite(tmp_path, "d", raw, body)))


def test_a_plan_that_leaves_part_of_a_tensor_unwritten_is_refused(case):
    from harness.weights.layout import open_checkpoint
    from harness.weights.load import build_plan, fill, instantiate_empty
    from harness.weights.reader import ShardReader

    _, ls = case
    mc = model_config(ls)
    model = instantiate_empty(ls, mc, torch.float32)
    ck = open_checkpoint(ls.weights_path)
    p = build_plan(model, ls, mc, ck)
    victim = p.entries[-1]
    p.entries.remove(victim)
    with pytest.raises(WeightsError, match=rf"would not be filled from the checkpoint, first {victim.param} "):
        fill(model, p, ck, ShardReader(ck))
