"""`harness certify --backend testdev`: the known faults registered on the test device's own dispatch
key (PrivateUse1) are caught at their module, while the same suite on CPU stays green (the
certification's clean run). The device runs only in subprocesses (conftest.py)."""

from __future__ import annotations

import json

from testdev_support import harness_cli


def _certify(env, *args: str, timeout: float = 600) -> tuple[int, dict, str]:
    r = harness_cli(env, "certify", "--backend", "testdev", "--json", *args, timeout=timeout)
    assert r.stdout.strip(), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout), r.stderr


def test_every_fault_is_caught_on_the_device(env):
    """One certification (one clean run, then each fault) covers every row; it replaced a run of the
    wrong-backward row alone (silu's backward 5% off on PrivateUse1 only, the forward exact: caught by
    training), whose assertions are here, so the clean run is paid once (``--fault`` selection:
    tests/cli/test_certify.py, on cpu)."""
    code, rep, err = _certify(env, timeout=1800)
    assert code == 0, err[-3000:]
    assert rep["dispatch_key"] == "PrivateUse1" and rep["green"], rep
    rows = {r["fault"]: r for r in rep["faults"]}
    assert rows["wrong-backward"]["check"] == "training", rows["wrong-backward"]
    assert rows["wrong-backward"]["ran"] == ["aten::silu_backward"], rows["wrong-backward"]
    assert {n: r["verdict"] for n, r in rows.items()} == dict.fromkeys(
        ("softmax-scale", "activation-slope", "matmul-bf16", "nan-one-element", "wrong-backward"), "caught")
    # on the device the attention runs unfused (math SDPA): the softmax kernel itself is replaced
    assert rows["softmax-scale"]["ran"] == ["aten::_softmax"], rows["softmax-scale"]
    assert {n: r["module"] for n, r in rows.items()} == {
        "softmax-scale": "model.layers.0.self_attn", "activation-slope": "model.layers.0.mlp",
        "matmul-bf16": "model.layers.0.self_attn", "nan-one-element": "model.layers.0.input_layernorm",
        "wrong-backward": "model.layers.1.mlp"}
