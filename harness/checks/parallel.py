"""Parallel layouts against the single-process reference: TP, PP, DP, EP, FSDP and combinations.

One item per layout (``tp2``, ``ep2xtp2``, ...); the layouts of one world size run in *one*
torchrun launch, shared by their items (the first item of a world size launches, the others read
its results), so start-up is paid once. Per layout, as named steps:

``layout``     the variant's layout, and whether the pruned model can take it (else skipped);
``reference``  the single-process step (logits, loss, gradients, weights after one SGD step,
               logits after it, every module's output) - once per suite x dtype;
``launch``     torchrun with every layout of this world size (harness.parallel.launcher): a hung
               layout is killed and reported with rank, step and collective; a crash with its signal;
``compare``    logits, loss, every gradient gathered to full shape, the weights after the step and
               the logits after it, rank by rank, under dtype-aware tolerances (docs/parallel.md);
               routing-aware for MoE (harness.precision.routing: near-tie flips compared with the
               reference rerun with the layout's routing, wide ones fail at the router);
               on a mismatch: the first diverging module and its ranks, the worst gradient;
``memory``     recomputation on vs off: equal gradients, lower measured peak; FSDP: per-rank
               parameter and optimizer bytes about 1/world of the whole.

Collectives issued (count and bytes per kind) are recorded as metrics, so a change in communication
volume is itself a regression signal.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from harness import metrics
from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    CouldNotRun,
    NotApplicable,
)
from harness.files import scratch

metrics.declare("parallel_logits_error", "", "lower", "max |logits - reference| / max |reference| over ranks")
metrics.declare("parallel_loss_error", "", "lower", "|loss - reference| / |reference|, worst rank")
metrics.declare("parallel_grad_error", "", "lower", "worst scale-relative error of a full-shape gradient")
metrics.declare("parallel_weight_error", "", "lower", "worst scale-relative error of a weight after one step")
metrics.declare("parallel_logits_after_error", "", "lower", "logits after the optimizer step vs the reference")
metrics.declare("parallel_activation_error", "", "lower", "worst module output vs the reference (localization)")
metrics.declare("parallel_router_error", "", "lower", "worst router logits vs the reference (both forwards)")
# routing_flips_near_tie is declared by the precision check (same meaning: near-tie routing flips).
metrics.declare("parallel_grad_error_f64", "", "lower", "worst scale-relative error of a full-shape gradient against "
                "the float64 reference")
metrics.declare("parallel_f64_budget_use", "", "lower", "worst error against the float64 reference / its budget "
                "(k x the single-process run's own float64 error + floor), gradients and weights; fails above 1")
metrics.declare("parallel_world_size", "", "none", "ranks of the layout")
metrics.declare("parallel_layout_time_s", "s", "lower", "wall time of the layout on its slowest rank")
metrics.declare("parallel_launch_time_s", "s", "lower", "wall time of the launch that ran the layout, from its start "
                "to the layout's results (to its end for the last layout)")
metrics.declare("parallel_launch_layouts", "", "none", "layouts sharing the launch")
metrics.declare("parallel_nodes", "", "none", "nodes a multi-node launch spread the layout's ranks over (harness run --nodes)")
metrics.declare("parallel_peak_bytes", "bytes", "lower", "peak tracked tensor memory of a rank (MemTracker; "
                "pipeline stages: harness.parallel.memory.StoragePeak)")
metrics.declare("parallel_step_time_s", "s", "lower", "forward + backward + gradient reductions of the layout: per "
                "timed repeat its slowest rank, median over repeats (harness.parallel.timing)")
metrics.declare("parallel_single_step_s", "s", "none", "the same global batch's step on one rank of the launch")
metrics.declare("parallel_scaling_efficiency", "", "higher", "single-rank step / (world x the layout's step): 1 is "
                "perfect strong scaling")
metrics.declare("parallel_comm_time_s", "s", "lower", "time inside collectives in a profiled step, worst rank")
metrics.declare("parallel_exposed_comm_s", "s", "lower", "communication not overlapped by compute in a profiled "
                "step, worst rank (on the host an upper bound)")
metrics.declare("parallel_exposed_comm_share", "", "lower", "exposed communication / the profiled step's time")
metrics.declare("parallel_probe_busbw", "bytes/s", "higher", "bus bandwidth of a 1 MiB all-reduce over the launch's "
                "ranks")
metrics.declare("parallel_probe_latency_s", "s", "lower", "latency of a one-element all-reduce over the launch's "
                "ranks (the per-collective cost the plan's model charges)")
metrics.declare("parallel_step_collectives", "", "none", "collectives one rank issued in the training step "
                "(forward, backward, gradient reductions; pipeline send/recv not counted), most of any rank: beside "
                "the plan's count (detail timing, plan.comm_messages)")
metrics.declare("parallel_plan_step_s", "s", "none", "harness plan's step estimate for the layout on the pruned "
                "model, calibrated to this machine (FLOP/s from the single-rank step, the probes' bandwidth and "
                "latency)")
metrics.declare("parallel_plan_step_error", "", "none", "plan's estimate / the measured step - 1 (its error on this "
                "machine class; negative: the plan is optimistic)")
metrics.declare("recompute_peak_ratio", "", "lower", "peak memory with activation recomputation / without")
metrics.declare("recompute_grad_error", "", "lower", "gradients with recomputation vs without")
metrics.declare("tp_param_fraction", "", "lower", "per-rank parameter bytes / whole model's under tp "
                "(embeddings, norms and routers stay replicated)")
metrics.declare("fsdp_param_fraction", "", "lower", "per-rank parameter bytes / whole model's (~1/world)")
metrics.declare("fsdp_optimizer_fraction", "", "lower", "per-rank optimizer-state bytes / whole model's (~1/world)")
metrics.declare("zero_optimizer_fraction", "", "lower", "ZeRO-1/2: per-rank optimizer-state bytes / whole model's "
                "(~1/dp)")
metrics.declare("zero_grad_fraction", "", "lower", "ZeRO-1/2: per-rank gradient bytes after the reduction / whole "
                "model's (~1/dp for ZeRO-2, 1 for ZeRO-1)")
metrics.declare("ep_dropped_tokens", "", "lower", "(token, expert) pairs dropped at expert capacity, all ranks")
metrics.declare("ep_max_expert_load", "", "none", "most pairs one local expert received in one call")
for _k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
    metrics.declare(f"comm_{_k}_count", "", "none", f"{_k} collectives issued, all ranks")
    metrics.declare(f"comm_{_k}_bytes", "bytes", "lower", f"bytes given to {_k} collectives, all ranks")

# Tolerances on the scale-relative max error (docs/parallel.md, "Tolerances"): 8x the worst error
# measured over clean sweeps of every bundled suite's default matrix, rounded up to a power of 2;
# router logits 4x (it also sets the near-tie window of routing flips: headroom there is a window in
# which a wrong routing decision would pass as a tie).
DEFAULT_TOLERANCES = {
    "float32": {"logits": 2**-17, "loss": 2**-19, "grads": 2**-16, "weights": 2**-18, "logits_after": 2**-17,
                "activations": 2**-17, "router": 2**-18},
    "bfloat16": {"logits": 2**-4, "loss": 2**-10, "grads": 2**-2, "weights": 2**-3, "logits_after": 2**-2,
                 "activations": 2**-2, "router": 2**-4},
}
# Not measured by a bundled run: scaled by the unit roundoff (float64 2^-53 vs float32 2^-24;
# float16 2^-11 vs bfloat16 2^-8).
DEFAULT_TOLERANCES["float64"] = {k: v * 2**-29 for k, v in DEFAULT_TOLERANCES["float32"].items()}
DEFAULT_TOLERANCES["float16"] = {k: v * 2**-3 for k, v in DEFAULT_TOLERANCES["bfloat16"].items()}


class LayoutEntry(BaseModel):
    """One ``[[checks.parallel.configs]]`` entry: a degree per strategy; world size is the product."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `true` is no degree
    name: str | None = Field(None, description="Item variant name (default: from the degrees, e.g. ep2xtp2).")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (DTensor; transformers' tp plan or `tp_plan`).")
    pp: int = Field(1, ge=1, description="Pipeline stages (torch.distributed.pipelining, split at decoder layers); "
                    "with dp: each stage replicated over dp with DDP; with tp and/or fsdp: each stage's chunk "
                    "tensor-parallel and/or FSDP2-sharded (torchtitan's pp x fsdp x tp).")
    dp: int = Field(1, ge=1, description="Data-parallel degree (DDP; with fsdp: the replicas of HSDP; with tp or "
                    "ep: gradients summed explicitly).")
    ep: int = Field(1, ge=1, description="Expert-parallel degree (experts partitioned; all_to_all_single dispatch); "
                    "with fsdp: experts FSDP over the ranks holding the same partition, the rest over all "
                    "(torchtitan's dp_shard_in_ep).")
    fsdp: int = Field(1, ge=1, description="FSDP2 fully_shard degree (ZeRO-3); with dp: HSDP on the (replicate, "
                      "shard) mesh; with tp: FSDP2 over TP's DTensors (torchtitan's FSDP2 + TP).")
    cp: int = Field(1, ge=1, description="Context-parallel degree: each rank holds seq_len / cp tokens, K/V "
                    "all-gathered in attention; full-attention models only (no sliding window, linear attention "
                    "or sinks); with dp and/or tp.")
    recompute: bool = Field(False, description="Activation recomputation of every decoder layer (pipeline stages: "
                            "of the stage's layers); also checked "
                            "against the same layout without it (equal gradients, lower peak memory).")
    microbatches: int = Field(2, ge=1, description="Pipeline microbatches.")
    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"] = Field(
        "GPipe", description="Pipeline schedule (torch.distributed.pipelining name).")
    zero: Literal[0, 1, 2] = Field(0, description="ZeRO stage of the dp dimension (dp alone): 1 = DDP + "
                                   "ZeroRedundancyOptimizer (optimizer state sharded), 2 = FSDP2 with "
                                   "reshard_after_forward=False (gradients and optimizer state sharded); "
                                   "ZeRO-3 is fsdp. Named e.g. dp2-zero1.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        # the name becomes the ranks' result folder <run>/<name>/: a plain name (harness.files.paths)
        from harness.files.paths import problem

        why = problem(v) if v else None
        if why:
            raise ValueError(why)
        return v


class PlanRequest(BaseModel):
    """The cluster ``harness plan`` recommends a layout for; its shape is checked at pruned scale."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `true` is no degree
    devices: int = Field(..., ge=1, description="Devices per node.")
    device_memory: str = Field(..., description="Memory of one device, e.g. 141GiB.")
    nodes: int = Field(1, ge=1, description="Nodes.")
    mode: Literal["inference", "training"] = Field("inference", description="What the cluster runs.")
    batch: int = Field(1, ge=1, description="Sequences per step.")
    context: int = Field(4096, ge=1, description="Tokens per sequence.")


class ParallelConfig(CheckConfig):
    """Parallel layouts (TP, PP, DP, EP, FSDP, combinations) against the single-process reference."""

    scope: Literal["commit", "nightly"] = Field(
        "nightly", description="Nightly by default (each world size is one torchrun launch of several processes, "
        "~30-60 s on 2 CPU cores): `harness run --scope nightly`, or `scope = \"commit\"` in a suite.")
    configs: list[LayoutEntry] = Field(
        default_factory=list, description="The matrix ([[checks.parallel.configs]]). Empty: the default per "
        "architecture - dense: tp2, pp2, dp2, fsdp2-ac, tp2xdp2; MoE adds ep2, ep2xtp2. Opt-in 2-D layouts: "
        "tp x fsdp, dp x fsdp (HSDP), ep x dp, ep x fsdp, pp x dp, pp x tp, pp x fsdp; 3-D (max_world = 8) "
        "pp x fsdp x tp, dp x fsdp x tp, ep x dp x tp; ZeRO-1/2 (`zero` with dp).")
    batch_size: int = Field(4, ge=1, description="Sequences in the batch (split over data ranks and microbatches).")
    seq_len: int = Field(8, ge=2, description="Tokens per sequence.")
    seed: int = Field(0, description="Seed of the weights (the batch uses seed + 1).")
    memory_seq_len: int = Field(128, ge=2, description="Tokens per sequence of the recompute on/off memory "
                                "comparison (long enough for activations, not weights, to make the peak).")
    lr: float = Field(0.5, gt=0, description="SGD learning rate of the one optimizer step (momentum 0.9).")
    timeout_s: float = Field(180.0, gt=0, description="A layout that makes no progress for this long is a hang: "
                             "its launch is killed and the layouts after it relaunched.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Time for the ranks to start (imports, "
                                     "rendezvous) before the first layout; beyond it the launch is a hang.")
    max_world: int = Field(4, ge=1, description="Layouts needing more ranks are skipped (say why).")
    tp_plan: dict[str, str] = Field(default_factory=dict, description="Tensor-parallel plan (module pattern "
                                    "relative to the base model -> colwise | rowwise | "
                                    "replicated_with_grad_allreduce). Empty: transformers' base_model_tp_plan.")
    capacity_factor: float = Field(0.0, ge=0, description="EP expert capacity factor (0: dropless). Dropped "
                                   "tokens are recorded; with drops the layout cannot match the reference.")
    tolerances: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Per dtype, per quantity (logits, loss, grads, weights, logits_after, "
        "activations, router - router logits, also the near-tie window of routing flips) overrides of the measured "
        "defaults (scale-relative max error).")
    plan: PlanRequest | None = Field(None, description="Add a layout with the shape of the one `harness plan` "
                                     "recommends for this cluster (each strategy it uses at degree 2; ZeRO-3 as fsdp), "
                                     "named plan-<layout>.")
    timing_repeats: int = Field(5, ge=0, description="Timed repeats of each layout's step after its numerics "
                                "(step time, time inside collectives and exposed communication, scaling efficiency "
                                "against one rank, harness plan's estimate against the measurement); 0: off.")
    fsdp_slack: float = Field(1.5, ge=1, description="FSDP per-rank parameter/optimizer bytes may be up to "
                              "slack / world of the whole (padding of uneven shards).")


# --- shared between the items of one process --------------------------------------------------------

_REFS: dict = {}
_LAUNCHES: dict = {}
_TMP: list[Path] = []


def reset_launches() -> None:
    """Forget this process's launches, cancelling any still running (tests, sweeps)."""
    for run, _ in _LAUNCHES.values():
        run.cancel()
    _LAUNCHES.clear()


def _tmp_root() -> Path:
    """This process's folder of launches (removed at exit; a killed process's, by the next one)."""
    if not _TMP:
        _TMP.append(scratch.scratch_dir("harness-parallel-"))
    return _TMP[0]


def _facts(ls):
    from harness.anatomy.moe import num_experts
    from harness.models.build import model_config
    from harness.parallel.layouts import ArchFacts

    mc = model_config(ls)
    cfg = mc.config
    n = num_experts(cfg) or 0
    from harness.parallel.cp import attention_facts

    return ArchFacts(moe=n > 0, num_layers=int(cfg.num_hidden_layers), num_experts=n,
                     tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                     attention=attention_facts(cfg)), mc


def _seq_lens(cfg, lay) -> tuple[int, ...]:
    """Sequence lengths a layout runs (the recompute on/off memory batch too): cp splits each."""
    return (cfg.seq_len, cfg.memory_seq_len) if lay.recompute else (cfg.seq_len,)


_PLANS: dict = {}


def planned_layout(ls, req: PlanRequest):
    """The recommended layout of ``harness plan`` for ``req``, scaled to the pruned model: every
    strategy it uses at degree 2 (inference replicas dropped: they do not change the numbers)."""
    from harness.inspect.params import Target
    from harness.parallel.layouts import Layout
    from harness.parallel.plan import model_facts, parse_bytes, plan

    key = (str(ls.path), req.model_dump_json())
    if key not in _PLANS:
        rep = plan(model_facts(Target(ls.name, ls.raw_config, ls, ls.path), context=req.context),
                   devices_per_node=req.devices, nodes=req.nodes, device_memory=parse_bytes(req.device_memory),
                   mode=req.mode, batch=req.batch, context=req.context)
        best = rep.ranked[0] if rep.ranked and rep.ranked[0].fits else None
        lay = None
        if best is not None:
            b = best.layout
            train = req.mode == "training"
            deg = {k: 2 for k in ("tp", "pp", "ep", "cp") if getattr(b, k) > 1}
            if train and b.dp > 1:
                deg["fsdp" if b.zero >= 3 else "dp"] = 2
                if b.zero in (1, 2) and set(deg) == {"dp"}:
                    deg["zero"] = b.zero  # the check runs ZeRO-1/2 on dp alone (layouts.validate)
            lay = Layout(**deg, recompute=b.recompute)
            lay = Layout(**deg, recompute=b.recompute, name=f"plan-{lay.label}")
        _PLANS[key] = (lay, rep.recommendation)
    return _PLANS[key]


_FACTS: dict = {}


def plan_estimate(ls, lay, cfg: ParallelConfig, single_step_s: float, busbw: float,
                  latency_s: float | None = None) -> dict | None:
    """``harness plan``'s step model (harness.parallel.plan.estimate) for ``lay`` on the pruned model
    and the check's batch, calibrated to this machine: FLOP/s from the single-rank step (so the
    one-rank estimate is the measurement), the intra-node bandwidth and the per-collective latency
    from the launch's probes. What is left of the estimate's error is the model's: how it divides
    compute and which collectives it counts."""
    from harness.inspect.params import Target
    from harness.parallel.plan import MAX_DEVICE_MEMORY, estimate, model_facts
    from harness.parallel.plan import Layout as PlanLayout

    key = (str(ls.path), cfg.seq_len)
    if key not in _FACTS:
        try:
            _FACTS[key] = model_facts(Target(ls.name, ls.raw_config, ls, ls.path, pruned_only=True), context=cfg.seq_len)
        except Exception as e:  # the plan's model cannot read this architecture: say so, keep the timings
            _FACTS[key] = f"{type(e).__name__}: {e}"
    m = _FACTS[key]
    if isinstance(m, str) or not m.flops_per_token or single_step_s <= 0 or busbw <= 0:
        return None
    flops = m.flops_per_token * cfg.batch_size * cfg.seq_len * 3  # forward + backward (2x)
    pl = PlanLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp * lay.fsdp, ep=lay.ep, cp=lay.cp,
                    zero=3 if lay.fsdp > 1 else lay.zero, recompute=lay.recompute)
    lat = {} if latency_s is None else {"intra_latency": latency_s}
    e = estimate(m, pl, mode="training", batch=cfg.batch_size, context=cfg.seq_len, device_memory=MAX_DEVICE_MEMORY,
                 devices_per_node=lay.world, device_flops=flops / single_step_s, intra_bw=busbw, **lat)
    return {"step_s": e.step_time_s, "compute_s": e.compute_time_s, "comm_s": e.comm_time_s,
            "comm_latency_s": e.comm_latency_s, "comm_messages": e.comm_messages, "comm_bytes": e.comm_bytes,
            "device_flops": flops / single_step_s, "busbw": busbw, "latency_s": latency_s}


