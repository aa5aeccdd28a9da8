"""One rank of a parallel launch: every layout of the launch, one after another.

Per layout, ``RankRun.step`` is torchtitan's sequence, one named step each:

    build -> parallelize (split_stage -> apply_tp -> apply_ep -> apply_cp -> apply_ac -> apply_fsdp
    -> apply_dp | pipeline_stage) -> start_captures -> forward_backward -> sync_gradients ->
    gather_params(grad) -> optimizer_step -> gather_params(weight) -> forward_after_step ->
    collect_results

i.e. the seeded model (identical on every rank), the layout applied, the step of
``harness.parallel.reference`` on this rank's slice of the batch, every gradient and weight
gathered to full shape; ``run`` writes the results (``<layout>/rank<r>.safetensors`` + ``.json``)
*before* the next layout and before teardown: a process that aborts while tearing down DTensor
state after it reported is told apart from a failure by those files.

A layout that raises on a rank writes the error and ends the rank at once (the others would
otherwise wait in a collective until the time limit); the launcher relaunches the layouts left.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness.launch.status import status_path
from harness.parallel import cp as cp_mod
from harness.parallel import ep as ep_mod
from harness.parallel.apply import (
    _PassLayer,
    apply_ac,
    apply_dp,
    apply_ep,
    apply_fsdp,
    apply_tp,
    pipeline_stage,
    split_stage,
    sync_grads,
    tp_plan_of,
    zero1_optimizer,
)
from harness.parallel.comm import CommCounter
from harness.parallel.layouts import DATA_DIMS, Layout
from harness.parallel.memory import StoragePeak
from harness.parallel.reference import ModuleCapture, batch, clean_name, lm_loss, make_optimizer
from harness.parallel.status import StatusWriter
from harness.parallel.timing import probe_busbw, probe_latency, profile_step, time_steps
from harness.parallel.tp_experts import fused_experts_in_plan, gather_full, shard_fused_experts
from harness.precision.routing import RouterCapture


def _write_json(path: str, obj) -> None:
    from harness.files import atomic

    atomic.write_json(path, obj, indent=None, newline=False)


def _subgroups(mesh, lay: Layout) -> dict:
    """Process groups per strategy, plus the data group (the ranks that split the batch)."""
    names = mesh.mesh_dim_names
    groups = {d: mesh.get_group(d) for d in names}
    data = [d for d in DATA_DIMS if d in names]
    if len(data) == 1:
        groups["data"] = groups[data[0]]
    elif data:
        groups["data"] = mesh[tuple(data)]._flatten().get_group()
    if "cp" in names:
        # Parameters are replicated over cp: their gradients are summed over the data ranks and cp.
        dc = (*data, "cp")
        groups["data_cp"] = groups["cp"] if len(dc) == 1 else mesh[dc]._flatten().get_group()
    return groups


@dataclass
class _Step:
    """Everything one layout's step on this rank holds, from the build to its results."""

    lay: Layout
    model: torch.nn.Module  # the whole model (under pp: with only this stage's layers)
    mesh: DeviceMesh
    groups: dict  # process group per mesh dimension, plus "data" (and "data_cp"): see _subgroups
    counter: CommCounter  # every collective's count and bytes (the comm_* metrics)
    res: dict  # what rank<r>.json gets
    ids: torch.Tensor  # [b, S]: this rank's data slice of the batch ([b, S / cp] under cp)
    full_ids: torch.Tensor  # [b, S]: the cp loss's targets (the whole sequences)
    fwd: dict  # extra forward arguments: cp's position_ids [1, S / cp]
    cp_index: int
    full_bytes: int  # the unsharded model's parameter bytes
    part: torch.nn.Module | None = None  # what tp and fsdp shard: the pipeline stage, else the model
    wrapped: torch.nn.Module | None = None  # what runs: DDP, the pipeline's stage module or the model
    stage: object = None  # PipelineStage and its schedule (pp only)
    sched: object = None
    tp_norms: list[str] = field(default_factory=list)  # replicated_with_grad_allreduce modules
    tp_split: dict[str, tuple[int, bool]] = field(default_factory=dict)  # fused experts over tp
    ep_names: list[str] = field(default_factory=list)  # experts modules partitioned over ep
    manual_sync: bool = False  # data gradients summed by sync_gradients (not DDP / FSDP / pipeline)
    cap: ModuleCapture | None = None
    rcap: RouterCapture | None = None
    logits: torch.Tensor | None = None  # [b, S, V] (None on a pipeline stage other than the last)
    loss: torch.Tensor | None = None
    params: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)  # trainable, clean names
    out: dict[str, torch.Tensor] = field(default_factory=dict)  # what rank<r>.safetensors gets


