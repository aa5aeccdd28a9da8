"""Record the outputs of the modules that matter during one forward, in execution order.

Forward hooks fire when a module *finishes* (children before parents), so the recorded order is
the order in which errors are born: ``model.layers.0.input_layernorm`` comes before
``model.layers.0.self_attn`` which comes before ``model.layers.0``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

# Default selection: embeddings, rotary tables, every decoder layer and its norms, attention,
# MLP/MoE block, router, experts, shared experts, final norm, LM head (= logits).
DEFAULT_CAPTURE = (
    r"model\.(embed_tokens|rotary_emb|norm)",
    r"model\.layers\.\d+",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn|mlp|block_sparse_moe)",
    r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.(gate|router|experts|shared_experts|shared_expert)",
    r"lm_head",
)
ROUTER_SUFFIXES = (".gate", ".router")
EXPERTS_SUFFIX = ".chosen_experts"  # integer outputs: router's chosen expert ids (sorted per token)


def first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for v in obj:
            t = first_tensor(v)
            if t is not None:
                return t
    if isinstance(obj, dict):
        for v in obj.values():
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def selected_modules(model: torch.nn.Module, patterns: Iterable[str] | None = None) -> list[tuple[str, torch.nn.Module]]:
    rx = re.compile("|".join(f"(?:{p})" for p in (patterns or DEFAULT_CAPTURE)))
    return [(n, m) for n, m in model.named_modules() if n and rx.fullmatch(n)]


def _router_outputs(name: str, out) -> dict[str, torch.Tensor]:
    """Routers return (logits, weights, indices) in transformers 5; older ones return logits only."""
    res = {}
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if isinstance(t, torch.Tensor)]
        if tensors:
            res[name] = tensors[0]
        idx = [t for t in tensors if not t.is_floating_point()]
        if idx:
            res[name + EXPERTS_SUFFIX] = idx[-1].sort(dim=-1).values
    elif isinstance(out, torch.Tensor):
        res[name] = out
    return res


class NotReplayable(Exception):
    """A module input that cannot be stored as data (an object, a cache): no isolated comparison."""


def _tensor_key(t: torch.Tensor) -> tuple:
    # identity of a tensor's contents: the same storage seen through the same view
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Capture:
    """Context manager: ``with Capture(model) as cap: model(ids)``; then ``cap.outputs`` is an
    ordered dict name -> tensor (detached, on CPU, in the run dtype).

    With ``inputs=True`` it also records what each captured module was called with (first call):
    ``cap.inputs[name]`` is a JSON-able structure ``{"args": [...], "kwargs": {...}}`` whose tensor
    leaves are ``{"o": module}`` (the very tensor another captured module returned) or
    ``{"t": key}`` (a tensor in ``cap.input_tensors``); identical tensors are stored once, so a
    layer's input is not stored again when it is the previous layer's output."""

    def __init__(self, model: torch.nn.Module, patterns: Iterable[str] | None = None,
                 convert: Callable[[torch.Tensor], torch.Tensor] | None = None, inputs: bool = False):
        self.model, self.patterns = model, patterns
        self.convert = convert or (lambda t: t.detach().to("cpu"))
        self.outputs: dict[str, torch.Tensor] = {}
        self.record_inputs = inputs
        self.inputs: dict[str, dict] = {}
        self.input_tensors: dict[str, torch.Tensor] = {}
        self.not_replayable: dict[str, str] = {}
        self._seen: dict[tuple, dict] = {}  # tensor identity -> leaf
        self._alive: list[torch.Tensor] = []  # keeps identities unique while capturing
        self._handles = []

    def _encode(self, v):
        if isinstance(v, torch.Tensor):
            if v.is_complex():  # complex rotary tables (freqs_cis): not stored, the module is compared propagated
                raise NotReplayable("complex tensor")
            k = _tensor_key(v)
            leaf = self._seen.get(k)
            if leaf is None:
                key = f"i{len(self.input_tensors)}"
                self.input_tensors[key] = self.convert(v)
                self._alive.append(v)
                leaf = self._seen[k] = {"t": key}
            return leaf
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"v": v}
        if isinstance(v, (tuple, list)):
            return {"seq": [self._encode(x) for x in v], "tuple": isinstance(v, tuple)}
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {"map": {k: self._encode(x) for k, x in v.items()}}
        raise NotReplayable(type(v).__name__)

    def _pre_hook(self, name: str):
        def pre(_mod, args, kwargs):
            if name in self.inputs or name in self.not_replayable:
                return
            try:
                self.inputs[name] = {"args": [self._encode(a) for a in args],
                                     "kwargs": {k: self._encode(v) for k, v in kwargs.items()}}
            except NotReplayable as e:
                self.not_replayable[name] = f"an input of type {e} cannot be stored"
        return pre

    def _remember_output(self, name: str, t: torch.Tensor) -> None:
        if self.record_inputs:
            self._seen.setdefault(_tensor_key(t), {"o": name})
            self._alive.append(t)

    def _hook(self, name: str):
        is_router = name.endswith(ROUTER_SUFFIXES)

        def hook(_mod, _args, out):
            if is_router:
                got = _router_outputs(name, out)
            else:
                t = first_tensor(out)
                got = {name: t} if t is not None and not t.is_complex() else {}  # complex: not compared
            for k, t in got.items():
                if k not in self.outputs:  # a module called twice keeps its first call
                    self.outputs[k] = self.convert(t)
                    if k == name:
                        self._remember_output(name, t)
        return hook

    def __enter__(self) -> Capture:
        for name, mod in selected_modules(self.model, self.patterns):
            if self.record_inputs:
                self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._alive.clear()


def forward_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=False) if _accepts_use_cache(model) else model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else first_tensor(out)


def _accepts_use_cache(model) -> bool:
    import inspect

    try:
        return "use_cache" in inspect.signature(model.forward).parameters or any(
            p.kind == p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False


def capture_forward(model: torch.nn.Module, ids: torch.Tensor, patterns: Iterable[str] | None = None,
                    ) -> dict[str, torch.Tensor]:
    """One forward; returns captured module outputs plus ``logits`` (last), on CPU."""
    return capture_with_inputs(model, ids, patterns, inputs=False)[0]


def capture_with_inputs(model: torch.nn.Module, ids: torch.Tensor, patterns: Iterable[str] | None = None,
                        inputs: bool = True, convert=None) -> tuple[dict[str, torch.Tensor], Capture]:
    """One forward: (outputs incl. ``logits`` last, the Capture with each module's recorded inputs).
    ``lm_head``'s output is the logits; its inputs are kept under the name ``logits``."""
    with torch.no_grad(), Capture(model, patterns, convert, inputs=inputs) as cap:
        logits = forward_logits(model, ids)
    outs = dict(cap.outputs)
    outs.pop("lm_head", None)  # identical to the logits
    outs["logits"] = logits.detach().to("cpu") if convert is None else convert(logits)
    if "lm_head" in cap.inputs:
        cap.inputs["logits"] = cap.inputs.pop("lm_head")
    return outs, cap


def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int, topk: int = 5) -> dict[str, torch.Tensor]:
    """Greedy generation without a KV cache (works for any module returning logits): the chosen
    tokens, their log-probabilities and each step's top-k candidates."""
    toks, lps, top_ids, top_lps = [], [], [], []
    cur = ids
    with torch.no_grad():
        for _ in range(n):
            logits = forward_logits(model, cur)[:, -1].to("cpu", torch.float64)
            lp = torch.log_softmax(logits, dim=-1)
            tl, ti = lp.topk(min(topk, lp.shape[-1]), dim=-1)
            nxt = ti[:, 0]
            toks.append(nxt)
            lps.append(tl[:, 0])
            top_ids.append(ti)
            top_lps.append(tl)
            cur = torch.cat([cur, nxt[:, None].to(cur.device)], dim=1)
    if not n:
        b = ids.shape[0]
        return {"tokens": torch.zeros(b, 0, dtype=torch.long), "logprobs": torch.zeros(b, 0, dtype=torch.float64),
                "top_ids": torch.zeros(b, 0, topk, dtype=torch.long),
                "top_logprobs": torch.zeros(b, 0, topk, dtype=torch.float64)}
    return {"tokens": torch.stack(toks, 1), "logprobs": torch.stack(lps, 1),
            "top_ids": torch.stack(top_ids, 1), "top_logprobs": torch.stack(top_lps, 1)}