def layouts_of(ls, cfg: ParallelConfig):
    from harness.parallel.layouts import Layout, default_layouts

    facts, _ = _facts(ls)
    if not cfg.configs:
        out = default_layouts(facts)
    else:
        out = [Layout(**e.model_dump(exclude={"name"}), name=e.name or "") for e in cfg.configs]
    if cfg.plan is not None:
        lay, _ = planned_layout(ls, cfg.plan)
        if lay is not None and lay.label not in {x.label for x in out}:
            out.append(lay)
    return out


def tolerances(cfg: ParallelConfig, dtype: str) -> dict[str, float]:
    tol = dict(DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float32"]))
    tol.update(cfg.tolerances.get(dtype, {}))
    return tol


def _layout_verdict(ctx: CheckContext, st, lay, tol: dict) -> tuple:
    """The layout's ranks against the reference (routing replayed where it flipped, float64 where
    stored): (verdict, each rank's meta, routing)."""
    from harness.parallel.compare import compare_layout, load_ranks

    ranks = load_ranks(st.outcome.dir, lay.world)
    ref, routing = _routed_reference(ctx, st, lay, ranks, tol)
    v = compare_layout(ref, st.order, st.ids, lay, ranks, tol)
    _apply_routing(v, routing, st.order)
    _compare_float64(v, st.ref64 if ref is st.ref else None, ranks, ctx.dtype, st.order)
    # The verdict is kept (st.verdicts), so the layout's tensors are not read again: free them now.
    # Kept until the process ends they added up (GBs over the test suite's launches, a full disk
    # on a shared runner); the small rank records and logs stay for the launch's other items.
    for r in range(lay.world):
        (st.outcome.dir / f"rank{r}.safetensors").unlink(missing_ok=True)
    return v, [rd.meta for rd in ranks], routing


def _record_errors(ctx: CheckContext, v, tol: dict) -> None:
    """Each compared quantity's error, with its tolerance."""
    for name in ("parallel_grad_error_f64", "parallel_f64_budget_use"):
        if name in v.metrics:
            ctx.metric(name, v.metrics[name])
    for q, name in (("logits", "parallel_logits_error"), ("loss", "parallel_loss_error"),
                    ("grads", "parallel_grad_error"), ("weights", "parallel_weight_error"),
                    ("logits_after", "parallel_logits_after_error"),
                    ("activations", "parallel_activation_error"), ("router", "parallel_router_error")):
        if q in v.errors:
            ctx.metric(name, v.errors[q])
            ctx.tolerance(name, tol[q])


def _record_ranks(ctx: CheckContext, lay, metas: list[dict]) -> None:
    """What the ranks report: time, devices, communication, peak memory, expert-parallel load."""
    ctx.metric("parallel_layout_time_s", max(m.get("wall_s", 0.0) for m in metas))
    # where each rank ran, in rank order (cpu for every rank on the CPU backend; hdev:0,hdev:1 ...)
    ctx.detail("rank_devices", ",".join(m.get("device", "?") for m in sorted(metas, key=lambda m: m["rank"])))
    for kind in sorted({k for m in metas for k in (m.get("comm") or {})}):
        ctx.metric(f"comm_{kind}_count", sum(m["comm"].get(kind, {}).get("count", 0) for m in metas))
        ctx.metric(f"comm_{kind}_bytes", sum(m["comm"].get(kind, {}).get("bytes", 0) for m in metas))
    ctx.metric("parallel_peak_bytes", max(m.get("peak_bytes", 0) for m in metas))
    if lay.ep > 1:
        ctx.metric("ep_dropped_tokens", sum((m.get("ep") or {}).get("dropped", 0) for m in metas))
        ctx.metric("ep_max_expert_load", max((m.get("ep") or {}).get("max_expert_load", 0) for m in metas))


def _record_where(ctx: CheckContext, v) -> None:
    """Where the layout diverges first: module, ranks, worst gradient and weight."""
    if v.first_module:
        ctx.detail("first_diverging_module", v.first_module)
        ctx.detail("first_diverging_ranks", ",".join(map(str, v.first_module_ranks)))
    if v.worst_grad and v.worst_grad[0]:
        ctx.detail("worst_gradient", v.worst_grad[0])
    if v.worst_weight and v.worst_weight[2]:
        ctx.detail("worst_weight", v.worst_weight[0])


class ParallelCheck(Check):
    name = "parallel"
    order = 50
    config_model = ParallelConfig
    description = "parallel layouts (TP, PP, DP, EP, FSDP, CP) against the single-process reference"
    headline = ("parallel_grad_error", "parallel_launch_time_s")
    steps = ("layout", "reference", "launch", "compare", "timing", "memory")
    setup_steps = ("layout", "reference")

    def variants(self, suite, backend):
        return [lay.label for lay in layouts_of(suite, self.config(suite))]

    def layout(self, ctx: CheckContext, st) -> None:
        from harness.inspect.flops import head_dims
        from harness.parallel.layouts import validate

        st.cfg = cfg = ctx.config
        lays = {lay.label: lay for lay in layouts_of(ctx.suite, cfg)}
        st.layout = lays[ctx.variant] if ctx.variant in lays else next(iter(lays.values()))
        facts, mc = _facts(ctx.suite)
        heads, kv, _, _ = head_dims(mc.config)
        st.facts, st.mc = facts, mc
        why = validate(st.layout, facts, heads=heads, kv_heads=kv, batch_size=cfg.batch_size,
                       seq_lens=_seq_lens(cfg, st.layout))
        if st.layout.world > cfg.max_world:
            why = f"needs {st.layout.world} ranks; max_world is {cfg.max_world}"
        if ctx.backend.device_type != "cpu" and ctx.backend.device_count() < st.layout.world:
            why = f"needs {st.layout.world} devices, {ctx.backend.device_count()} present"
        if why:
            raise NotApplicable(f"layout {st.layout.label}: {why}")
        # Every valid layout of the same world size shares one launch.
        st.peers = [lay for lay in lays.values() if lay.world == st.layout.world and lay.world <= cfg.max_world
                    and validate(lay, facts, heads=heads, kv_heads=kv, batch_size=cfg.batch_size,
                                 seq_lens=_seq_lens(cfg, lay)) is None]
        ctx.metric("parallel_world_size", st.layout.world)
        if st.layout.label.startswith("plan-") and cfg.plan is not None:
            ctx.notes.append("harness plan recommends " + planned_layout(ctx.suite, cfg.plan)[1])
        ctx.detail("layout", json.dumps(st.layout.to_dict(), sort_keys=True))

    def reference(self, ctx: CheckContext, st) -> None:
        """The single-process step in the run dtype on the CPU, and the same step in float64 (its
        routers following the dtype run's choices), with the dtype run's own error against it: the
        budget of the float64 comparison (``compare``)."""
        from harness.models.build import build_model
        from harness.parallel.reference import batch, run_reference

        cfg = st.cfg
        key = (str(ctx.suite.path), ctx.dtype, cfg.seed, cfg.batch_size, cfg.seq_len, cfg.lr)
        if key not in _REFS:
            with torch.random.fork_rng(devices=[]):
                model, _ = build_model(ctx.suite, ctx.dtype, "cpu", seed=cfg.seed, mc=st.mc)
                ids = batch(st.mc.config.vocab_size, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
                ref, order = run_reference(model, ids, cfg.lr)
            _REFS[key] = (ref, order, ids, _float64_reference(ctx, st, ref, ids))
        st.ref, st.order, st.ids, st.ref64 = _REFS[key]

    def launch(self, ctx: CheckContext, st) -> None:
        from harness.parallel.launcher import BackgroundLaunch

        cfg = st.cfg
        # The backend's device type and vendor module travel to the ranks (each imports the module,
        # takes device rank % count of that type and inits its mesh on it), with its collective.
        spec = {"suite": str(ctx.suite.path), "collective": ctx.backend.collective, "dtype": ctx.dtype,
                "device_type": ctx.backend.device_type, "module": ctx.backend.module,
                "seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "lr": cfg.lr,
                "memory_seq_len": cfg.memory_seq_len,
                "pg_timeout_s": max(600.0, 2 * cfg.timeout_s), "capacity_factor": cfg.capacity_factor,
                "tp_plan": cfg.tp_plan, "fault": getattr(st, "fault", None), "timing_repeats": cfg.timing_repeats}
        peers = [lay.to_dict() for lay in st.peers]
        key = hashlib.sha256(json.dumps([spec, peers, ctx.backend.name], sort_keys=True).encode()).hexdigest()[:16]
        if key not in _LAUNCHES:
            # A fresh folder per launch: the launcher counts a layout whose rank files exist as done, so
            # a second launch of the same spec in this process (after reset_launches: a rerun) must
            # not find the first one's files.
            root = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=_tmp_root()))
            # Start-up (interpreters, imports, rendezvous) is not a layout's progress: on a loaded
            # machine it alone can take minutes, so it gets its own, longer limit. The launch runs in
            # the background: this item waits for its own layout only, so the first item of a world
            # size is not charged (nor timed out) for the whole matrix (docs/parallel.md).
            run = BackgroundLaunch(spec, st.peers, st.layout.world, root, timeout_s=cfg.timeout_s,
                                   startup_s=max(cfg.timeout_s, cfg.startup_timeout_s))
            _LAUNCHES[key] = (run, {})
        st.report, st.verdicts = _LAUNCHES[key]
        out = st.report.wait(st.layout.label)
        st.outcome = out
        ctx.metric("parallel_launch_time_s", out.launch_wall_s)
        ctx.metric("parallel_launch_layouts", len(st.peers))
        if out.placement:  # a multi-node launch: which node each rank ran on (harness.launch.nodes)
            ctx.metric("parallel_nodes", len({p.split(" (")[0] for p in out.placement.values()}))
            ctx.detail("placement", "; ".join(f"rank {r}: {p}" for r, p in sorted(out.placement.items())))
        ctx.notes.extend(out.warnings)
        if out.status == "not_run":  # the launch failed the same way twice: no verdict on this layout
            raise CouldNotRun(out.message, step="launch")
        if out.status != "ok":
            raise CheckFailure(out.message, metric="parallel_status", expected="ok", observed=out.status,
                               details=_logs(out.dir))

    def compare(self, ctx: CheckContext, st) -> None:
        from harness.parallel.compare import describe

        lay, tol = st.layout, tolerances(st.cfg, ctx.dtype)
        if lay.label not in st.verdicts:
            st.verdicts[lay.label] = _layout_verdict(ctx, st, lay, tol)
        v, metas, routing = st.verdicts[lay.label]
        st.verdict, st.metas = v, metas
        if routing is not None:
            ctx.metric("routing_flips_near_tie", routing.judgement.near_tie if routing.judgement else 0)
            if routing.detail:
                ctx.detail("routing", routing.detail)
            ctx.notes.extend(routing.notes)
        _record_errors(ctx, v, tol)
        _record_ranks(ctx, lay, metas)
        for n in sorted({n for m in metas for n in m.get("notes", [])}) + v.notes:
            ctx.notes.append(n)
        _record_where(ctx, v)
        if not v.ok:
            raise CheckFailure(describe(v, lay), metric="parallel_grad_error", expected=f"<= {tol['grads']:.3g}",
                               observed=f"{v.errors.get('grads', float('nan')):.3g}", tolerance=tol)

    def timing(self, ctx: CheckContext, st) -> None:
        """Step time, communication and its exposed part, scaling efficiency against one rank, and
        harness plan's estimate of the step against it (harness.parallel.timing; informational: the
        comparator decides on them against the history)."""
        from harness.parallel.timing import summarize

        recs = [m["timing"] for m in st.metas if m.get("timing")]
        if len(recs) < st.layout.world:
            return  # timing_repeats = 0
        t = summarize(recs)
        ctx.metric("parallel_step_time_s", t["step_s"])
        ctx.metric("parallel_comm_time_s", t["comm_s"])
        ctx.metric("parallel_exposed_comm_s", t["exposed_s"])
        ctx.metric("parallel_exposed_comm_share", t["exposed_s"] / t["profiled_wall_s"] if t["profiled_wall_s"] else 0.0)
        shown = {k: t[k] for k in ("step_s", "comm_s", "exposed_s", "profiled_wall_s", "measured_on")}
        shown["repeats"] = len(t["steps_s"])
        if "single_step_s" in t:
            ctx.metric("parallel_single_step_s", t["single_step_s"])
            ctx.metric("parallel_scaling_efficiency", t["single_step_s"] / (st.layout.world * t["step_s"]))
            shown["single_step_s"] = t["single_step_s"]
        if "probe_busbw" in t:
            ctx.metric("parallel_probe_busbw", t["probe_busbw"])
        if "probe_latency_s" in t:
            ctx.metric("parallel_probe_latency_s", t["probe_latency_s"])
        if "single_step_s" in t and "probe_busbw" in t:
            est = plan_estimate(ctx.suite, st.layout, st.cfg, t["single_step_s"], t["probe_busbw"],
                                t.get("probe_latency_s"))
            if est is not None:
                counted = [m["step_collectives"] for m in st.metas if m.get("step_collectives") is not None]
                if counted:
                    est["collectives_counted"] = max(counted)
                    ctx.metric("parallel_step_collectives", max(counted))
                ctx.metric("parallel_plan_step_s", est["step_s"])
                ctx.metric("parallel_plan_step_error", est["step_s"] / t["step_s"] - 1)
                shown["plan"] = est
        ctx.detail("timing", json.dumps(shown, sort_keys=True))

    def memory(self, ctx: CheckContext, st) -> None:
        lay, v, metas, cfg = st.layout, st.verdict, st.metas, st.cfg
        if lay.recompute:
            on = max(m.get("peak_bytes_recompute_on", 0) for m in metas)
            off = max(m.get("peak_bytes_recompute_off", 0) for m in metas)
            ratio = ctx.metric("recompute_peak_ratio", on / off if off else float("nan"))
            ctx.metric("recompute_grad_error", v.recompute_grad_error or 0.0)
            if not on < off:
                raise CheckFailure("activation recomputation did not lower the measured peak memory",
                                   metric="recompute_peak_ratio", expected="< 1", observed=f"{ratio:.3g}")
        if lay.tp > 1:
            ctx.metric("tp_param_fraction", max(m["param_bytes_local"] / m["param_bytes_full"] for m in metas))
        if lay.fsdp > 1:
            pf = ctx.metric("fsdp_param_fraction", max(m["param_bytes_local"] / m["param_bytes_full"] for m in metas))
            of = ctx.metric("fsdp_optimizer_fraction",
                            max(m["optimizer_bytes_local"] / m["param_bytes_full"] for m in metas))
            limit = cfg.fsdp_slack / lay.fsdp
            ctx.tolerance("fsdp_param_fraction", limit)
            for name, val in (("fsdp_param_fraction", pf), ("fsdp_optimizer_fraction", of)):
                if val > limit:
                    raise CheckFailure(f"FSDP keeps {val:.3f} of the whole model's {name.split('_')[1]} bytes per "
                                       f"rank; expected about 1/{lay.fsdp}", metric=name,
                                       expected=f"<= {limit:.3f}", observed=f"{val:.3f}")
        if lay.zero:
            # SGD with momentum keeps one buffer per parameter: unsharded it would be 1 x the model.
            of = ctx.metric("zero_optimizer_fraction",
                            max(m["optimizer_bytes_local"] / m["param_bytes_full"] for m in metas))
            ctx.metric("zero_grad_fraction", max(m["grad_bytes_local"] / m["param_bytes_full"] for m in metas))
            limit = cfg.fsdp_slack / lay.dp
            ctx.tolerance("zero_optimizer_fraction", limit)
            if of > limit:
                raise CheckFailure(f"ZeRO-{lay.zero} keeps {of:.3f} of the whole model's optimizer-state bytes per "
                                   f"rank; expected about 1/{lay.dp}", metric="zero_optimizer_fraction",
                                   expected=f"<= {limit:.3f}", observed=f"{of:.3f}")


