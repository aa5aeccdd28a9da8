"""Record the outputs of the modules that matter during one forward, in execution order.

Forward hooks fire when a module *finishes* (children before parents), so the recorded order is
the order in which errors are born: ``model.layers.0.input_layernorm`` comes before
``model.layers.0.self_attn`` which comes before ``model.layers.0``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch

from harness.anatomy.moe import ROUTER_SUFFIXES

# Default selection, by structure rather than by name, so that a new architecture is covered the day
# it appears: every direct child of the decoder body (embeddings, rotary tables, final norm, whatever
# they are called), every decoder layer and each of its direct children (norms, attention, MLP/MoE
# block, and the ``mixer`` of a hybrid Mamba/attention/MoE layer - Nemotron-H's MoE lives there, with
# no ``mlp``), the router, experts and shared experts inside any of those, and the LM head (= logits).
# Multimodal wrappers keep the text decoder under ``model.language_model``. A child that the text
# forward never calls (a vision tower) records nothing.
_BODY = r"model\.(?:language_model\.)?"
DEFAULT_CAPTURE = (
    _BODY + r"(?!layers$)[A-Za-z_]\w*",
    _BODY + r"layers\.\d+",
    _BODY + r"layers\.\d+\.[A-Za-z_]\w*",
    _BODY + r"layers\.\d+\.[A-Za-z_]\w*\.(gate|router|experts|shared_experts|shared_expert)",
    r"lm_head",
)
EXPERTS_SUFFIX = ".chosen_experts"  # integer outputs: router's chosen expert ids (sorted per token)
# Rotary modules are called once more after the forward at positions across the model's context
# (``<name>@positions``): at the 16 positions of a golden's input a rotary table computed in bf16 is
# as close as bf16 rounding of the float32 table (angles <= 15 rad, 8-bit mantissa), while at the
# positions a deployment uses (thousands) bf16 position ids are rounded to multiples of 16 and more.
PROBE = re.compile(r"(?:.*\.)?rotary_emb")
PROBE_SUFFIX = "@positions"
PROBE_POSITIONS = 48  # random positions in [16, max_position_embeddings), besides 0..15
_CALL_NAME = re.compile(r"(\[[^\]]*\])?(@\w+)?$")


def module_path(name: str) -> str:
    """The module a captured name belongs to: ``model.rotary_emb[full_attention]@positions`` ->
    ``model.rotary_emb``."""
    return _CALL_NAME.sub("", name, count=1)


def call_name(name: str, args, kwargs) -> str:
    """A module called several times in one forward with other *string* arguments (Gemma-4's rotary
    module, once per layer type, in ``set`` order: hash-randomized per process) is captured once per
    such call, named by them (``model.rotary_emb[sliding_attention]``), so golden and target pair the
    same calls whatever the order. Other arguments (tensors, flags) do not name a call."""
    strs = [a for a in args if isinstance(a, str)] + [v for _, v in sorted(kwargs.items()) if isinstance(v, str)]
    return f"{name}[{','.join(strs)}]" if strs else name


def probe_positions(config, n: int = PROBE_POSITIONS) -> torch.Tensor:
    """[16 + n] int64: 0..15 and ``n`` seeded positions (private generator: the same on every backend)
    across the context, sorted. Mostly odd and not powers of two, which bf16 would hold exactly."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    top = int(getattr(cfg, "max_position_embeddings", None) or 4096)
    top = max(min(top, 1 << 24), 32)
    g = torch.Generator().manual_seed(12345)
    far = torch.randint(16, top, (n,), generator=g)
    return torch.cat([torch.arange(16), far]).unique().sort().values


def first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for v in obj:
            t = first_tensor(v)
            if t is not None:
                return t
    if isinstance(obj, Mapping):  # dict, ModelOutput, a UserDict (transformers' KVSharingDict)
        for v in obj.values():
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def selected_modules(model: torch.nn.Module, patterns: Iterable[str] | None = None) -> list[tuple[str, torch.nn.Module]]:
    rx = re.compile("|".join(f"(?:{p})" for p in (patterns or DEFAULT_CAPTURE)))
    return [(n, m) for n, m in model.named_modules() if n and rx.fullmatch(n)]


