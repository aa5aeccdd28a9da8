"""The full-size target built straight onto its device(s) from the shards (harness.weights.place): equal to
the model the checkpoint was saved from, and split over several devices when one is too small."""

from __future__ import annotations

import pytest
import torch

from harness.weights.layout import open_checkpoint
from tests.weights.conftest import write_suite


def _full(ls):
    from harness.models.build import model_config

    return model_config(ls, pruned=False)


def _meta(ls, mc):
    from harness.models.build import instantiate

    with torch.device("meta"):
        return instantiate(ls, mc, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placed_build_equals_the_saved_model_on_one_device(kimi_ckpt, tmp_path, dtype):
    from harness.suite.loader import load_suite
    from harness.weights.place import build_placed, plan_placement

    root, raw, saved = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n'))
    mc = _full(ls)
    pl = plan_placement(_meta(ls, mc), dtype, [("cpu", 2**30)])
    assert pl.devices == ["cpu"] and pl.layers == ["cpu"] * 4
    model, kinds = build_placed(ls, mc, dtype, pl, open_checkpoint(root))
    assert kinds == {"plain": len(open_checkpoint(root).tensors)}
    # Kept in float32 as deployed (from_pretrained(dtype=bf16)): the router's weight and correction bias.
    fp32 = {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"} if dtype == torch.bfloat16 else set()
    ref = {k: v.to(torch.float32 if k.endswith(tuple(fp32)) else dtype) if v.is_floating_point() else v
           for k, v in saved.state_dict().items()}
    got = model.state_dict()
    assert got.keys() == ref.keys()
    assert any(k.endswith("mlp.gate.weight") for k in ref)
    for k in ref:
        assert got[k].dtype == (torch.float32 if k.endswith("inv_freq") else ref[k].dtype), k
        assert torch.equal(got[k].to(ref[k].dtype), ref[k]), k
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = saved if dtype == torch.float32 else None
    if expected is not None:
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, expected(ids).logits)


def test_layers_split_over_several_devices_when_one_is_too_small(kimi_ckpt, tmp_path):
    """Budgets that hold the embeddings and two layers per device: four layers go over two devices (the
    CPU stands for both here; no machine with several accelerators was available), every layer output
    equal to the one-device build's, inputs moved between the devices by the placement hooks."""
    from harness.anatomy.layers import decoder_layers
    from harness.precision.stream import capture_layers
    from harness.suite.loader import load_suite
    from harness.weights.place import _tensor_bytes, build_placed, plan_placement

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n'))
    mc = _full(ls)
    meta = _meta(ls, mc)
    _, layers = decoder_layers(meta)
    seen: set[int] = set()
    per_layer = [_tensor_bytes(la, torch.float32, seen) for la in layers]
    rest = _tensor_bytes(meta, torch.float32, seen)
    budget = rest + per_layer[0] + per_layer[1]
    pl = plan_placement(meta, torch.float32, [("cpu", budget), ("meta", budget)])
    assert pl.layers == ["cpu", "cpu", "meta", "meta"], pl
    assert pl.bytes_per_device == {"cpu": budget, "meta": per_layer[2] + per_layer[3]}
    assert "meta (layers 2-3" in pl.describe()
    # The same split with both "devices" the CPU: the build and the forward across the boundary.
    pl.layers = ["cpu", "cpu", "cpu:0", "cpu:0"]
    one = plan_placement(meta, torch.float32, [("cpu", 2**30)])
    ck = open_checkpoint(root)
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(4))
    a = capture_layers(build_placed(ls, mc, torch.float32, pl, ck)[0].eval(), ids)
    b = capture_layers(build_placed(ls, mc, torch.float32, one, ck)[0].eval(), ids)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.hidden_out, y.hidden_out)


def test_a_model_too_big_for_all_devices_says_so(kimi_ckpt, tmp_path):
    from harness.suite.loader import load_suite
    from harness.weights.place import plan_placement

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n'))
    meta = _meta(ls, _full(ls))
    why = plan_placement(meta, torch.bfloat16, [("cuda:0", 2**18), ("cuda:1", 2**18)])
    assert isinstance(why, str) and why.startswith("the full model needs") and "2 device(s) have" in why, why
    why = plan_placement(meta, torch.bfloat16, [("cuda:0", 1000)])
    assert "the embeddings and head alone need" in why


def test_a_device_module_without_mem_get_info_is_named_not_called_too_small(monkeypatch):
    """Free memory is read with ``torch.<device_type>.mem_get_info``; a backend without it (the test
    device had none) was told 'does not fit: no device to place the model on', which is false."""
    import types

    from harness.backends.base import Backend
    from harness.weights.place import PlacementUnknown, device_budgets

    monkeypatch.setattr(torch, "fakedev", types.SimpleNamespace(device_count=lambda: 2), raising=False)
    with pytest.raises(PlacementUnknown, match=r"torch.fakedev has no mem_get_info"):
        device_budgets(Backend("fake", "fakedev", "gloo"), 0.8)
    # with it: each device's share of its free memory
    monkeypatch.setattr(torch.fakedev, "mem_get_info", lambda i: (1000 * (i + 1), 4000), raising=False)
    assert device_budgets(Backend("fake", "fakedev", "gloo"), 0.5) == [("fakedev:0", 500), ("fakedev:1", 1000)]