# The float64 comparison (#25): a layout's gradients and weights after the step against the float64
# reference, each held to F64_K x the single-process dtype run's own error against float64 + a floor.
# The single-process run is on the CPU (the reference backend), so a backend whose kernels are wrong
# everywhere cannot pass by agreeing with itself: the same-dtype comparison's tolerances (8x the worst
# clean layout error, bf16 grads 2^-2) are wide enough to hide a 5% backward fault, this one is
# per parameter and measured. F64_K and the floors: docs/parallel.md, "Against float64".
F64_K = 2.0
F64_FLOORS = {"float32": 2.0 ** -20, "bfloat16": 2.0 ** -6, "float16": 2.0 ** -9, "float64": 1e-12}


def _float64_reference(ctx: CheckContext, st, ref: dict, ids: torch.Tensor) -> dict | None:
    """{"grad/<p>", "weight/<p>": (float64 value, the dtype run's error against it)}; None in float64.
    The float64 model's routers are forced to the dtype run's choices: a near-tie flip between the two
    would send gradient to other experts and say nothing about the layout."""
    from harness.models.build import build_model
    from harness.parallel.compare import rel_err
    from harness.parallel.reference import run_reference
    from harness.precision.routing import PHASES, ForcedRouting

    if ctx.dtype == "float64":
        return None
    force = {ph: {k.split("/", 2)[2]: v for k, v in ref.items() if k.startswith(f"route/{ph}/")} for ph in PHASES}
    forced = ForcedRouting(force) if any(force.values()) else None
    with torch.random.fork_rng(devices=[]):
        model, _ = build_model(ctx.suite, "float64", "cpu", seed=st.cfg.seed, mc=st.mc)
        ref64, _ = run_reference(model, ids, st.cfg.lr, forced)
    del model
    if forced is not None and forced.unforced:
        ctx.notes.append("float64 comparison off: router(s) " + ", ".join(sorted(set(forced.unforced)))
                         + " could not follow the dtype run's choices")
        return None
    return {k: (ref64[k], rel_err(ref[k], ref64[k])) for k in ref64 if k.startswith(("grad/", "weight/")) and k in ref}