def router_outputs(name: str, out) -> dict[str, torch.Tensor]:
    """``{router: its logits, router.chosen_experts: the chosen ids sorted per token}``. Routers return
    (logits, weights, indices) in transformers 5; older ones return logits only. Llama-4's returns
    (scores, logits) with no indices: ``scores`` [T, E] is sigmoid of the top-k logits scattered into
    zeros, so its nonzero places *are* the choice, and a flip would make that row jump (0.25
    rel_rmse for one token): the dense logits are the router's row and the choice is read from the
    sparse tensor, so a near-tie flip is judged as for every router."""
    res = {}
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if isinstance(t, torch.Tensor)]
        idx = [t for t in tensors if not t.is_floating_point()]
        floats = [t for t in tensors if t.is_floating_point()]
        if idx:
            res[name] = tensors[0]
            res[name + EXPERTS_SUFFIX] = idx[-1].sort(dim=-1).values
            return res
        sparse = next((t for t in floats if _choice_count(t)), None)
        dense = next((t for t in floats if t is not sparse and sparse is not None and t.shape == sparse.shape), None)
        if sparse is not None and dense is not None:
            k = _choice_count(sparse)
            res[name] = dense
            res[name + EXPERTS_SUFFIX] = (sparse != 0).to(torch.int8).topk(k, dim=-1).indices.sort(dim=-1).values
        elif tensors:
            res[name] = tensors[0]
    elif isinstance(out, torch.Tensor):
        res[name] = out
    return res


def _choice_count(t: torch.Tensor) -> int:
    """k when every row of ``t`` [..., E] has exactly k < E nonzero entries (a sparse routing-score
    tensor), else 0."""
    if t.dim() < 2 or t.shape[-1] < 2 or t.numel() == 0:
        return 0
    nz = (t != 0).sum(-1)
    k = int(nz.flatten()[0])
    return k if 0 < k < t.shape[-1] and bool((nz == k).all()) else 0


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
        self._suffix = ""  # PROBE_SUFFIX while probing
        self._probe_calls: dict[str, tuple] = {}  # call name -> (module, args, kwargs) of rotary modules

    def _snapshot(self, t: torch.Tensor) -> torch.Tensor:
        """The value now: ``convert`` may return the tensor itself (already on the CPU), and models
        modify outputs in place after the hook fired (Llama-4's MoE adds the routed experts into
        the shared expert's output with ``add_``)."""
        c = self.convert(t)
        return c.clone() if c.data_ptr() == t.data_ptr() else c

    def _stored(self, leaf: dict) -> torch.Tensor | None:
        return self.input_tensors.get(leaf["t"]) if "t" in leaf else self.outputs.get(leaf["o"])

    def _encode(self, v):
        if isinstance(v, torch.Tensor):
            if v.is_complex():  # complex rotary tables (freqs_cis): not stored, the module is compared propagated
                raise NotReplayable("complex tensor")
            k = _tensor_key(v)
            leaf = self._seen.get(k)
            if leaf is not None:  # the same tensor as before, unless it was modified in place since
                old = self._stored(leaf)
                if old is None or not torch.equal(old, self.convert(v).to(old.dtype)):
                    leaf = None
            if leaf is None:
                key = f"i{len(self.input_tensors)}"
                self.input_tensors[key] = self._snapshot(v)
                self._alive.append(v)
                leaf = self._seen[k] = {"t": key}
            return leaf
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"v": v}
        if isinstance(v, (tuple, list)):
            return {"seq": [self._encode(x) for x in v], "tuple": isinstance(v, tuple)}
        if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
            # dicts and dict-likes (Gemma-4's KVSharingDict, a UserDict of the K/V earlier layers share),
            # as they are when the module is called; replayed as a plain dict
            return {"map": {k: self._encode(x) for k, x in v.items()}}
        raise NotReplayable(type(v).__name__)

    def _pre_hook(self, name: str):
        probe = bool(PROBE.fullmatch(name))

        def pre(mod, args, kwargs):
            cname = call_name(name, args, kwargs) + self._suffix
            if probe and not self._suffix:
                self._probe_calls.setdefault(cname, (mod, args, kwargs))
            if not self.record_inputs or cname in self.inputs or cname in self.not_replayable:
                return
            try:
                self.inputs[cname] = {"args": [self._encode(a) for a in args],
                                      "kwargs": {k: self._encode(v) for k, v in kwargs.items()}}
            except NotReplayable as e:
                self.not_replayable[cname] = f"an input of type {e} cannot be stored"
        return pre

    def _remember_output(self, name: str, t: torch.Tensor) -> None:
        if self.record_inputs:
            self._seen.setdefault(_tensor_key(t), {"o": name})
            self._alive.append(t)

    def _hook(self, name: str):
        is_router = name.endswith(ROUTER_SUFFIXES)

        def hook(_mod, args, kwargs, out):
            cname = call_name(name, args, kwargs) + self._suffix
            if is_router:
                got = router_outputs(cname, out)
            else:
                t = first_tensor(out)
                got = {cname: t} if t is not None and not t.is_complex() else {}  # complex: not compared
            for k, t in got.items():
                if k not in self.outputs:  # a call made twice keeps its first
                    self.outputs[k] = self._snapshot(t)
                    if k == cname:
                        self._remember_output(cname, t)
        return hook

    def probe(self) -> None:
        """Call each rotary module once more at ``probe_positions`` (recorded as ``<call>@positions``,
        inputs too, so the isolated comparison replays it). The call's integer tensors (position ids
        [B, S]) become the positions ([B, P]); its floating tensors (hidden states, used for their
        dtype and device) keep one position. A module that will not take them is left unprobed."""
        config = getattr(self.model, "config", None)
        if not self._probe_calls or config is None:
            return
        pos = probe_positions(config)

        def swap(v):
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool and v.dim():
                p = pos.to(v.device, v.dtype)
                return p.expand(*v.shape[:-1], p.numel()).contiguous()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
                return v[..., :1, :].contiguous()
            return v

        self._suffix = PROBE_SUFFIX
        try:
            for mod, args, kwargs in list(self._probe_calls.values()):
                try:
                    with torch.no_grad():
                        mod(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
                except Exception:  # noqa: BLE001 - an exotic rotary signature: compared at the input's positions only
                    continue
        finally:
            self._suffix = ""

    def __enter__(self) -> Capture:
        for name, mod in selected_modules(self.model, self.patterns):
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._hook(name), with_kwargs=True))
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
        cap.probe()
    outs = {}
    for k, v in cap.outputs.items():  # each probe right after its call: where its error is born
        if not k.endswith(PROBE_SUFFIX):
            outs[k] = v
            outs.update((p, cap.outputs[p]) for p in (k + PROBE_SUFFIX,) if p in cap.outputs)
    lm = outs.pop("lm_head", None)
    outs["logits"] = logits.detach().to("cpu") if convert is None else convert(logits)
    # equal up to the dtype: Nemotron-H returns lm_head(h).float() (float64 -> float32 in the reference)
    if lm is not None and not (lm.shape == outs["logits"].shape
                               and torch.equal(lm.to(outs["logits"].dtype), outs["logits"])):
        # the model transforms lm_head's output (Gemma's final logit soft-capping, 30 tanh(x / 30)):
        # lm_head is its own row, replayed on its inputs; the logits are compared propagated
        outs = {**{k: v for k, v in outs.items() if k != "logits"}, "lm_head": lm, "logits": outs["logits"]}
    elif "lm_head" in cap.inputs:
        cap.inputs["logits"] = cap.inputs.pop("lm_head")
    return outs, cap


