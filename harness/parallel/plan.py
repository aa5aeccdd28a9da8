"""``harness plan``: which (tp, pp, ep, dp, cp, ZeRO stage, recompute) layouts of the *full-size*
model fit a cluster, with a per-device memory breakdown and the communication per step, ranked.

The parameter counts, checkpoint bytes (quantized formats with their scales) and KV-cache bytes per
token are ``harness inspect``'s own (``harness.inspect.report.inspect`` on the meta device), so
the two commands agree where they overlap: at tp = pp = ep = 1 the weight bytes per device are
inspect's checkpoint total. The model of how a layout divides them (docs/parallel.md, "harness plan"):

* **weights**: attention, dense MLP, shared experts, embedding and lm_head are split by ``tp``
  (vocabulary-parallel embedding); routed experts by ``ep`` (by ``tp`` when ``ep`` = 1); decoder
  layers by ``pp`` (the worst stage also keeps the larger of embedding / lm_head); norms, routers
  and buffers are replicated; in training ZeRO-3 also splits what is left by ``dp``;
* **KV cache** (inference): inspect's bytes per token x the sequences of one replica
  (ceil(batch / dp)) x context / cp, split by ``pp`` (layers) and by ``tp`` over the KV heads (GQA:
  at most ``num_key_value_heads`` ways; MLA's compressed latent is not split by tp);
* **activations**: inference - one layer's working set for the prefill of the context; training -
  Korthikanti et al. 2022 (``34 s b h`` bytes per layer with sequence parallelism and flash
  attention, ``2 s b h`` with full recomputation), plus float32 logits;
* **training state**: bf16 gradients (2 B/param, split by ``dp`` from ZeRO-2) and Adam in float32
  (master weights, m, v: 12 B/param, split by ``dp`` from ZeRO-1);
* **communication** per step and device: ring all-reduce ``2 (n-1)/n`` of the tensor (TP: two per
  layer and pass; DP: the gradients; ZeRO-3: 3 (n-1)/n of the parameters), all-to-all dispatch +
  combine for EP, one activation per pipeline boundary, the KV ring for CP; backward doubles the
  activation terms in training. Groups that span nodes are costed at the inter-node bandwidth.
  Each collective also costs a fixed latency (the alpha of the alpha-beta model: what a message
  costs before its bytes - launch, handshake, the ring's steps), counted per group: TP two per
  layer and pass, EP dispatch + combine per MoE layer and pass, PP one per microbatch and pass, CP
  cp - 1 ring steps per layer and pass, DP one per 25 MiB gradient bucket (DDP's default), ZeRO-3
  three per layer (gather forward, gather backward, reduce-scatter). On small messages latency is
  the whole cost: measured with gloo on a 2-core CPU, a pruned model's TP step spent 12 ms in
  collectives whose bytes / bandwidth came to 0.01 ms.

A layout fits when its total per device is within ``usable`` (default 0.9) of the device memory
(the rest: runtime, allocator fragmentation, communication buffers).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

INTRA_NODE_BW = 450e9  # bytes/s per device within a node (NVLink-class); a ranking weight, not a claim
INTER_NODE_BW = 50e9  # bytes/s per device across nodes (400 Gb/s InfiniBand-class)
DEVICE_FLOPS = 1e15  # dense bf16 FLOP/s of one device (H100/H200-class), a ranking weight
INTRA_NODE_LATENCY = 15e-6  # s per collective within a node (a small NCCL all-reduce); a ranking weight
INTER_NODE_LATENCY = 40e-6  # s per collective across nodes; a ranking weight
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default gradient bucket (bucket_cap_mb = 25): one all-reduce each

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``141GiB``, ``80GB``, ``80G`` (binary), ``1.5TiB`` -> bytes; ValueError with the reason."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 141GiB, 80GB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if not 0 < n <= MAX_DEVICE_MEMORY:
        raise ValueError(f"--device-memory must be > 0 and <= {gib(MAX_DEVICE_MEMORY)} GiB, got {text!r}")
    return n


# What a plan's inputs can physically be: bounds far above any cluster built, far below what would
# make the candidate enumeration run for minutes (it walks the divisors of the device count).
MAX_DEVICE_MEMORY = 2**50  # 1 PiB on one device
MAX_DEVICES_PER_NODE = 1024
MAX_DEVICES = 2**20


def check_inputs(*, devices_per_node: int, nodes: int, device_memory: int, batch: int, context: int,
                 usable: float = 0.9) -> None:
    """ValueError, one line naming the option and its bound, for inputs no cluster has."""
    for opt, v, lo, hi in (("--devices", devices_per_node, 1, MAX_DEVICES_PER_NODE), ("--nodes", nodes, 1, MAX_DEVICES),
                           ("--batch", batch, 1, 2**31), ("--context", context, 1, 2**31)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{opt} must be an integer in [{lo}, {hi}], got {v!r}")
    if devices_per_node * nodes > MAX_DEVICES:
        raise ValueError(f"--devices x --nodes must be <= {MAX_DEVICES}, got {devices_per_node * nodes}")
    if isinstance(device_memory, bool) or not 0 < device_memory <= MAX_DEVICE_MEMORY:
        raise ValueError(f"--device-memory must be > 0 and <= {gib(MAX_DEVICE_MEMORY)} GiB, got {device_memory!r}")
    if not 0 < usable <= 1:
        raise ValueError(f"--usable must be in (0, 1], got {usable}")


def gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


@dataclass
class ModelFacts:
    name: str
    params_by_kind: dict[str, int]
    total_params: int
    weight_bytes: dict[str, float]  # kind -> bytes in the chosen format (sums to inspect's total)
    weight_format: str
    buffer_bytes: int
    kv_bytes_per_token: int  # all layers, inspect's figure
    kv_split_by_tp: int  # how many ways tp can split the KV cache (kv heads; 1 for MLA)
    layers: int
    hidden: int
    vocab: int
    heads: int
    intermediate: int  # per-token MLP width (top-k + shared experts for MoE)
    num_experts: int
    top_k: int
    moe_layers: int
    flops_per_token: float = 0.0  # forward, prefill at the planned context (inspect's figure)
    notes: list[str] = field(default_factory=list)
    # Where each parameter lives when the parallel check's own steps split the model (``stage_facts``):
    # per decoder layer, kind -> [params tp splits, params tp leaves replicated]; "first" / "last":
    # what only the first stage (embedding) and the last (final norm, lm_head) hold. Empty: the
    # uniform model of _share (every kind split as the module docstring says, layers evenly by pp).
    layer_kinds: list[dict[str, list[int]]] = field(default_factory=list)
    ends: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    kv_heads: int = 0  # key/value heads of the attention's projections (0: not known)
    # collectives of each decoder layer as the check's steps issue them (``stage_facts``): tp forward
    # all-reduces (one per rowwise Linear and split experts module), tp backward (one per colwise Linear's
    # input gradient, two per split experts module), tp gradient sync (one per parameter of a
    # replicated_with_grad_allreduce module, once a step), the layer's parameter tensors (a cp
    # gradient sync reduces each) and those of its routed experts (0: a dense layer). Empty: the
    # uniform count (two per layer and pass).
    tp_calls: list[tuple[int, int, int, int, int]] = field(default_factory=list)


QUANTIZABLE = ("attention", "dense_mlp", "routed_experts", "shared_experts")


def model_facts(target, weights: str = "checkpoint", context: int = 4096) -> ModelFacts:
    from harness.inspect.flops import head_dims, is_mla, text_config
    from harness.inspect.report import inspect

    rep = inspect(target, trace="none", prefill_len=context, decode_context=context)
    p, fl = rep.params, rep.flops
    cfg = text_config(target.model_config(False).config)
    by = dict(p.by_kind)
    scen = {k: v for k, v in p.bytes.items()}
    quant = [k for k in scen if k not in ("float32", "bfloat16")]
    fmt = quant[0] if weights == "checkpoint" and quant else ("float32" if weights == "float32" else "bfloat16")
    sc = scen[fmt]
    buffers = int(sc.get("float32 (buffers)", 0)) if fmt != "float32" else p.buffers_persistent * 4
    wb: dict[str, float] = {}
    if fmt in quant and p.stored_by_kind:
        wb = {k: float(v) for k, v in p.stored_by_kind.items()}  # each kind's own bytes as stored
    elif fmt in quant:
        # inspect gives the quantized Linear weights + scales as one figure and the bf16 rest as another;
        # split them over kinds in proportion to parameters (totals stay inspect's exactly).
        keep16 = next(v for k, v in sc.items() if k.startswith("bfloat16"))
        qbytes = sc["total"] - keep16 - buffers
        outside = sum(n for k, n in by.items() if k not in QUANTIZABLE)
        inside16 = max(0.0, keep16 - 2 * outside)
        qparams = sum(by.get(k, 0) for k in QUANTIZABLE) or 1
        for k, n in by.items():
            wb[k] = n * 2.0 if k not in QUANTIZABLE else (qbytes + inside16) * n / qparams
    else:
        per = 4 if fmt == "float32" else 2
        for k, n in by.items():
            wb[k] = float(n * per)
    heads, kvh, _, _ = head_dims(cfg)
    mla = is_mla(cfg)
    kv_key = next(iter(fl.kv_cache_bytes_per_token))
    n_exp = p.num_experts or 0
    top_k = p.experts_per_token or 0
    inter = int(getattr(cfg, "intermediate_size", 0) or 0)
    if n_exp:
        moe_i = int(getattr(cfg, "moe_intermediate_size", 0) or inter)
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        inter = max(inter if getattr(cfg, "first_k_dense_replace", 0) else 0, moe_i * (top_k + shared))
    moe_layers = 0
    if n_exp:
        moe_layers = p.num_layers - int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    notes = [f"weights as {fmt}: {gib(sum(wb.values()) + buffers)} GiB (harness inspect: "
             f"{gib(sc['total'])} GiB)"]
    layer_kinds, ends, tp_calls = stage_facts(target)
    return ModelFacts(target.name, by, p.total, wb, fmt, buffers, fl.kv_cache_bytes_per_token[kv_key],
                      1 if mla else kvh, p.num_layers, int(cfg.hidden_size), int(cfg.vocab_size), heads, inter,
                      n_exp, top_k, moe_layers, fl.prefill_flops_per_token, notes, layer_kinds, ends, kvh,
                      tp_calls)


@dataclass
class Decoder:
    """What the parallel steps split: the model itself, or for a multimodal wrapper built whole (a
    bare config.json such as Kimi-K2.5's) its language decoder, the class ``harness init`` would
    build from the text part. The vision tower and projector are not split by any layout the check
    applies: their parameters (``extra``, by kind) are held whole by the first stage's ranks."""

    mc: object  # harness.models.config.ModelConfig of what is built
    target: object  # the Target that builds it (meta_model(target, mc=mc))
    extra: dict[str, int] = field(default_factory=dict)  # wrapper parts outside the decoder, by kind
    note: str = ""


def language_decoder(target) -> Decoder:
    """The decoder the parallel check's steps split (``split_stage`` cuts a causal LM's layers)."""
    import torch

    from harness.anatomy.moe import expert_parents, module_kind, module_part, num_experts
    from harness.inspect.params import meta_model
    from harness.models.config import build_config
    from harness.models.prune import PlanRefused, plan_for
    from harness.models.wrapper import is_wrapper

    mc = target.model_config(False)
    if mc.part or not is_wrapper(target.raw_config):
        return Decoder(mc, target)
    try:
        decoder = plan_for(target.raw_config, target.name)[0].architecture
    except PlanRefused:
        return Decoder(mc, target)
    if not decoder or decoder == mc.architecture:
        return Decoder(mc, target)  # no causal LM of its own: the wrapper runs whole
    wrapper, _ = meta_model(target, pruned=False, dtype=torch.bfloat16, mc=mc)
    n_exp = num_experts(mc.config)
    parents = expert_parents(wrapper, n_exp)
    extra: dict[str, int] = {}
    for fqn, mod in wrapper.named_modules():
        if module_part(fqn) == "text":
            continue
        for p in mod.parameters(recurse=False):
            kind = module_kind(fqn, mod, n_exp, parents)
            extra[kind] = extra.get(kind, 0) + p.numel()
    dmc = build_config(target.raw_config, None, architecture=decoder)
    n = sum(extra.values())
    note = (f"multimodal wrapper {mc.architecture}: its language decoder {decoder} is what the layout splits; "
            f"the vision tower and projector ({n / 1e9:.2f}B parameters) are held whole by the first stage's ranks")
    return Decoder(dmc, target, extra, note)


def stage_facts(target) -> tuple[list[dict[str, list[int]]], dict[str, dict[str, list[int]]],
                                 list[tuple[int, int, int, int, int]]]:
    """The meta model's parameters as the parallel check splits them (``harness plan --rehearse``
    measured the uniform model 25-34 % under on a DeepSeek-V3 pipeline's last stage): per decoder
    layer, each kind's parameters that the tp plan splits (``tp_plan_of``: colwise / rowwise Linear
    layers, fused experts) and those it leaves whole on every tp rank (MLA's low-rank projections,
    norms, routers; the embedding and lm_head, which no bundled architecture's base plan splits);
    the embedding on the first stage only, the final norm and lm_head on the last (``StageModule``),
    so that a stage's bytes are its own layers' (3 dense layers weigh less than 58 MoE ones)."""
    import torch

    from harness.anatomy.moe import expert_parents, module_kind, num_experts
    from harness.inspect.params import meta_model
    from harness.parallel.apply import _match, tp_plan_of
    from harness.parallel.tp_experts import splits

    dec = language_decoder(target)
    model, mc = meta_model(target, pruned=False, dtype=torch.bfloat16, mc=dec.mc)
    n_exp = num_experts(mc.config)
    parents = expert_parents(model, n_exp)
    styles = {n: st for n, st in _match(tp_plan_of(model)[0], model).items()
              if st != "moe_tp_experts" or splits(model.get_submodule(n))}
    split = {n for n, st in styles.items() if st in ("colwise", "rowwise", "moe_tp_experts")}
    base = getattr(model, model.base_model_prefix, None)
    if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        return [], {}, []  # not a causal LM split_stage can cut: the uniform model
    layers = list(base.layers)
    where = {f"{model.base_model_prefix}.layers.{i}": i for i in range(len(layers))}
    per_layer: list[dict[str, list[int]]] = [{} for _ in layers]
    ends: dict[str, dict[str, list[int]]] = {"first": {}, "last": {}}
    seen: set[int] = set()
    expert_tensors = [0] * len(layers)
    for fqn, mod in model.named_modules():
        kind = module_kind(fqn, mod, n_exp, parents)
        tp_split = any(fqn == n or fqn.startswith(n + ".") for n in split)
        layer = next((i for pre, i in where.items() if fqn == pre or fqn.startswith(pre + ".")), None)
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                if kind == "lm_head":  # tied: the last stage holds its own copy of the embedding
                    ends["last"].setdefault(kind, [0, 0])[int(not tp_split)] += p.numel()
                continue
            seen.add(id(p))
            if layer is not None and kind == "routed_experts":
                expert_tensors[layer] += 1
            bucket = per_layer[layer] if layer is not None else ends["first" if kind == "embedding" else "last"]
            bucket.setdefault(kind, [0, 0])[int(not tp_split)] += p.numel()
    for kind, n in dec.extra.items():  # a wrapper's vision tower and projector: whole, on the first stage
        ends["first"].setdefault(kind, [0, 0])[1] += n
    return per_layer, ends, _layer_calls(model, styles, where, layers, expert_tensors)


def _layer_calls(model, styles: dict[str, str], where: dict[str, int], layers: list,
                 expert_tensors: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Per decoder layer, what ``ModelFacts.tp_calls`` holds: tp forward / backward / gradient-sync
    collectives by the tp plan's styles, the layer's parameter tensors and its routed experts'."""
    calls = [[0, 0, 0] for _ in layers]
    for name, st in styles.items():
        layer = next((i for pre, i in where.items() if name.startswith(pre + ".")), None)
        if layer is None:
            continue
        # rowwise: its output all-reduced in forward; colwise: its input's gradient in backward; split
        # experts: both, the gradient of each differentiable input (hidden states and routing weights)
        calls[layer][0] += st in ("rowwise", "moe_tp_experts")
        calls[layer][1] += {"colwise": 1, "moe_tp_experts": 2}.get(st, 0)
        if st == "replicated_with_grad_allreduce":
            calls[layer][2] += len(list(model.get_submodule(name).parameters()))
    # parameter tensors: what a cp or replicated gradient sync reduces one by one
    return [(*c, len(list(layer.parameters())), n_exp) for c, layer, n_exp in zip(calls, layers, expert_tensors, strict=True)]


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int
    cp: int
    zero: int
    recompute: bool

    @property
    def name(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "dp", "ep", "cp") if getattr(self, k) > 1]
        s = "x".join(parts) or "single"
        if self.zero:
            s += f" zero{self.zero}"
        if self.recompute:
            s += " +recompute"
        return s


@dataclass
class Estimate:
    layout: Layout
    weights: float
    kv_cache: float
    activations: float
    gradients: float
    optimizer: float
    total: float
    fits: bool
    free: float
    comm_bytes: float
    comm_cross_node_bytes: float
    comm_time_s: float
    compute_time_s: float = 0.0
    why_not: str = ""
    comm_messages: float = 0.0  # collectives per step and device
    comm_latency_s: float = 0.0  # the part of comm_time_s that is per-collective latency
    comm_messages_by: dict[str, float] = field(default_factory=dict)  # comm_messages by group (tp, pp, ep ...)

    @property
    def step_time_s(self) -> float:
        return self.compute_time_s + self.comm_time_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layout"] = self.layout.name
        d["degrees"] = asdict(self.layout)
        return d


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


_LAYER_KINDS = ("attention", "dense_mlp", "routed_experts", "shared_experts", "router", "norm", "other")


def _share(kind: str, lay: Layout) -> float:
    """The fraction of a parameter kind one device holds: split by tp (vocabulary-parallel embedding
    too), routed experts by ep (by tp when ep = 1), decoder layers by pp."""
    f = 1.0
    if kind in ("attention", "dense_mlp", "shared_experts", "embedding", "lm_head"):
        f /= lay.tp
    if kind == "routed_experts":
        f /= lay.ep if lay.ep > 1 else lay.tp
    if kind in _LAYER_KINDS:
        f /= lay.pp
    return f


def _stage_params(m: ModelFacts, lay: Layout) -> list[dict[str, float]] | None:
    """Parameters of each kind one device of each pipeline stage holds, split as the parallel check
    splits them (``stage_facts``): stages cut at round(i x layers / pp) as ``split_stage`` cuts
    them; the tp-split part of each kind / tp, routed experts / ep (under ep the check gives the
    experts to ep, not tp). None without the per-layer facts."""
    if not m.layer_kinds:
        return None
    n = len(m.layer_kinds)
    bounds = [round(i * n / lay.pp) for i in range(lay.pp + 1)]

    def add(out: dict[str, float], kinds: dict[str, list[int]]) -> None:
        for k, (tp_split, whole) in kinds.items():
            if k == "routed_experts" and lay.ep > 1:
                out[k] = out.get(k, 0.0) + (tp_split + whole) / lay.ep
            else:
                out[k] = out.get(k, 0.0) + tp_split / lay.tp + whole

    stages = []
    for j in range(lay.pp):
        got: dict[str, float] = {}
        for i in range(bounds[j], bounds[j + 1]):
            add(got, m.layer_kinds[i])
        for end in (["first"] if j == 0 else []) + (["last"] if j == lay.pp - 1 else []):
            add(got, m.ends.get(end, {}))
        stages.append(got)
    return stages


def stage_bytes(values: dict[str, float], lay: Layout, m: ModelFacts) -> list[float] | None:
    """Per-kind totals (parameters, or bytes as the plan holds the weights) -> what one device of each
    pipeline stage holds, by ``m``'s per-layer facts; None without them."""
    stages = _stage_params(m, lay)
    if stages is None:
        return None
    return [sum(values.get(k, 0.0) * got / m.params_by_kind[k] for k, got in stage.items() if m.params_by_kind.get(k))
            for stage in stages]


def _per_device(values: dict[str, float], lay: Layout, m: ModelFacts | None = None) -> float:
    """Per-kind totals -> what one device holds: with ``m``'s per-layer facts, the largest stage's
    share of each kind (its parameters of that kind over the model's), largest by ``values`` (a
    stage of bf16 embeddings may outweigh one of more INT4 experts); otherwise the uniform model,
    under pp the worst stage keeping the larger end."""
    stages = stage_bytes(values, lay, m) if m is not None else None
    if stages is not None:
        return max(stages)
    s = sum(v * _share(k, lay) for k, v in values.items() if k not in ("embedding", "lm_head"))
    ends = [values.get("embedding", 0.0) * _share("embedding", lay), values.get("lm_head", 0.0) * _share("lm_head", lay)]
    return s + (max(ends) if lay.pp > 1 else sum(ends))


def _weights_and_state(m: ModelFacts, lay: Layout, train: bool) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer state, parameters) per device. Training: bf16 weights and
    gradients, Adam's 12 B/param in float32, split by dp from ZeRO-3 / -2 / -1."""
    params_dev = _per_device({k: float(v) for k, v in m.params_by_kind.items()}, lay, m)
    if train:
        weights = params_dev * 2 / (lay.dp if lay.zero >= 3 else 1)
        grads = params_dev * 2 / (lay.dp if lay.zero >= 2 else 1)
        optim = params_dev * 12 / (lay.dp if lay.zero >= 1 else 1)
    else:
        weights = _per_device(m.weight_bytes, lay, m) + m.buffer_bytes
        grads = optim = 0.0
    return weights, grads, optim, params_dev


