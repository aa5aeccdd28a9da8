"""The smoke check's steps as library calls, on small real torch modules built here: where a NaN is
born, which parameters lack a gradient, the near-tie rule of cached generation, the decoded steps
compared, and the first wrapper module that ignores a changed image. (The check end to end on
transformers models: tests/checks/test_smoke.py, tests/models/test_wrappers.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.models import probe


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, labels=None):
        y = self.c(self.b(self.a(x)))
        return SimpleNamespace(logits=y, loss=(y - labels).pow(2).mean() if labels is not None else None)


def test_the_first_nonfinite_module_is_where_the_nan_is_born():
    net = Chain()
    x = torch.ones(2, 4)
    assert probe.first_nonfinite_module(net, x=x) is None
    assert probe.logits_failure(net, {"x": x}, net(x).logits, (2, 4)) is None
    net.b.register_forward_hook(lambda m, a, out: out * float("nan"))
    assert probe.first_nonfinite_module(net, x=x) == "b"  # not c, nor the model, that only carry it on
    f = probe.logits_failure(net, {"x": x}, net(x).logits, (2, 4))
    assert f.fields == {"metric": "nonfinite_logits", "expected": 0, "observed": 8}
    assert f.message.endswith("first non-finite module output: b") and f.detail == {"first_nonfinite_module": "b"}
    assert probe.logits_failure(net, {"x": x}, net(x).logits, (2, 5)).fields["metric"] == "logits.shape"


def test_gradients_missing_excused_and_nonfinite():
    net = Chain()
    net.a.weight.requires_grad_(True)
    net(torch.ones(2, 4), labels=torch.zeros(2, 4)).loss.backward()
    params = probe.trainable(net)
    assert probe.gradients(params, [], "no_grad_ok").failure is None and probe.grad_norm(params) > 0
    net.a.bias.grad = None  # as if the loss never reached it
    g = probe.gradients(params, [], "no_grad_ok")
    assert g.failure.message == "1 trainable parameters got no gradient, first: ['a.bias']"
    assert g.failure.fields["details"] == "if this is by design, list them in [checks.smoke] no_grad_ok"
    g = probe.gradients(params, ["a.*"], "no_grad_ok")
    assert g.failure is None and g.excused == ["a.bias"] and len(g.with_grad) == 5
    net.c.weight.grad[0, 0] = float("inf")
    g = probe.gradients(params, ["a.*"], "wrapper_no_grad_ok")
    assert g.failure.fields["metric"] == "params_nonfinite_grad" and "['c.weight']" in g.failure.message


def test_optimizer_steps_lower_the_loss_and_a_loss_that_does_not_fall_fails():
    net = Chain()
    x, y = torch.ones(2, 4), torch.zeros(2, 4)
    loss0 = net(x, labels=y).loss
    loss0.backward()
    step_s, loss1 = probe.train_steps(net, {"x": x}, y, list(net.parameters()), 1e-2, 3, lambda: None)
    assert step_s > 0 and loss1 < loss0.item() and probe.loss_failure(loss0.item(), loss1, 3) is None
    assert probe.loss_failure(1.0, 1.0, 3).message == "3 optimizer steps on a fixed batch did not lower the loss"
    assert probe.loss_failure(1.0, float("nan"), 3).fields["expected"] == "finite"


def test_a_generation_mismatch_passes_only_at_a_near_tie():
    plain = torch.tensor([[5, 6, 7]])
    cached = torch.tensor([[5, 9, 1]])  # differs from new token 1 on
    scores = [torch.zeros(1, 10) for _ in range(3)]
    scores[1][0, 6], scores[1][0, 9] = 1.0, 0.995  # the uncached top-2: 6 over 9 by 0.005
    found, note = probe.tie_failure(cached, plain, scores, 0.01)
    assert found is None and note == "cached/uncached generation differ at a near tie (gap 0.005 <= 0.01)"
    found, _ = probe.tie_failure(cached, plain, scores, 0.001)
    assert found.message.endswith("(sequence 0, new token 1: 9 vs 6)") and found.fields["tolerance"] == 0.001
    # steps compared: up to the first mismatch, which still shares its prefix; all when none differs
    assert probe.shared_steps(cached, plain, 3) == 2 and probe.shared_steps(plain, plain, 3) == 3
    assert probe.cache_logits_failure([1e-6, 2e-6], 1e-5, "float32") is None
    f = probe.cache_logits_failure([1e-6, 3e-5, 1e-6], 1e-5, "float32")
    assert "at new token 1 (rel_rmse 3e-05 > the float32 tolerance 1e-05)" in f.message and f.fields["observed"] == "3e-05"


class Wrapper(torch.nn.Module):
    """A text position, one image token, two text positions: the image's features added to the text."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.visual, self.mm_projector, self.lm_head = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, input_ids, pixel_values):
        img = self.mm_projector(self.visual(pixel_values))  # [B, 4]
        return SimpleNamespace(logits=self.lm_head(input_ids.float()[..., None] + img[:, None, :]))


def test_the_first_wrapper_module_that_ignores_the_image_is_named():
    model = Wrapper()
    a = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "pixel_values": torch.ones(1, 4)}
    b = {**a, "pixel_values": torch.full((1, 4), 2.0)}
    roots = probe.part_roots(model)
    assert roots == {"vision": ["visual"], "projector": ["mm_projector"], "text": ["lm_head"]}
    change, found = probe.image_path(model, a, b, 1, roots)
    assert change > 0 and found is None
    model.mm_projector.register_forward_hook(lambda m, args, out: out * 0)
    change, found = probe.image_path(model, a, b, 1, roots)
    assert change == 0 and found.detail == {"image_path_break": "mm_projector"}
    assert "the projector module mm_projector ignores its input" in found.message
    assert probe.dead_parts({"vision": 1.0, "projector": 0.0, "text": 1.0}, roots).fields["metric"] == "grad_norm_projector"