def rank_device(spec: dict, rank: int) -> torch.device:
    """This rank's device: the backend's vendor module imported first (it renames PrivateUse1 and
    registers ``torch.<device_type>``, as ``Backend`` does before any device probe), then device index
    ``rank % device_count`` of ``spec["device_type"]`` (the local rank under a multi-node launch),
    made current, its generator seeded with the spec's seed (the same on every rank). The spec's
    device *type* (``hdev``), never the backend's name (``testdev``): ``torch.device`` knows only
    the former."""
    module, device_type = spec.get("module"), spec.get("device_type", "cpu")
    if module:
        importlib.import_module(module)
    if device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, device_type, None)
    if mod is None or not hasattr(mod, "device_count"):
        raise RuntimeError(f"torch has no '{device_type}' device module" + (f" after importing {module}" if module
                                                                             else " (no vendor module in the spec)"))
    index = rank % max(int(mod.device_count()), 1)
    if hasattr(mod, "set_device"):
        mod.set_device(index)
    if hasattr(mod, "manual_seed"):
        mod.manual_seed(int(spec["seed"]))
    return torch.device(device_type, index)


class RankRun:
    def __init__(self, spec: dict, rank: int, world: int, status: StatusWriter,
                 device: torch.device | None = None):
        self.spec, self.rank, self.world, self.status = spec, rank, world, status
        self.device = device or torch.device("cpu")
        from harness.models.build import build_model, model_config
        from harness.suite.loader import load_suite

        self.ls = load_suite(spec["suite"])
        self.mc = model_config(self.ls)
        self.build_model = build_model
        self.ids = batch(self.mc.config.vocab_size, spec["batch_size"], spec["seq_len"], spec["seed"] + 1)
        self.timing_repeats = int(spec.get("timing_repeats") or 0)  # 0: numerics only
        self._launch_timing: dict | None = None
        fault = spec.get("fault")
        self.fault = None
        if fault:
            mod, _, fn = fault.partition(":")
            self.fault = getattr(importlib.import_module(mod), fn)
        # Last module entered, for the hang report (names set per layout in _name_modules).
        torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, _a: self.status.module(getattr(m, "_harness_qualname", "")) if hasattr(
                m, "_harness_qualname") else None)

    # --- one layout ---------------------------------------------------------------------------
    def run(self, index: int, lay: Layout, out_dir: str) -> None:
        self.status.layout(index, lay.label)
        if self.timing_repeats and self._launch_timing is None:
            self._launch_timing = self.launch_timing()
        t0 = time.perf_counter()
        res, tensors = self.step(lay, recompute=lay.recompute, capture=True, ids=self.ids)
        if lay.recompute:
            self._recompute_memory(lay, res, tensors)
        res["wall_s"] = time.perf_counter() - t0
        self.status.step("write")
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, f"rank{self.rank}.safetensors"))
        _write_json(os.path.join(out_dir, f"rank{self.rank}.json"), res)
        self.status.step("done")

    def _recompute_memory(self, lay: Layout, res: dict, tensors: dict) -> None:
        """Recomputation on vs off on a longer batch, where activations (not the tiny model's
        weights) make the peak: equal gradients, lower peak with it on."""
        long_ids = batch(self.mc.config.vocab_size, self.spec["batch_size"], self.spec["memory_seq_len"],
                         self.spec["seed"] + 2)
        self.status.step("recompute_on")
        res1, t1s = self.step(lay, recompute=True, capture=False, ids=long_ids, light=True)
        self.status.step("recompute_off")
        res0, t0s = self.step(lay, recompute=False, capture=False, ids=long_ids, light=True)
        res["peak_bytes_recompute_on"] = res1["peak_bytes"]
        res["peak_bytes_recompute_off"] = res0["peak_bytes"]
        for k, v in t0s.items():
            if k.startswith("grad/") and k in t1s:
                tensors["noac_" + k] = v
                tensors["ac_" + k] = t1s[k]

    def step(self, lay: Layout, recompute: bool, capture: bool, ids: torch.Tensor,
             light: bool = False) -> tuple[dict, dict]:
        """One step of ``lay`` on this rank (reference.py's step): (its json, its tensors at full
        shape). ``light`` (the recomputation memory runs): no capture, no fault, ends after the
        gradients."""
        st = self.status
        s = self._build(lay, ids)
        st.step("apply")
        parallelize(s, self.spec, self.mc.config, recompute)
        _name_modules(s.wrapped)
        if self.fault is not None and not light:
            self.fault(SimpleNamespace(layout=lay, rank=self.rank, world=self.world, model=s.model, wrapped=s.wrapped,
                                       stage=s.stage, schedule=s.sched, mesh=s.mesh, groups=s.groups))
        if capture:
            start_captures(s)
        ep_mod.STATS.__init__()
        mt = _memory_tracker(s)
        st.step("forward")
        # The memory peak (peak_bytes) is of forward, backward and the gradient reductions.
        with s.counter, mt:
            forward_backward(s, st, recompute)
            st.step("grad_sync")
            sync_gradients(s)
        # collectives of the training step alone (the gathers and the optimizer below are counted
        # after it): what the plan's alpha-beta model counts, to calibrate it
        s.res["step_collectives"] = sum(s.counter.counts.values())
        s.res["peak_bytes"] = int(_peak(mt))
        keep_loss(s)
        st.step("gather_grads")
        gather_params(s, "grad")
        if not light:
            st.step("optimizer")
            optimizer_step(s, self.spec["lr"])
            st.step("gather_weights")
            gather_params(s, "weight")
            st.step("forward_after_step")
            forward_after_step(s)
            collect_results(s)
            if self.timing_repeats:
                st.step("timing")
                s.res["timing"] = {**time_layout(s, st, self.device, self.spec, self.timing_repeats, recompute),
                                   **self._launch_timing}
            st.step("teardown_layout")
        dist.barrier()
        return s.res, {k: v.detach().to("cpu").contiguous() for k, v in s.out.items()}

    def launch_timing(self) -> dict:
        """Once per launch: the whole batch's step on rank 0 alone (the others wait in a barrier)
        and the bus bandwidth of the launch's ranks (harness.parallel.timing)."""
        out: dict = {}
        self.status.step("single_rank_step")
        if self.rank == 0:
            mc = dataclasses.replace(self.mc, config=copy.deepcopy(self.mc.config))
            model, _ = self.build_model(self.ls, self.spec["dtype"], self.device, seed=self.spec["seed"], mc=mc)
            model.train()
            ids = self.ids.to(self.device)

            def one():
                for p in model.parameters():
                    p.grad = None
                lm_loss(model(input_ids=ids).logits, ids).backward()

            out["single_step_s"] = statistics.median(time_steps(one, self.device, repeats=self.timing_repeats,
                                                                barrier=False))
            del model
        dist.barrier()
        self.status.step("bandwidth_probe")
        out["probe_busbw"] = probe_busbw(self.device, self.world)
        out["probe_latency_s"] = probe_latency(self.device)
        return out

    def _build(self, lay: Layout, ids: torch.Tensor) -> _Step:
        """The seeded model (identical on every rank), the mesh and its groups, this rank's tokens."""
        self.status.step("build")
        # A config of its own per layout: apply_cp switches the attention implementation on the model's
        # config (and on every module's, the same object), which would stay on for the next layout.
        mc = dataclasses.replace(self.mc, config=copy.deepcopy(self.mc.config))
        # Built from the seed on the host (identical on every rank and to the reference), then moved.
        model, _ = self.build_model(self.ls, self.spec["dtype"], self.device, seed=self.spec["seed"], mc=mc)
        model.train()
        res: dict = {"layout": lay.to_dict(), "rank": self.rank, "device": str(self.device), "coords": lay.coords(self.rank),
                     "data_index": lay.data_index(self.rank), "notes": []}
        names, sizes = lay.mesh_shape()
        mesh = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)
        ids = ids.to(self.device)
        d, ci = lay.data_degree, lay.coords(self.rank)["cp"]
        ids = ids.chunk(d)[lay.data_index(self.rank)] if d > 1 else ids  # [B, S] -> [B / d, S]
        full_ids, fwd = ids, {}
        if lay.cp > 1:
            # Context parallelism: this rank's chunk of every sequence [b, S / cp], at global positions.
            fwd = {"position_ids": cp_mod.positions(ids.shape[1], lay.cp, ci, device=self.device)}
            ids = cp_mod.chunk(ids, lay.cp, ci)
        return _Step(lay, model, mesh, _subgroups(mesh, lay), CommCounter(on_collective=self.status.collective),
                     res, ids, full_ids, fwd, ci, sum(p.numel() * p.element_size() for p in model.parameters()))