def _compare_float64(v, ref64: dict | None, ranks, dtype: str, order: list[str]) -> None:
    """Every rank's full-shape gradient and weight against the float64 reference, under F64_K x the
    single-process run's own error + the floor. The gradient over it met first walking backward leads
    (``order``: the modules in forward order; a wrong backward kernel's own gradient, every one upstream
    inheriting its error, is where it is met first), then the worst. Skipped (with a note) where the
    reference was rerun with the layout's near-tie routing (its float64 twin was not)."""
    from harness.compiler.gradients import owner
    from harness.parallel.compare import rel_err

    if ref64 is None:
        v.notes.append("float64 comparison not made: " + ("float64 run" if dtype == "float64" else
                                                          "the layout routed near ties otherwise"))
        return
    floor = F64_FLOORS.get(dtype, F64_FLOORS["float32"])
    rows, worst_grad = [], 0.0  # (key, use, error, budget, ranks over)
    for key, (r64, clean) in ref64.items():
        errs = {rd.rank: rel_err(rd.tensors[key], r64) for rd in ranks if key in rd.tensors}
        if not errs:
            continue
        e, budget = max(errs.values()), F64_K * clean + floor
        if key.startswith("grad/"):
            worst_grad = max(worst_grad, e)
        rows.append((key, e / budget, e, budget, sorted(r for r, x in errs.items() if x > budget)))
    worst = max(rows, key=lambda r: r[1], default=("", 0.0, 0.0, 0.0, []))
    v.metrics["parallel_grad_error_f64"] = worst_grad
    v.metrics["parallel_f64_budget_use"] = worst[1]
    if worst[1] <= 1:
        return
    over = [r for r in rows if r[1] > 1 and r[0].startswith("grad/")]
    first = max(over, key=lambda r: owner(r[0].partition("/")[2], order), default=worst)
    said = lambda r: (f"{r[0].partition('/')[2]} (error {r[2]:.3g} > budget {r[3]:.3g} = {F64_K:g} x the "  # noqa: E731
                      f"single-process {dtype} run's own {ref64[r[0]][1]:.3g} + {floor:.3g}) on rank(s) {r[4]}")
    kind = first[0].partition("/")[0]
    lead = (f"first over budget walking backward {said(first)}; worst {said(worst)}" if first is not worst
            else f"worst {said(worst)}")
    v.failed.append(f"{kind}s differ from the float64 reference: {lead}: {_f64_cause(v, kind, dtype)}")


