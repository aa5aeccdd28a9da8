"""The single-process reference and what every rank shares with it: the batch, the loss, the
optimizer, the capture of module outputs.

One step, identical for the reference and every layout:

1. ``logits = model(ids)`` [B, S, V]; every module's output captured (forward hooks, children
   finish before parents, so the capture order is the order in which outputs are born);
2. ``loss`` = mean next-token cross-entropy in float32 (not the model's ``labels=`` loss, which
   adds MoE auxiliary terms where a config asks for them);
3. ``loss.backward()``: every parameter's gradient;
4. one SGD step (momentum 0.9): linear in the gradient, so the weights after it differ from the
   reference's by ``lr x`` the gradient's error. Adam's first step is ``lr x sign(g)`` and would
   turn a last-bit difference in a near-zero gradient into a full ``2 lr`` step;
5. ``logits_after = model(ids)`` with the new weights (catches a stale parameter shard).
"""

from __future__ import annotations

import torch

from harness.anatomy.capture import first_tensor
from harness.models.build import seeded_tokens

# Wrapper prefixes that layouts add to parameter and module names; stripped so that names match.
_WRAPPERS = ("module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def batch(vocab: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Token ids [B, S], identical on every rank (a private seeded generator)."""
    return seeded_tokens(vocab, batch_size, seq_len, seed)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits [b, S, V] against ids [b, S], in float32."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, its per-parameter (for-loop) implementation on every device: torch picks
    the foreach kernels on an accelerator (cuda, a PrivateUse1 backend) and the loop on the CPU, and
    foreach over a tensor-parallel model's parameters - DTensors beside plain replicated tensors of
    the same device and dtype - raises ("got mixed torch.Tensor and DTensor"). The loop is also the
    CPU reference's own arithmetic."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)


class ModuleCapture:
    """Forward hooks on every module: ``outputs[name]`` is the list of the module's first output
    tensor per call (a DTensor as its local shard), detached, on CPU; ``order`` lists names in the
    order their first output was born."""

    def __init__(self, model: torch.nn.Module, skip_root: bool = True, skip: frozenset = frozenset()):
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.order: list[str] = []
        self.handles = []
        self.enabled = True
        for name, mod in model.named_modules():
            if (skip_root and not name) or mod in skip:
                continue
            self.handles.append(mod.register_forward_hook(self._hook(clean_name(name))))

    def _hook(self, name: str):
        def hook(_mod, _args, out):
            if not self.enabled:
                return
            t = first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            if hasattr(t, "to_local"):
                t = t.to_local()
            if name not in self.outputs:
                self.outputs[name] = []
                self.order.append(name)
            self.outputs[name].append(t.detach().to("cpu", copy=True))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def run_reference(model: torch.nn.Module, ids: torch.Tensor, lr: float,
                  forced=None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The step above on one process. Returns (tensors by key, module order). Every router's
    choice is recorded (``route/<phase>/<router>``, ``harness.precision.routing``); with ``forced``
    (a ``routing.ForcedRouting``) the routers choose the experts it gives instead."""
    from harness.precision.routing import RouterCapture

    model.train()
    cap = ModuleCapture(model)
    routes = RouterCapture(model)
    handles = forced.attach(model) if forced is not None else []
    routes.phase = "step"
    if forced is not None:
        forced.phase = "step"
    logits = model(input_ids=ids).logits
    routes.phase = None
    cap.remove()
    loss = lm_loss(logits, ids)
    loss.backward()
    out: dict[str, torch.Tensor] = {"logits": logits.detach(), "loss": loss.detach().reshape(1)}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for n, p in params:
        if p.grad is not None:
            out[f"grad/{n}"] = p.grad.detach().clone()
    opt = make_optimizer([p for _, p in params], lr)
    opt.step()
    for n, p in params:
        out[f"weight/{n}"] = p.detach().clone()
    routes.phase = "after"
    if forced is not None:
        forced.phase = "after"
    with torch.no_grad():
        out["logits_after"] = model(input_ids=ids).logits.detach()
    routes.remove()
    for h in handles:
        h.remove()
    out.update(routes.tensors())
    for name, ts in cap.outputs.items():
        out[f"act/{name}"] = ts[0]
    return {k: v.contiguous() for k, v in out.items()}, cap.order