# --- parallelize: the layout's strategies, in torchtitan's order -------------------------------------
def parallelize(s: _Step, spec: dict, cfg, recompute: bool) -> None:
    """pp split -> tp -> ep -> cp -> recomputation -> fsdp -> dp | pipeline stage (torchtitan's
    parallelize_llama order: tp and ep change modules, ac wraps layers, fsdp shards what is left).
    Sets ``s.part``, ``s.wrapped`` (what runs) and what the later steps need to know of the layout."""
    lay = s.lay
    # Pipeline: split first, then tp / fsdp on the stage's chunk; ``s.model`` keeps only this
    # stage's layers too (recomputation is switched on through it).
    s.part = split_stage(s.model, s.groups["pp"]) if lay.pp > 1 else s.model
    if lay.tp > 1:
        _apply_tp(s, spec.get("tp_plan") or None, cfg)
    if lay.ep > 1:
        try:
            s.ep_names = apply_ep(s.model, _num_experts(cfg), s.groups["ep"], spec.get("capacity_factor", 0.0))
        except ValueError:
            if lay.pp == 1:
                raise
            # a pipeline stage of dense layers only (DeepSeek-V3's first three): nothing to shard, its
            # parameters are the data ranks' like any other
            s.ep_names = []
            s.res["notes"].append("this pipeline stage holds no routed experts: ep shards nothing on it")
    if lay.cp > 1:
        cp_mod.apply_cp(s.model, s.groups["cp"], s.cp_index, lay.cp)
    if recompute:
        apply_ac(s.model)
    _apply_fsdp(s)
    _apply_dp_or_pipeline(s)