def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int, topk: int = 64) -> dict[str, torch.Tensor]:
    """Greedy generation without a KV cache (works for any module returning logits): the chosen
    tokens, their log-probabilities and each step's top-k candidates. 64 candidates: a pruned
    random-weight model's next-token distribution is nearly flat (measured: deepseek-v3, seed 1009,
    the first 8 candidates within 0.09 nats), so a clean bf16 run may pick the reference's 6th
    token at a gap below tie_margin; with 5 stored the gap was unknown ("inf") and a false alarm."""
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


# --- captured structures: Capture._encode writes them, these read them back -----------------------
def decode(node, resolve):
    """Inverse of ``Capture._encode`` with ``resolve(kind, key)`` giving each tensor leaf."""
    if "t" in node:
        return resolve("t", node["t"])
    if "o" in node:
        return resolve("o", node["o"])
    if "v" in node:
        return node["v"]
    if "seq" in node:
        seq = [decode(x, resolve) for x in node["seq"]]
        return tuple(seq) if node.get("tuple") else seq
    if "map" in node:
        return {k: decode(v, resolve) for k, v in node["map"].items()}
    raise ValueError(f"unknown input node {sorted(node)}")


def leaves(node):
    """Every tensor leaf ({"t": key} / {"o": name}) of a structure."""
    if "t" in node or "o" in node:
        yield node
    elif "seq" in node:
        for x in node["seq"]:
            yield from leaves(x)
    elif "map" in node:
        for x in node["map"].values():
            yield from leaves(x)
    elif "args" in node:
        for x in node["args"]:
            yield from leaves(x)
        for x in node["kwargs"].values():
            yield from leaves(x)