def _kv_and_activations(m: ModelFacts, lay: Layout, train: bool, seqs: int, tokens: float,
                        context: int) -> tuple[float, float]:
    """KV cache (inference) and activations per device (training: Korthikanti et al. 2022)."""
    tp, pp, cp = lay.tp, lay.pp, lay.cp
    kv = 0.0 if train else m.kv_bytes_per_token * seqs * context / cp / pp / min(tp, m.kv_split_by_tp)
    layers_dev = math.ceil(m.layers / pp)
    if train:
        per_layer = (2 if lay.recompute else 34) * tokens * m.hidden / tp
        act = per_layer * layers_dev + (34 * tokens * m.hidden / tp if lay.recompute else 0)
        act += tokens * m.vocab / tp * 4  # float32 logits for the loss (last stage)
    else:
        act = tokens * 2 * (4 * m.hidden + 3 * m.intermediate / tp) + seqs * m.vocab / tp * 4
    return kv, act


def _communication(m: ModelFacts, lay: Layout, train: bool, tokens: float, params_dev: float) -> dict[str, float]:
    """Bytes per step and device of each group: ring all-reduce 2 (n-1)/n of the tensor, the
    all-to-all dispatch + combine, one activation per pipeline boundary, the KV ring."""
    tp, pp, dp, ep, cp = lay.tp, lay.pp, lay.dp, lay.ep, lay.cp
    passes = 2 if train else 1
    act_bytes = tokens * m.hidden * 2
    layers_dev = math.ceil(m.layers / pp)
    comm: dict[str, float] = {}
    if tp > 1:
        comm["tp"] = layers_dev * 2 * passes * 2 * (tp - 1) / tp * act_bytes
    if pp > 1:
        comm["pp"] = passes * act_bytes
    if ep > 1 and m.num_experts:
        moe_dev = math.ceil(m.moe_layers / pp)
        comm["ep"] = moe_dev * 2 * passes * tokens * m.top_k * m.hidden * 2 * (ep - 1) / ep
    if cp > 1:
        comm["cp"] = passes * (m.kv_bytes_per_token / max(m.layers, 1)) * layers_dev * tokens * (cp - 1)
    if train and dp > 1:
        comm["dp"] = (3 if lay.zero >= 3 else 2) * (dp - 1) / dp * params_dev * 2
    return comm