def _apply_tp(s: _Step, override: dict | None, cfg) -> None:
    from harness.inspect.flops import head_dims

    plan, notes = tp_plan_of(s.model, override)
    s.res["notes"] += notes
    s.tp_norms = apply_tp(s.part, s.mesh["tp"], plan, kv_heads=head_dims(cfg)[1])
    fused = fused_experts_in_plan(s.part, plan)
    if fused and s.lay.ep == 1:  # under ep x tp the experts are split over ep instead
        s.tp_split, notes = shard_fused_experts(s.part, fused, s.groups["tp"])
        s.res["notes"] += notes


def _apply_fsdp(s: _Step) -> None:
    lay, mesh = s.lay, s.mesh
    if lay.fsdp > 1 and lay.ep > 1:
        # ep x fsdp: the experts' partitions FSDP over the ranks that hold the same one (fsdp),
        # the rest over every data rank (fsdp x ep flattened), torchtitan's dp_shard_in_ep.
        apply_fsdp(s.part, mesh["fsdp", "ep"]._flatten(), experts=(s.ep_names, mesh["fsdp"], float(lay.data_degree)))
    elif lay.fsdp > 1:
        # dp x fsdp is HSDP: FSDP2 on the 2-D (replicate, shard) mesh, replicate dimension first.
        apply_fsdp(s.part, mesh["dp", "fsdp"] if lay.dp > 1 else mesh["fsdp"])
    if lay.zero == 2:
        # ZeRO-2 over dp: FSDP2 keeping the gathered parameters from forward through backward.
        apply_fsdp(s.model, mesh["dp"], reshard_after_forward=False)


def _apply_dp_or_pipeline(s: _Step) -> None:
    """Who sums the data dimension's gradients: DDP only where dp is the one strategy (ZeRO-1 is DDP
    with a sharded optimizer); FSDP2 under fsdp and ZeRO-2; DDP per stage inside the pipeline under
    pp x dp (pipeline_stage); else sync_gradients, explicitly (with tp or ep beside dp, an expert
    shard is replicated over dp only)."""
    lay = s.lay
    ddp = (lay.dp > 1 and lay.tp == 1 and lay.fsdp == 1 and lay.ep == 1 and lay.zero != 2 and lay.pp == 1
           and lay.cp == 1)
    s.manual_sync = ((lay.data_degree > 1 or lay.cp > 1) and lay.fsdp == 1 and lay.zero != 2 and lay.pp == 1
                     and not ddp)
    s.wrapped = apply_dp(s.model, s.groups["dp"], s.counter) if ddp else s.model
    if lay.pp > 1:
        s.wrapped, s.stage, s.sched = pipeline_stage(s.part, s.groups["pp"], lay.microbatches, lay.schedule,
                                                     dp_group=s.groups["dp"] if lay.dp > 1 else None,
                                                     counter=s.counter, device=s.ids.device)