def _f64_cause(v, kind: str, dtype: str) -> str:
    """What the float64 comparison's failure points at, from what else was measured: a forward that
    diverged; gradients that also differ from the single-process run in the same dtype while the forward
    agrees (only the reduction lies between them: the fault of a dp/fsdp gradient); else the kernels."""
    if v.first_module:
        return f"downstream of the forward's divergence at {v.first_module}"
    if any(f.startswith("grads differ:") for f in v.failed):
        return (f"the layout's gradient reduction: every forward output agrees and the reduced gradients differ "
                f"from the single-process {dtype} run's too")
    if kind == "weight" and any(f.startswith("weights differ:") for f in v.failed):
        return "the optimizer step or its parameter broadcast (the gradients agree)"
    return "the layout's kernels, not its reduction order"


class _Routing:
    """What the routing-aware comparison found for one layout (harness.precision.routing)."""

    def __init__(self):
        self.judgement = None
        self.notes: list[str] = []
        self.detail = ""


def _routed_reference(ctx: CheckContext, st, lay, ranks, tol):
    """(reference to compare with, _Routing or None for a model without routers). Where the layout's
    routers chose other experts than the reference's for some tokens, the reference step is rerun
    with the layout's choices and each flip judged at its router (docs/parallel.md, "Routing-aware
    MoE"); with only near-tie flips everything is compared with that rerun."""
    from harness.models.build import build_model
    from harness.parallel.reference import run_reference
    from harness.precision.routing import ForcedRouting, judge, layout_routing, router_limits, same_sets

    routers = sorted({k.split("/", 2)[2] for k in st.ref if k.startswith("route/")})
    if not routers:
        return st.ref, None
    r = _Routing()
    routes, own, r.notes = layout_routing(ranks, lay, routers)
    missing = sorted({g for g in routers for p in routes if g not in routes[p] and f"route/{p}/{g}" in st.ref})
    if missing:
        r.notes.append(f"no routing captured on any rank for {', '.join(missing)}: compared as is")
    ref_rows = {key: st.ref[f"route/{key[0]}/{key[1]}"] for key in own}
    differs = [key for key, by in own.items() for rows, t in by.values() if not same_sets(t, ref_rows[key][rows])]
    if not differs:
        r.detail = "every router chose the reference's experts for every token"
        return st.ref, r
    cfg = st.cfg
    forced = ForcedRouting(routes)
    with torch.random.fork_rng(devices=[]):
        model, _ = build_model(ctx.suite, ctx.dtype, "cpu", seed=cfg.seed, mc=st.mc)
        rerun, _ = run_reference(model, st.ids, cfg.lr, forced)
    if forced.unforced:
        r.notes.append("the reference could not be rerun with the layout's routing (router(s) "
                       f"{', '.join(sorted(set(forced.unforced)))} do not pick experts by one top-k); compared as is")
        return st.ref, r
    j = r.judgement = judge(forced, own, st.order, router_limits(forced, tol["router"]))
    where = ", ".join(f"{g} {n}" for g, n in j.per_router.items() if n)
    if j.wide:
        r.detail = (f"{len(j.wide)} router(s) chose other experts at a wide margin; compared with the "
                    "reference's own routing")
        return st.ref, r
    r.detail = (f"{j.near_tie} token(s) chose other experts at a near tie ({where}); everything, every expert's "
                "gradient included, compared with the single-process reference rerun with the layout's routing")
    return rerun, r