def _messages(m: ModelFacts, lay: Layout, train: bool, seqs: int, params_dev: float) -> dict[str, float]:
    """Collectives per step and device of each group (the module docstring), beside
    :func:`_communication`'s bytes: each pays the link's latency once."""
    tp, pp, dp, ep, cp = lay.tp, lay.pp, lay.dp, lay.ep, lay.cp
    passes = 2 if train else 1
    layers_dev = math.ceil(m.layers / pp)
    msgs: dict[str, float] = {}
    if tp > 1 and m.tp_calls:
        # the largest stage's layers (cut as split_stage cuts them), each microbatch of a pipeline
        # running them again; the gradient sync once a step (the rehearsal counted 5 backward and 2
        # forward all-reduces per Llama layer where "two per layer and pass" said 2 and 2)
        n = len(m.tp_calls)
        bounds = [round(i * n / pp) for i in range(pp + 1)]
        per_mb = 1 if pp == 1 else seqs
        stages = list(zip(bounds, bounds[1:], strict=False))
        msgs["tp"] = max(sum(f * per_mb + (b * per_mb + g if train else 0) for f, b, g, *_ in m.tp_calls[lo:hi])
                         for lo, hi in stages)
    elif tp > 1:
        msgs["tp"] = layers_dev * 2 * passes
    if pp > 1:
        # a stage inside the pipeline receives and sends every microbatch (a sequence each) in each pass
        msgs["pp"] = 2 * passes * seqs
    if ep > 1 and m.num_experts and m.tp_calls:
        # the check's dispatch (harness.parallel.ep): 4 all-to-alls a MoE layer forward (counts, tokens,
        # routing weights, combine), 2 backward, each microbatch; in training the other parameters'
        # gradients all-reduced over ep (its ranks are data ranks to them), one by one, once a step
        n = len(m.tp_calls)
        bounds = [round(i * n / pp) for i in range(pp + 1)]
        msgs["ep"] = max(sum((4 + (2 if train else 0)) * (1 if pp == 1 else seqs) * (c[4] > 0)
                             + (c[3] - c[4] if train else 0) for c in m.tp_calls[lo:hi])
                         for lo, hi in zip(bounds, bounds[1:], strict=False))
    elif ep > 1 and m.num_experts:
        msgs["ep"] = math.ceil(m.moe_layers / pp) * 2 * passes
    if cp > 1 and m.tp_calls:
        # the check's cp (harness.parallel.cp) all-gathers K and V per layer in forward and reduces
        # their gradients in backward; in training every parameter's gradient is all-reduced over cp
        n = len(m.tp_calls)
        bounds = [round(i * n / pp) for i in range(pp + 1)]
        msgs["cp"] = max(2 * passes * (hi - lo) * (1 if pp == 1 else seqs)
                         + (sum(c[3] for c in m.tp_calls[lo:hi]) if train else 0)
                         for lo, hi in zip(bounds, bounds[1:], strict=False))
    elif cp > 1:
        msgs["cp"] = passes * layers_dev * (cp - 1)
    if train and dp > 1:
        msgs["dp"] = 3 * layers_dev if lay.zero >= 3 else max(1, math.ceil(params_dev * 2 / DDP_BUCKET_BYTES))
    return msgs