def _name_modules(wrapped: torch.nn.Module) -> None:
    for n, m in wrapped.named_modules():
        m._harness_qualname = clean_name(n) or type(m).__name__


# --- capture, forward / backward, gradient sync -----------------------------------------------------
def start_captures(s: _Step) -> None:
    """Every module's output and every router's chosen experts (the routing-aware comparison,
    harness.precision.routing), during the step's forward."""
    # A pipeline stage's plumbing is not the model's: layers of other stages (pass-through), the
    # final norm before the last stage (identity), the base model's output mid-pipeline.
    w = s.wrapped
    inner = w.module if isinstance(w, torch.nn.parallel.DistributedDataParallel) else w
    plumbing = frozenset(m for m in w.modules() if isinstance(m, (_PassLayer, torch.nn.Identity))) | (
        frozenset([getattr(inner, inner.base_name)]) if s.stage is not None and not s.stage.is_last
        else frozenset())
    s.cap = ModuleCapture(w, skip=plumbing)
    s.rcap = RouterCapture(w, name_of=clean_name)
    s.rcap.phase = "step"


def _memory_tracker(s: _Step):
    """MemTracker's module tracking (multi-grad hooks) does not survive the pipeline schedule's
    partial backward calls: pipeline stages are measured by StoragePeak (MemTracker's storage
    accounting without the module tracker; harness.parallel.memory)."""
    if s.sched is not None:
        return StoragePeak(s.wrapped)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(s.wrapped)
    return mt


def forward_backward(s: _Step, st: StatusWriter, recompute: bool) -> None:
    """Forward, loss, backward: ``s.logits`` [b, S(/cp), V] and ``s.loss`` (a scalar, the slice's)."""
    if s.sched is not None:
        _pipeline_forward_backward(s, recompute)
        return
    lay = s.lay
    logits = s.wrapped(input_ids=s.ids, **s.fwd).logits
    if s.cap is not None:
        s.cap.enabled = False  # recomputation re-runs forwards inside backward: not captured
        s.rcap.phase = None
    if lay.cp > 1:
        # This chunk's share of the slice's mean loss; the shares sum to it over cp.
        own = cp_mod.chunk_loss(logits, s.full_ids, lay.cp, s.cp_index)
        loss = own.detach().clone()
        dist.all_reduce(loss, group=s.groups["cp"])
    else:
        own = loss = lm_loss(logits, s.ids)
    st.step("backward")
    # Summed explicitly over the data ranks by sync_gradients: the mean over the whole batch.
    (own / lay.data_degree if s.manual_sync else own).backward()
    s.logits, s.loss = logits, loss


def _pipeline_forward_backward(s: _Step, recompute: bool) -> None:
    """The schedule runs every microbatch's forward and backward; the last stage returns the logits
    [b, S, V] and the microbatches' losses."""
    losses: list[torch.Tensor] = []
    paused = _capture_outside_backward(s.cap, s.rcap) if recompute and s.cap is not None else None
    if s.stage.is_first:
        s.sched.step(s.ids)
    else:
        s.logits = s.sched.step(target=s.ids, losses=losses)
        if losses:  # a middle stage (pp > 2) computes no loss: found by harness plan --rehearse
            s.loss = torch.stack([x.detach() for x in losses]).mean()
    if paused is not None:
        paused.remove()


def sync_gradients(s: _Step) -> None:
    """The reductions no wrapper does: the data dimension's under manual_sync, and the gradients of
    tp's replicated_with_grad_allreduce modules (Qwen3's q/k norms on local heads) over tp."""
    if s.manual_sync:
        experts = set(_expert_param_names(s.model, s.ep_names))
        sync_grads(s.model, s.groups["data_cp" if s.lay.cp > 1 else "data"], skip=experts)
        if experts and s.lay.dp > 1:
            # An expert shard's gradient already sums its ep group's tokens (the backward of
            # the dispatch all-to-all); its copies on the dp replicas saw other sequences.
            sync_grads(s.model, s.groups["dp"], only=experts)
    if s.tp_norms:
        for name, p in s.model.named_parameters():
            if p.grad is not None and any(clean_name(name).startswith(n + ".") for n in s.tp_norms):
                # Under fsdp x tp the gradient is this rank's fsdp shard (a DTensor).
                dist.all_reduce(_local(p.grad), group=s.groups["tp"])


