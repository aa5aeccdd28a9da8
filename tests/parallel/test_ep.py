"""Expert parallelism's dispatch (harness.parallel.ep) in one process: a real 1-rank gloo group, the
bundled MoE suite's experts module (transformers' own fused experts)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from precision.helpers import suite

from harness.models.build import build_model
from harness.parallel.ep import shard_experts


def test_each_owner_runs_the_experts_forward_the_module_had_a_vendors_own_included():
    """A forward set on the experts instance (a vendor's fused-MoE kernel swapped in; here the class's
    output x 1.5, so it shows) is what the reference runs; the EP layout's owner ranks ran the class's
    forward instead until 2026-12-07, so the layout compared other kernels than the reference's and
    said nothing. The sharded module (ep 1: every expert local, the dispatch and its all_to_alls as
    with more ranks) now gives the patched output."""
    model, _ = build_model(suite("qwen3-30b-a3b"), "float32")
    experts = model.get_submodule("model.layers.0.mlp.experts")
    n_exp = experts.gate_up_proj.shape[0]

    def vendor_kernel(hidden, top_k_index, top_k_weights, _cls=experts.forward):
        return _cls(hidden, top_k_index, top_k_weights) * 1.5

    experts.forward = vendor_kernel
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, model.config.hidden_size, generator=g)  # [T, H]
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(6)])  # [T, k]
    w = torch.rand(6, 2, generator=g)
    want = experts(hidden, idx, w)
    assert not dist.is_initialized(), "a process group left by another test"
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        assert shard_experts(model, n_exp, dist.group.WORLD) == [f"model.layers.{i}.mlp.experts"
                                                                 for i in range(model.config.num_hidden_layers)]
        got = experts(hidden, idx, w)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, want / 1.5)