def _apply_routing(v, routing, order: list[str]) -> None:
    """A flip at a wide margin fails the layout, and is where the divergence starts unless a module
    before the router already diverged (then the router only saw other inputs: a pipeline stage
    that reordered its microbatches routes every token "wrongly")."""
    if routing is None or routing.judgement is None or not routing.judgement.wide:
        return
    j = routing.judgement
    pos = {n: i for i, n in enumerate(order)}
    if j.first_wide is not None and (v.first_module is None
                                     or pos.get(j.first_wide, len(order)) < pos.get(v.first_module, len(order))):
        v.first_module, v.first_module_ranks = j.first_wide, j.wide_ranks
        v.first_module_error = float("nan")
    # The flips lead the symptoms where a router is the root cause; after a module before it diverged
    # (or with the weights only: flips in the forward after the step) they are its consequences.
    if v.first_module == j.first_wide:
        v.failed[:0] = j.wide
    else:
        v.failed.extend(j.wide)


_BACKTRACE = re.compile(r"frame #\d+: |<omitting python frames>|Exception raised from ")


def _logs(d: Path | None) -> str | None:
    """The tail of the launch's rank logs, for the failure report."""
    if d is None:
        return None
    run_dir = d.parent
    out = []
    for p in sorted(run_dir.glob("rank*.log")) + sorted(run_dir.glob("torchrun*.log")):
        # a C++ backtrace's frames say nothing a reader can act on; the line above them does
        tail = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip() and not _BACKTRACE.match(ln)][-6:]
        if tail:
            out.append(f"--- {p.name}\n" + "\n".join(tail))
    return "\n".join(out) or None


def register(registry: CheckRegistry) -> None:
    registry.add(ParallelCheck())