def keep_loss(s: _Step) -> None:
    """The step's module captures end with its forward; its logits and loss go to the results."""
    if s.cap is not None:
        s.cap.remove()
    if s.logits is not None:
        s.out["logits"] = s.logits.detach()
        s.out["loss"] = s.loss.detach().float().reshape(1)
    s.params = [(clean_name(n), p) for n, p in s.wrapped.named_parameters() if p.requires_grad]


def time_layout(s: _Step, st: StatusWriter, device: torch.device, spec: dict, repeats: int,
                recompute: bool) -> dict:
    """The layout's step (forward, backward, gradient reductions) timed and profiled on the model
    the numerics step parallelized (its results are taken already): harness.parallel.timing."""
    s.cap = s.rcap = None  # the captures ended with the numerics step

    def one():
        for p in s.wrapped.parameters():
            p.grad = None
        forward_backward(s, st, recompute)
        sync_gradients(s)

    steps = time_steps(one, device, repeats=repeats)
    return {"step_s": steps, "profile": profile_step(one, device, spec["collective"])}


# --- gather, optimizer step, after-step forward, results --------------------------------------------
def gather_params(s: _Step, kind: str) -> None:
    """Every gradient (``kind`` "grad") or weight ("weight") at full shape into ``s.out``."""
    with s.counter:
        experts = set(_expert_param_names(s.model, s.ep_names))
        for n, p in s.params:
            t = p.grad if kind == "grad" else p.detach()
            if t is not None:
                s.out[f"{kind}/{n}"] = _full(t, n in experts, s.groups, s.tp_split.get(n))


def optimizer_step(s: _Step, lr: float) -> None:
    """One SGD step (ZeRO-1: each rank steps its partition and broadcasts it); the rank's share of
    gradients, parameters and optimizer state, in bytes."""
    params = [p for _, p in s.params]
    s.res["grad_bytes_local"] = sum(_local(p.grad).numel() * p.grad.element_size() for p in params
                                    if p.grad is not None)
    opt = zero1_optimizer(params, lr, s.groups["dp"]) if s.lay.zero == 1 else make_optimizer(params, lr)
    with s.counter:  # ZeRO-1 broadcasts every updated partition from its owner
        opt.step()
    # ZeroRedundancyOptimizer keeps its rank's state in the wrapped local optimizer.
    opt_state = getattr(opt, "optim", opt).state
    s.res["param_bytes_local"] = sum(_local(p).numel() * p.element_size() for p in params)
    s.res["param_bytes_full"] = s.full_bytes
    s.res["optimizer_bytes_local"] = sum(_local(v).numel() * v.element_size() for st in opt_state.values()
                                         for v in st.values() if isinstance(v, torch.Tensor))


def forward_after_step(s: _Step) -> None:
    """The logits again with the new weights (a stale parameter shard shows up there); routers
    captured in phase "after"."""
    if s.rcap is not None:
        s.rcap.phase = "after"
    with s.counter:
        if s.sched is not None:
            after = s.sched.eval(s.ids) if s.stage.is_first else s.sched.eval(target=s.ids, losses=[])
            if not s.stage.is_first:
                s.out["logits_after"] = after.detach()
        else:
            with torch.no_grad():
                s.out["logits_after"] = s.wrapped(input_ids=s.ids, **s.fwd).logits.detach()


