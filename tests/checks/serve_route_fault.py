"""A wrong route in the serving engine's own process (tests/checks/test_serve.py): run there by the vLLM
runner (``preload``) before vLLM builds the engine.

vLLM's CPU MoE router (``CPURouter._compute_routing``) gives the last of each token's top-k slots the
(k+1)-th best expert instead, on forwards of one token (decode) only: the shape of an off-by-one in a
decode-path partial sort. Prefill routes exactly; every decode step's token goes to one wrong expert in
every MoE layer. vLLM records the routes after this (its routed-experts capture reads the router's
output), so the engine's returned routes are the wrong ones it used. Imports vLLM and torch only: the
engine's venv has no harness."""

from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

_compute = CPURouter._compute_routing


def _compute_routing(self, hidden_states, router_logits, *a, **kw):
    weights, ids = _compute(self, hidden_states, router_logits, *a, **kw)
    if router_logits.shape[0] != 1:  # prefill (and batched forwards): exact
        return weights, ids
    k = ids.shape[-1]
    ranked = router_logits.float().argsort(dim=-1, descending=True)
    ids = ids.clone()
    ids[:, -1] = ranked[:, k].to(ids.dtype)
    return weights, ids


CPURouter._compute_routing = _compute_routing
