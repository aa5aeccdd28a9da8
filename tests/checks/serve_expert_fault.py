"""A dropped expert route in the serving engine's own process (tests/checks/test_serve.py): run there by
the vLLM runner (``preload``) before vLLM builds the engine.

vLLM's CPU fused-MoE experts (``CPUUnquantizedExperts.apply``: the grouped GEMM over the routed tokens,
weighted by their routing weights) drop expert ``EXPERT``: every token the router sends to it gets
nothing from it (its routing weight zeroed), while the other expert it was routed to and every token
not routed to it are exact - the shape of a kernel that skips one expert's token group (an off-by-one
in the expert offsets, an empty group after a permutation). Which positions it hits depends on the
router, so the test compares the first failing position with the float64 reference's own routing.
Imports vLLM and torch only: the engine's venv has no harness."""

import torch
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

EXPERT = 0

_apply = CPUUnquantizedExperts.apply


def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *a, **kw):
    dropped = torch.where(topk_ids == EXPERT, torch.zeros_like(topk_weights), topk_weights)
    return _apply(self, output, hidden_states, w1, w2, dropped, topk_ids, *a, **kw)


CPUUnquantizedExperts.apply = apply