def collect_results(s: _Step) -> None:
    """Routing, communication, expert-parallel statistics and module outputs into the results."""
    lay = s.lay
    if s.rcap is not None:
        s.rcap.remove()
        # A pipeline stage's first forward is a shape-inference run: the schedule's own calls only.
        routed = s.rcap.tensors(last=lay.microbatches if s.sched is not None else None)
        if lay.cp > 1:
            # Routing is compared per batch slice (harness.precision.routing): each cp rank gets
            # its slice's whole sequences, [b S / cp, .] -> [b S, .] in the reference's order.
            routed = {k: cp_mod.gather_tokens(routed[k], s.ids.shape[0], s.groups["cp"], lay.cp)
                      for k in sorted(routed)}
        s.out.update(routed)
    s.res["comm"] = s.counter.summary()
    s.res["ep"] = {"assignments": ep_mod.STATS.assignments, "dropped": ep_mod.STATS.dropped,
                   "max_expert_load": ep_mod.STATS.max_expert_load} if lay.ep > 1 else None
    if s.cap is None:
        return
    for name, ts in s.cap.outputs.items():
        if s.sched is not None:
            # The stage's first forward is a shape-inference run of a microbatch: keep the
            # schedule's own calls, one per microbatch in the order they ran.
            ts = ts[-lay.microbatches:]
        shapes = {tuple(t.shape) for t in ts}
        # Several calls (pipeline microbatches): in call order along the batch dimension.
        s.out[f"act/{name}"] = torch.cat(ts) if len(ts) > 1 and len(shapes) == 1 else ts[0]
        s.res.setdefault("act_calls", {})[name] = len(ts)


def _full(t: torch.Tensor, expert: bool, groups: dict, tp_split: tuple[int, bool] | None = None) -> torch.Tensor:
    """``t`` (a gradient or weight of this rank) at the model's full shape, on every rank."""
    if tp_split is not None:  # a fused experts' slice over tp (under fsdp x tp: its fsdp shard first)
        return gather_full(t.full_tensor() if hasattr(t, "full_tensor") else t, *tp_split, groups["tp"])
    if hasattr(t, "full_tensor"):
        if not expert:
            return t.full_tensor()
        t = t.full_tensor()  # ep x fsdp: this rank's expert partition, gathered over fsdp first
    if expert:
        g = groups["ep"]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(g))]
        dist.all_gather(parts, t.contiguous(), group=g)
        return torch.cat(parts)
    return t.detach().clone()  # a copy: the schedule's eval() rescales .grad in place later


def _capture_outside_backward(cap: ModuleCapture, rcap: RouterCapture):
    """Recomputation re-runs a layer's forward inside backward; a pipeline schedule interleaves
    backwards with forwards (1F1B: F0 B0 F1 B1), so the captures cannot just stop before backward as
    they do outside a pipeline. A global forward pre-hook pauses them while autograd's engine runs
    (a graph task is current): only the schedule's own forwards are captured. Returns the handle."""
    phase = rcap.phase

    def pre(_m, _a):
        inside = torch._C._current_graph_task_id() != -1
        cap.enabled = not inside
        rcap.phase = None if inside else phase

    return torch.nn.modules.module.register_module_forward_pre_hook(pre)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _peak(mt) -> int:
    if isinstance(mt, StoragePeak):
        return mt.peak
    if not hasattr(mt, "get_tracker_snapshot"):
        return 0
    try:
        snap = mt.get_tracker_snapshot("peak")
        return sum(v.get("Total", 0) for v in snap.values())
    except Exception:
        return 0


def _num_experts(cfg) -> int:
    from harness.anatomy.moe import num_experts as n

    return n(cfg) or 0


def _expert_param_names(model: torch.nn.Module, ep_names: list[str]) -> list[str]:
    out = []
    for name in ep_names:
        mod = model.get_submodule(name)
        for pn, _ in mod.named_parameters(recurse=False):
            out.append(clean_name(f"{name}.{pn}"))
    return out


def main(spec_path: str) -> int:
    from harness.proc import die_with_parent

    die_with_parent()
    with open(spec_path) as f:
        spec = json.load(f)
    run_dir = os.path.dirname(spec_path)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    status = StatusWriter(status_path(run_dir, rank), rank)
    status.step("init_process_group")
    device = rank_device(spec, int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(spec["collective"], timeout=timedelta(seconds=spec["pg_timeout_s"]))
    runner = RankRun(spec, rank, world, status, device)
    for i, ld in enumerate(spec["layouts"]):
        lay = Layout(**ld)
        out_dir = os.path.join(run_dir, lay.label)
        os.makedirs(out_dir, exist_ok=True)
        try:
            runner.run(i, lay, out_dir)
        except Exception as e:
            _write_json(os.path.join(out_dir, f"rank{rank}.error.json"),
                        {"rank": rank, "step": status.st.step, "collective": status.st.collective,
                         "module": status.st.module, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()})
            sys.stderr.flush()
            os._exit(3)  # the other ranks would wait in a collective: end the launch now
    status.step("teardown")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
