"""harness/anatomy/capture.py: what a forward records is what the modules returned and were given."""

from __future__ import annotations

import torch

from harness.anatomy.capture import EXPERTS_SUFFIX, capture_with_inputs, router_outputs
from harness.precision.isolate import replay


class _Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, h):
        return self.proj(h)


class _Block(torch.nn.Module):
    """Llama-4's MoE pattern: ``out = shared_expert(h); out.add_(routed)``."""

    def __init__(self):
        super().__init__()
        self.shared_expert = _Shared()
        self.routed = torch.nn.Linear(8, 8)

    def forward(self, h):
        out = self.shared_expert(h)
        out.add_(self.routed(h))
        return out


class _Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block()])

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Body()
        self.lm_head = torch.nn.Linear(8, 5)

    def forward(self, input_ids):
        h = torch.nn.functional.one_hot(input_ids, 8).double()
        return self.lm_head(self.model(h))


def test_an_output_modified_in_place_afterwards_is_recorded_as_returned():
    torch.manual_seed(0)
    m = _Model().double().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    patterns = [r"model\.layers\.\d+", r"model\.layers\.\d+\.\w+", r"lm_head"]
    outs, cap = capture_with_inputs(m, ids, patterns)
    h = torch.nn.functional.one_hot(ids, 8).double()
    with torch.no_grad():
        want = m.model.layers[0].shared_expert(h)
    assert torch.equal(outs["model.layers.0.shared_expert"], want)  # not shared + routed
    rp = replay(m, cap.inputs, outs, cap.input_tensors, torch.float64, "cpu",
                ["model.layers.0.shared_expert", "model.layers.0", "logits"])
    for n in ("model.layers.0.shared_expert", "model.layers.0", "logits"):
        assert torch.equal(rp.outputs[n], outs[n]), n


def test_a_router_returning_sparse_scores_and_logits_gives_its_choice():
    """Llama-4's router returns (sigmoid of the top-k scattered into zeros, logits), no indices."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [1.5, 0.2, 0.3, -0.4]])
    top_v, top_i = logits.topk(1, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, top_i, top_v).sigmoid()
    got = router_outputs("r", (scores, logits))
    assert torch.equal(got["r"], logits)
    assert got["r" + EXPERTS_SUFFIX].tolist() == [[1], [0]]
    # transformers 5's (logits, weights, indices) as before; a lone tensor is the logits
    idx = torch.tensor([[3, 1], [0, 2]])
    assert router_outputs("r", (logits, scores, idx))["r" + EXPERTS_SUFFIX].tolist() == [[1, 3], [0, 2]]
    assert set(router_outputs("r", logits)) == {"r"}
