"""Apply a layout to a model, one strategy at a time, in torchtitan's order:
``apply_tp -> apply_ep -> apply_ac -> apply_fsdp | apply_dp``; for pp the model is split first
(``split_stage``), the same functions applied to the stage's chunk, then ``pipeline_stage``.

Each function takes the model built on every rank from the same seed (identical weights) and the
device mesh dimension it parallelizes over.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from harness.anatomy.layers import decoder_layers
from harness.parallel.reference import clean_name, lm_loss

TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def tp_plan_of(model: torch.nn.Module, override: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The tensor-parallel plan: the suite's ``tp_plan`` if given, else transformers' own
    ``base_model_tp_plan`` of the architecture (keys relative to the base model, ``*`` = a layer
    index). ``moe_tp_experts`` (fused experts) is kept for :mod:`harness.parallel.tp_experts`; entries
    with styles harness does not apply are left out, with a note: those modules stay replicated on
    the tp ranks."""
    plan = dict(override) if override else dict(getattr(model.config, "base_model_tp_plan", None) or {})
    kept, notes = {}, []
    # Fused experts: "moe_tp_experts" on the module is applied by harness.parallel.tp_experts, which also
    # splits the gate_up_proj ("packed_colwise") and down_proj ("rowwise") parameters it names.
    fused = "moe_tp_experts" in plan.values()
    handled = set(TP_STYLES) | ({"moe_tp_experts", "packed_colwise"} if fused else set())
    skipped = sorted({v for v in plan.values() if v not in handled})
    for k, v in plan.items():
        if v in TP_STYLES or v == "moe_tp_experts":
            kept[k] = v
    if skipped:
        notes.append(f"tp plan styles not applied (modules stay replicated on the tp ranks): {', '.join(skipped)}")
    return kept, notes


def _match(plan: dict[str, str], model: torch.nn.Module) -> dict[str, str]:
    """Plan keys (relative to the base model) -> full module names of nn.Linear / other modules."""
    base = getattr(model, "base_model_prefix", "model")
    pats = [(re.compile(r"^(?:" + re.escape(base) + r"\.)?" + re.escape(k).replace(r"\*", r"\d+") + "$"), v)
            for k, v in plan.items()]
    out = {}
    for name, mod in model.named_modules():
        for pat, style in pats:
            if pat.match(name):
                if style in ("colwise", "rowwise") and not isinstance(mod, torch.nn.Linear):
                    continue
                out[name] = style
                break
    return out