def _spanning(lay: Layout, devices_per_node: int) -> set[str]:
    """The groups that span nodes: ranks are laid out tp (innermost), cp, ep/dp, pp."""
    out: set[str] = set()
    inner = 1
    for dim, n in (("tp", lay.tp), ("cp", lay.cp), ("dp", lay.dp), ("pp", lay.pp)):
        inner *= n
        if inner > devices_per_node:
            out |= {"dp", "ep"} if dim == "dp" else {dim}
    return out


def estimate(m: ModelFacts, lay: Layout, *, mode: str, batch: int, context: int, device_memory: int,
             devices_per_node: int, usable: float = 0.9, device_flops: float = DEVICE_FLOPS,
             intra_bw: float = INTRA_NODE_BW, inter_bw: float = INTER_NODE_BW,
             intra_latency: float = INTRA_NODE_LATENCY, inter_latency: float = INTER_NODE_LATENCY) -> Estimate:
    """Memory per device, communication and step time of ``lay`` (the module docstring's model).
    ``device_flops``, the bandwidths and the latencies default to the ranking weights above; the
    parallel check passes the ones it measured on the machine to compare the model's step with the
    measured one."""
    train = mode == "training"
    weights, grads, optim, params_dev = _weights_and_state(m, lay, train)
    seqs = math.ceil(batch / lay.dp)
    tokens = seqs * context / lay.cp  # tokens of one replica on this device's context shard
    kv, act = _kv_and_activations(m, lay, train, seqs, tokens, context)
    total = weights + kv + act + grads + optim
    comm = _communication(m, lay, train, tokens, params_dev)
    msgs = _messages(m, lay, train, seqs, params_dev)
    spans = _spanning(lay, devices_per_node)
    cross = sum(v for k, v in comm.items() if k in spans)
    comm_total = sum(comm.values())
    # alpha-beta: every collective pays its link's latency, then its bytes at the link's bandwidth
    latency_s = sum(n * (inter_latency if k in spans else intra_latency) for k, n in msgs.items())
    time_s = (comm_total - cross) / intra_bw + cross / inter_bw + latency_s
    # Compute: the step's FLOPs over the devices that work at once. A pipeline keeps its stages busy
    # only with several microbatches in flight (bubble (pp-1)/(m+pp-1), m = sequences per replica);
    # replicas beyond the batch idle; training is 3 forward passes (4 with recomputation).
    m_mb = seqs
    busy = lay.tp * lay.cp * min(lay.dp, batch) * lay.pp * m_mb / (m_mb + lay.pp - 1)
    flops = m.flops_per_token * batch * context * ((4 if lay.recompute else 3) if train else 1)
    compute_s = flops / busy / device_flops
    limit = device_memory * usable
    why = "" if total <= limit else f"needs {gib(total)} GiB per device, {gib(limit)} GiB usable"
    return Estimate(lay, weights, kv, act, grads, optim, total, total <= limit, limit - total, comm_total, cross,
                    time_s, compute_s, why, sum(msgs.values()), latency_s, msgs)