def apply_tp(model: torch.nn.Module, tp_mesh, plan: dict[str, str], kv_heads: int | None = None) -> list[str]:
    """DTensor tensor parallelism: colwise / rowwise Linear layers (outputs as local tensors, so the
    attention's ``view(..., -1, head_dim)`` sees the local heads). Returns the names of the modules
    whose weights must have their gradients all-reduced over tp (``replicated_with_grad_allreduce``:
    norms applied to local heads).

    With one key/value head (MQA) and tp > 1 the k/v projections cannot be split by heads: they
    are replicated (each rank's query heads all read the one KV head; its gradient is summed over
    tp), as inference engines do when tp exceeds the KV heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    if kv_heads is not None and kv_heads % tp:
        if kv_heads != 1:
            raise ValueError(f"tp{tp} with {kv_heads} key/value heads: only a single KV head can be replicated")
        plan = {k: ("replicated_with_grad_allreduce" if k.rsplit(".", 1)[-1] in ("k_proj", "v_proj", "k_norm")
                    else v) for k, v in plan.items()}
        group = tp_mesh.get_group()
        for mod in model.modules():
            if hasattr(mod, "num_key_value_groups") and hasattr(mod, "k_proj"):
                mod.num_key_value_groups = max(1, mod.num_key_value_groups // tp)
                # Each rank's k/v serve only its own query heads, so the gradient flowing back into
                # the attention input through them is partial: summed over tp (Megatron's "f").
                for proj in (mod.k_proj, mod.v_proj):
                    proj.register_forward_pre_hook(lambda _m, args, g=group: (_GradAllReduce.apply(args[0], g),
                                                                              *args[1:]))
    matched = _match(plan, model)
    styles = {n: ColwiseParallel() if s == "colwise" else RowwiseParallel()
              for n, s in matched.items() if s in ("colwise", "rowwise")}
    if not styles:
        if "moe_tp_experts" in matched.values():
            # DeepSeek-V4's plan splits its fused experts only (harness.parallel.tp_experts does that):
            # its attention stays whole on every tp rank, as the architecture's own plan says.
            return []
        raise ValueError("the tensor-parallel plan matches no Linear layer of this model")
    parallelize_module(model, tp_mesh, styles)
    return [n for n, s in matched.items() if s == "replicated_with_grad_allreduce"]


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over ``group`` in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def apply_ep(model: torch.nn.Module, num_experts: int, ep_group, capacity_factor: float) -> list[str]:
    from harness.parallel.ep import shard_experts

    names = shard_experts(model, num_experts, ep_group, capacity_factor)
    if not names:
        raise ValueError("no experts module found to shard")
    return names


def apply_ac(model: torch.nn.Module) -> None:
    """Activation recomputation of every decoder layer, through transformers' own
    ``gradient_checkpointing_enable`` (non-reentrant torch.utils.checkpoint)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: torch.nn.Module, fsdp_mesh, reshard_after_forward: bool = True,
               experts: tuple[list[str], object, float] | None = None) -> None:
    """FSDP2 (ZeRO-3): every decoder layer is one unit, the rest (embedding, norm, lm_head) the root.

    ``experts = (names, mesh, divide)`` is ep x fsdp (torchtitan's "dp_shard_in_ep"): ``fsdp_mesh``
    spans every data rank (fsdp x ep flattened) and shards everything but the experts; each expert
    partition of ``apply_ep`` (the ``names`` modules, already ``[E/ep, ...]``) is its own FSDP unit
    over ``mesh``, the ranks holding the same partition. Its gradient is summed over the ep group's
    tokens by the dispatch all-to-all's backward and averaged over ``mesh`` by FSDP, so its divide
    factor is set to every data rank's count (``divide``), as torchtitan does, for the mean over
    the whole batch.

    ``fsdp_mesh`` is 1-D (shard) or 2-D ``(replicate, shard)``: HSDP - parameters sharded along the
    inner dimension and replicated along the outer one; gradients reduce-scattered within a shard
    group, then all-reduced over the replicas. After ``apply_tp`` (torchtitan's FSDP2 + TP, the mesh
    a dimension of the same device mesh as tp's) the tp-sharded parameters become 2-D DTensors
    (sharded over fsdp, then over tp); parameters the tp plan left replicated are sharded over fsdp
    only.

    ``reshard_after_forward=False`` is ZeRO-2 (torch's and torchtitan's way to it with FSDP2): the
    parameters are all-gathered once per step and kept unsharded through forward *and* backward (no
    re-gather in backward), gradients are reduce-scattered, the optimizer steps on the shards - the
    communication of DeepSpeed's ZeRO-2 (reduce-scatter of gradients, all-gather of updated
    parameters). Unlike DeepSpeed's, FSDP2 still frees the unsharded parameters after backward
    (between steps each rank holds its shard only)."""
    from torch.distributed.fsdp import fully_shard

    for name in (experts[0] if experts else []):
        unit = fully_shard(model.get_submodule(name), mesh=experts[1], reshard_after_forward=reshard_after_forward)
        unit.set_gradient_divide_factor(experts[2])
        # A factor other than the mesh's size is a PREMUL_SUM reduce-scatter, which gloo lacks:
        # plain sums, divided by the factor afterwards (any backend).
        unit.set_force_sum_reduction_for_comms(True)
    for layer in decoder_layers(model)[1]:
        if next(layer.parameters(), None) is None:
            continue  # a pipeline stage's pass-through for another stage's layer
        _own_units_for_other_dtypes(layer, fsdp_mesh, reshard_after_forward)
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    _own_units_for_other_dtypes(model, fsdp_mesh, reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)


def _own_units_for_other_dtypes(unit: torch.nn.Module, mesh, reshard_after_forward: bool) -> None:
    """FSDP2 all-gathers one unit's parameters as one flat buffer of one dtype. A module inside ``unit``
    whose own parameters are in another dtype than most of the unit's - a bf16 DeepSeek-V3 keeps its
    router ``gate.weight`` in float32, as deployed (harness.models.build.keep_in_fp32) - becomes a
    unit of its own first."""
    from collections import Counter

    from torch.distributed.fsdp import FSDPModule, fully_shard

    counts = Counter(p.dtype for p in unit.parameters())
    if len(counts) < 2:
        return
    major = counts.most_common(1)[0][0]
    for sub in list(unit.modules()):
        own = list(sub.parameters(recurse=False))
        if sub is not unit and own and not isinstance(sub, FSDPModule) and {q.dtype for q in own} != {major}:
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward)


def apply_dp(model: torch.nn.Module, group, counter=None, find_unused_parameters: bool = False) -> torch.nn.Module:
    """DistributedDataParallel over ``group`` (gradients averaged by bucketed all-reduce)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=group, broadcast_buffers=False, bucket_cap_mb=1,
              find_unused_parameters=find_unused_parameters)
    if counter is not None:
        from harness.parallel.comm import ddp_counting_hook

        ddp.register_comm_hook(group, ddp_counting_hook(counter))
    return ddp


def zero1_optimizer(params, lr: float, group) -> torch.optim.Optimizer:
    """ZeRO-1: ``torch.distributed.optim.ZeroRedundancyOptimizer`` around the reference's optimizer
    (SGD, momentum 0.9): each rank of ``group`` keeps the optimizer state of its partition of the
    parameters (whole tensors, balanced by size), steps them, and broadcasts them to the others."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, process_group=group, lr=lr,
                                   momentum=0.9, foreach=False)  # the reference's loop (make_optimizer)


def sync_grads(model: torch.nn.Module, group, skip: set[str] = frozenset(), only: set[str] | None = None) -> None:
    """Sum gradients over ``group`` (the data dimension of a layout without DDP/FSDP; the loss was
    scaled by 1/data degree), for every parameter not in ``skip`` (and in ``only`` when given).
    DTensor gradients are summed shard by shard."""
    for name, p in model.named_parameters():
        if p.grad is None or clean_name(name) in skip or (only is not None and clean_name(name) not in only):
            continue
        g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
        dist.all_reduce(g, group=group)


# --- pipeline ------------------------------------------------------------------------------------


class _PassLayer(torch.nn.Module):
    """A decoder layer owned by another stage: the hidden states pass through. It returns what the
    layer it stands for returns: GLM-5's DSA layers return ``(hidden_states, topk_indices)`` and the
    base model's loop hands the top-k on as the next layer's ``prev_topk_indices`` ("shared" layers
    reuse the previous full layer's selection), so a pass layer hands on what it was given. A stage
    whose first owned layer is a "shared" one then gets None and transformers' own error says the
    cut separates it from its indexer layer: a finding of the layout, not hidden by the stand-in."""

    def __init__(self, layer: torch.nn.Module | None = None):
        super().__init__()
        self.carries = _carried_outputs(layer)
        # what the base model's loop reads off a layer before calling it (Nemotron-H's block_type picks
        # the mask it passes): the stand-in keeps the layer's plain attributes
        for k, v in vars(layer or torch.nn.Module()).items():
            if not k.startswith("_") and (v is None or isinstance(v, (str, int, float, bool))):
                setattr(self, k, v)

    def forward(self, hidden_states, *args, **kwargs):
        if not self.carries:
            return hidden_states
        return (hidden_states, *(kwargs.get(k) for k in self.carries))


def _carried_outputs(layer: torch.nn.Module | None) -> tuple[str, ...]:
    """The keyword arguments (``prev_<name>``) a decoder layer's extra outputs come back in, read from
    its forward's signature and return annotation: ``-> tuple[Tensor, Tensor | None]`` with a
    ``prev_topk_indices`` parameter is GLM-5's; ``-> Tensor`` (every other bundled family) is none."""
    import inspect

    if layer is None:
        return ()
    sig = inspect.signature(type(layer).forward)
    ret = sig.return_annotation
    text = ret if isinstance(ret, str) else repr(ret)
    if not text.startswith(("tuple", "typing.Tuple", "Tuple")):
        return ()
    return tuple(k for k in sig.parameters if k.startswith("prev_"))