def _kv_heads_split(m: ModelFacts, tp: int) -> bool:
    """tp splits the key/value heads evenly (the parallel check's tp split, and Megatron's query groups,
    need it; one shared head (MQA) is replicated, MHA splits with the query heads): the rehearsal's rule
    (harness.parallel.rehearse.divisibility). Without it the plan ranked tp8 first for qwen3-30b-a3b's 4
    key/value heads, a layout the nightly rehearsal refused."""
    kvh = m.kv_heads
    return tp == 1 or not kvh or kvh in (1, m.heads) or kvh % tp == 0


def candidate_layouts(m: ModelFacts, devices: int, devices_per_node: int, mode: str,
                      context: int | None = None) -> list[Layout]:
    """``context``: tokens per sequence; a context-parallel degree above it would leave ranks
    without a token, so cp never exceeds it."""
    out = []
    for tp in _divisors(devices):
        if tp > devices_per_node or m.heads % tp or not _kv_heads_split(m, tp):
            continue
        for pp in _divisors(devices // tp):
            if pp > m.layers:
                continue
            for cp in _divisors(devices // tp // pp):
                if context is not None and cp > context:
                    continue
                dp = devices // tp // pp // cp
                eps = [1]
                if m.num_experts:
                    eps = [e for e in _divisors(tp * dp) if m.num_experts % e == 0]
                for ep in eps:
                    zeros = [0, 1, 2, 3] if mode == "training" and dp > 1 else [0]
                    rcs = [False, True] if mode == "training" else [False]
                    for z in zeros:
                        for rc in rcs:
                            out.append(Layout(tp, pp, dp, ep, cp, z, rc))
    return out


@dataclass
class PlanReport:
    model: ModelFacts
    mode: str
    devices: int
    nodes: int
    device_memory: int
    batch: int
    context: int
    ranked: list[Estimate]
    recommendation: str

    def to_dict(self) -> dict:
        return {"model": self.model.name, "mode": self.mode, "devices": self.devices, "nodes": self.nodes,
                "device_memory": self.device_memory, "batch": self.batch, "context": self.context,
                "weight_format": self.model.weight_format, "notes": self.model.notes,
                "layouts": [e.to_dict() for e in self.ranked], "recommendation": self.recommendation}


def plan(m: ModelFacts, *, devices_per_node: int, nodes: int, device_memory: int, mode: str = "inference",
         batch: int = 1, context: int = 4096, usable: float = 0.9) -> PlanReport:
    check_inputs(devices_per_node=devices_per_node, nodes=nodes, device_memory=device_memory, batch=batch,
                 context=context, usable=usable)
    n = devices_per_node * nodes
    ests = [estimate(m, lay, mode=mode, batch=batch, context=context, device_memory=device_memory,
                     devices_per_node=devices_per_node, usable=usable)
            for lay in candidate_layouts(m, n, devices_per_node, mode, context)]
    # Feasible first; among them the shortest estimated step (compute over the busy devices plus
    # communication at nominal bandwidths and latencies), then the most headroom, then the simplest layout.
    ests.sort(key=lambda e: (not e.fits, round(e.step_time_s, 6) if e.fits else e.total, -e.free,
                             sum(getattr(e.layout, k) > 1 for k in ("tp", "pp", "dp", "ep", "cp")) + e.layout.zero))
    if ests and ests[0].fits:
        b = ests[0]
        rec = (f"{b.layout.name}: fits with {gib(b.free)} GiB to spare per device "
               f"({gib(b.total)} of {gib(device_memory)} GiB used), and has the shortest estimated step of the "
               f"{sum(e.fits for e in ests)} layouts that fit ({b.step_time_s * 1e3:.1f} ms: compute "
               f"{b.compute_time_s * 1e3:.1f} ms over the busy devices, {b.comm_bytes / 1e9:.2f} GB in "
               f"{b.comm_messages:.0f} collectives per device"
               + (f", {b.comm_cross_node_bytes / 1e9:.2f} GB of it across nodes" if b.comm_cross_node_bytes else
                  ", all within a node") + ")")
    else:
        best = min(ests, key=lambda e: e.total) if ests else None
        rec = (f"no layout fits {n} x {gib(device_memory)} GiB for {mode}"
               + (f"; the smallest need is {best.layout.name} at {gib(best.total)} GiB per device "
                  f"(weights alone {gib(best.weights)} GiB): more devices or nodes, or a smaller format"
                  if best else ""))
    return PlanReport(m, mode, n, nodes, device_memory, batch, context, ests, rec)


def render(rep: PlanReport, top: int = 12) -> str:
    m = rep.model
    lines = [f"{m.name}: {m.total_params / 1e9:.1f}B parameters, {rep.mode}, {rep.nodes} node(s) x "
             f"{rep.devices // rep.nodes} devices x {gib(rep.device_memory)} GiB, batch {rep.batch}, "
             f"context {rep.context}", *("  " + x for x in m.notes), ""]
    hdr = (f"{'layout':<28}{'weights':>9}{'kv':>8}{'act':>8}{'grads':>8}{'optim':>8}{'total':>9}{'free':>8}"
           f"{'comm GB':>9}{'x-node':>8}{'step ms':>9}  fits")
    lines += ["per device, GiB:", hdr]
    for e in rep.ranked[:top]:
        lines.append(f"{e.layout.name:<28}{gib(e.weights):>9}{gib(e.kv_cache):>8}{gib(e.activations):>8}"
                     f"{gib(e.gradients):>8}{gib(e.optimizer):>8}{gib(e.total):>9}{gib(e.free):>8}"
                     f"{e.comm_bytes / 1e9:>9.2f}{e.comm_cross_node_bytes / 1e9:>8.2f}{e.step_time_s * 1e3:>9.1f}  "
                     f"{'yes' if e.fits else 'no'}")
    if len(rep.ranked) > top:
        lines.append(f"... {len(rep.ranked) - top} more (--top N, --json)")
    lines += ["", f"recommendation: {rep.recommendation}"]
    return "\n".join(lines)