class StageModule(torch.nn.Module):
    """One pipeline stage of a causal LM, split at decoder layers. It runs transformers' own base
    model forward (masks, rotary embeddings, every architecture's quirks) with the layers of other
    stages passing through; the first stage embeds, the last applies the final norm and lm_head.
    Parameter names stay those of the full model."""

    def __init__(self, lm: torch.nn.Module, stage: int, num_stages: int):
        super().__init__()
        base_name = lm.base_model_prefix
        base = getattr(lm, base_name)
        layers = base.layers
        n = len(layers)
        bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
        self.owned = range(bounds[stage], bounds[stage + 1])
        for i in range(n):
            if i not in self.owned:
                layers[i] = _PassLayer(layers[i])
        self.first, self.last = stage == 0, stage == num_stages - 1
        if not self.first:
            base.embed_tokens = None
        if not self.last:
            base.norm = torch.nn.Identity()
        self.add_module(base_name, base)
        # base_model_prefix as on the model: apply_tp's plan keys and apply_fsdp's decoder layers
        # resolve on the stage as they do on the whole model.
        self.base_name = self.base_model_prefix = base_name
        self.lm_head = lm.lm_head if self.last else None

    def forward(self, x):
        base = getattr(self, self.base_name)
        if self.first:
            h = base(input_ids=x, use_cache=False).last_hidden_state
        else:
            h = base(inputs_embeds=x, use_cache=False).last_hidden_state
        return self.lm_head(h) if self.last else h


def split_stage(lm: torch.nn.Module, pp_group) -> StageModule:
    """This rank's pipeline stage of ``lm`` (the layers of other stages dropped from ``lm`` too).
    torchtitan's order: the model is split first, and tp / fsdp / recomputation are applied to the
    stage's chunk only, so FSDP units and DTensor shards exist for the layers this stage runs."""
    return StageModule(lm, dist.get_rank(pp_group), dist.get_world_size(pp_group))


def pipeline_stage(mod: StageModule, pp_group, microbatches: int, schedule: str, dp_group=None, counter=None,
                   device: torch.device | str = "cpu"):
    """(stage module, PipelineStage, schedule) for the stage ``mod`` of :func:`split_stage` (already
    tensor-parallel or fully sharded where the layout says so); the loss is the reference's (averaged
    per microbatch, gradients scaled by the schedule).

    A stage module that is an FSDP2 root (pp x fsdp) is driven by torch.distributed.pipelining
    itself: every microbatch's backward runs without gradient sync or reshard, and the schedule's
    final REDUCE_GRAD runs FSDP's post-backward (one reduce-scatter of the accumulated gradients)
    before scaling them by 1/microbatches.

    With ``dp_group`` (pp x dp) the stage module is wrapped in DDP over the ranks holding the same
    stage: torch.distributed.pipelining drives DDP itself (``no_sync`` for every microbatch but the
    schedule's last backward, whose reducer all-reduces the stage's accumulated gradients), so the
    gradient is the mean over microbatches (the schedule's scaling) and dp replicas (DDP's)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    stage_idx, n = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    if dp_group is not None:
        # find_unused_parameters turns off DDP's bucket rebuild after the first step, which asserts
        # under the pipeline (the reducer records every microbatch's backward, 2 x the parameters).
        mod = apply_dp(mod, dp_group, counter, find_unused_parameters=True)
    # The stage's send/receive buffers are made on ``device``: the rank's own (a CPU stage on a
    # device backend would hand host tensors to its collective and host activations to its layers).
    stage = PipelineStage(mod, stage_idx, n, torch.device(device), group=pp_group)
    cls = get_schedule_class(schedule)
    sched = cls(stage, microbatches, loss_fn=lm_loss)
    return mod, stage, sched
