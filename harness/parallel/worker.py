"""One rank of a parallel launch: every layout of the launch, one after another.

Per layout: build the seeded model (identical on every rank), apply the layout
(apply_tp -> apply_ep -> apply_ac -> apply_fsdp | apply_dp; for pp on the stage split first), run the step of
``harness.parallel.reference`` on this rank's slice of the batch, gather every gradient and weight
to full shape, and write the results (``<layout>/rank<r>.safetensors`` + ``.json``) *before* the
next layout and before teardown: a process that aborts while tearing down DTensor state after it
reported is told apart from a failure by those files.

A layout that raises on a rank writes the error and ends the rank at once (the others would
otherwise wait in a collective until the time limit); the launcher relaunches the layouts left.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

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
from harness.parallel.tp_experts import fused_experts_in_plan, gather_full, shard_fused_experts
from harness.precision.routing import RouterCapture


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


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


class RankRun:
    def __init__(self, spec: dict, rank: int, world: int, status: StatusWriter):
        self.spec, self.rank, self.world, self.status = spec, rank, world, status
        from harness.models.build import build_model, model_config
        from harness.suite.loader import load_suite

        self.ls = load_suite(spec["suite"])
        self.mc = model_config(self.ls)
        self.build_model = build_model
        self.ids = batch(self.mc.config.vocab_size, spec["batch_size"], spec["seq_len"], spec["seed"] + 1)
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
        t0 = time.perf_counter()
        res, tensors = self.step(lay, recompute=lay.recompute, capture=True, ids=self.ids)
        if lay.recompute:
            # Recomputation on vs off on a longer batch, where activations (not the tiny model's
            # weights) make the peak: equal gradients, lower peak with it on.
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
        res["wall_s"] = time.perf_counter() - t0
        self.status.step("write")
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, f"rank{self.rank}.safetensors"))
        _write_json(os.path.join(out_dir, f"rank{self.rank}.json"), res)
        self.status.step("done")

    def step(self, lay: Layout, recompute: bool, capture: bool, ids: torch.Tensor,
             light: bool = False) -> tuple[dict, dict]:
        spec, st = self.spec, self.status
        st.step("build")
        model, _ = self.build_model(self.ls, spec["dtype"], "cpu", seed=spec["seed"], mc=self.mc)
        model.train()
        res: dict = {"layout": lay.to_dict(), "rank": self.rank, "coords": lay.coords(self.rank),
                     "data_index": lay.data_index(self.rank), "notes": []}
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = lay.mesh_shape()
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        groups = _subgroups(mesh, lay)
        counter = CommCounter(on_collective=st.collective)
        d = lay.data_degree
        ids = ids.chunk(d)[lay.data_index(self.rank)] if d > 1 else ids
        full_ids, fwd, ci = ids, {}, lay.coords(self.rank)["cp"]  # full_ids [b, S]: the cp loss's targets
        if lay.cp > 1:
            # Context parallelism: this rank's chunk of every sequence [b, S / cp], at global positions.
            fwd = {"position_ids": cp_mod.positions(ids.shape[1], lay.cp, ci)}
            ids = cp_mod.chunk(ids, lay.cp, ci)
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        st.step("apply")
        tp_norms: list[str] = []
        tp_split: dict[str, tuple[int, bool]] = {}  # fused experts' parameters split over tp (tp_experts)
        ep_names: list[str] = []
        n_exp = _num_experts(self.mc.config)
        # Pipeline: split first, then tp / fsdp on the stage's chunk (torchtitan's order); ``model``
        # keeps only this stage's layers too (recomputation is switched on through it).
        part = split_stage(model, groups["pp"]) if lay.pp > 1 else model
        if lay.tp > 1:
            plan, notes = tp_plan_of(model, spec.get("tp_plan") or None)
            res["notes"] += notes
            from harness.inspect.flops import head_dims

            tp_norms = apply_tp(part, mesh["tp"], plan, kv_heads=head_dims(self.mc.config)[1])
            fused = fused_experts_in_plan(part, plan)
            if fused and lay.ep == 1:  # under ep x tp the experts are split over ep instead
                tp_split, notes = shard_fused_experts(part, fused, groups["tp"])
                res["notes"] += notes
        if lay.cp > 1:
            cp_mod.apply_cp(model, groups["cp"], ci, lay.cp)
        if lay.ep > 1:
            ep_names = apply_ep(model, n_exp, groups["ep"], spec.get("capacity_factor", 0.0))
        if recompute:
            apply_ac(model)
        if lay.fsdp > 1 and lay.ep > 1:
            # ep x fsdp: the experts' partitions FSDP over the ranks that hold the same one (fsdp),
            # the rest over every data rank (fsdp x ep flattened), torchtitan's dp_shard_in_ep.
            apply_fsdp(part, mesh["fsdp", "ep"]._flatten(), experts=(ep_names, mesh["fsdp"], float(d)))
        elif lay.fsdp > 1:
            # dp x fsdp is HSDP: FSDP2 on the 2-D (replicate, shard) mesh, replicate dimension first.
            apply_fsdp(part, mesh["dp", "fsdp"] if lay.dp > 1 else mesh["fsdp"])
        if lay.zero == 2:
            # ZeRO-2 over dp: FSDP2 keeping the gathered parameters from forward through backward.
            apply_fsdp(model, mesh["dp"], reshard_after_forward=False)
        wrapped = model
        # DDP only where dp is the one strategy; with tp or ep beside it, the data dimension's
        # gradients are summed explicitly (an expert shard is replicated over dp only).
        # ZeRO-1 is DDP (gradients all-reduced) with a sharded optimizer; ZeRO-2 is FSDP2 above.
        # pp x dp: DDP per stage, inside the pipeline (pipeline_stage).
        ddp = (lay.dp > 1 and lay.tp == 1 and lay.fsdp == 1 and lay.ep == 1 and lay.zero != 2 and lay.pp == 1
               and lay.cp == 1)
        manual_sync = (d > 1 or lay.cp > 1) and lay.fsdp == 1 and lay.zero != 2 and lay.pp == 1 and not ddp
        if ddp:
            wrapped = apply_dp(model, groups["dp"], counter)
        stage = sched = None
        if lay.pp > 1:
            wrapped, stage, sched = pipeline_stage(part, groups["pp"], lay.microbatches, lay.schedule,
                                                   dp_group=groups["dp"] if lay.dp > 1 else None, counter=counter)
        for n, m in wrapped.named_modules():
            m._harness_qualname = clean_name(n) or type(m).__name__
        if self.fault is not None and not light:
            self.fault(SimpleNamespace(layout=lay, rank=self.rank, world=self.world, model=model, wrapped=wrapped,
                                       stage=stage, schedule=sched, mesh=mesh, groups=groups))
        # A pipeline stage's plumbing is not the model's: layers of other stages (pass-through), the
        # final norm before the last stage (identity), the base model's output mid-pipeline.
        inner = wrapped.module if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else wrapped
        plumbing = frozenset(m for m in wrapped.modules() if isinstance(m, (_PassLayer, torch.nn.Identity))) | (
            frozenset([getattr(inner, inner.base_name)]) if stage is not None and not stage.is_last
            else frozenset())
        cap = ModuleCapture(wrapped, skip=plumbing) if capture else None
        # Every router's chosen experts, for the routing-aware comparison (harness.precision.routing).
        rcap = RouterCapture(wrapped, name_of=clean_name) if capture else None
        if rcap is not None:
            rcap.phase = "step"
        ep_mod.STATS.__init__()
        from torch.distributed._tools.mem_tracker import MemTracker

        # MemTracker's module tracking (multi-grad hooks) does not survive the pipeline schedule's
        # partial backward calls: pipeline stages are measured by StoragePeak (MemTracker's storage
        # accounting without the module tracker; harness.parallel.memory).
        mt = MemTracker() if sched is None else StoragePeak(wrapped)
        if sched is None:
            mt.track_external(wrapped)
        out: dict[str, torch.Tensor] = {}
        st.step("forward")
        with counter, mt:
            if sched is not None:
                losses: list[torch.Tensor] = []
                paused = _capture_outside_backward(cap, rcap) if recompute and cap is not None else None
                if stage.is_first:
                    sched.step(ids)
                    logits = None
                else:
                    logits = sched.step(target=ids, losses=losses)
                    loss = torch.stack([x.detach() for x in losses]).mean()
                if paused is not None:
                    paused.remove()
            else:
                logits = wrapped(input_ids=ids, **fwd).logits
                if cap is not None:
                    cap.enabled = False  # recomputation re-runs forwards inside backward: not captured
                    rcap.phase = None
                if lay.cp > 1:
                    # This chunk's share of the slice's mean loss; the shares sum to it over cp.
                    own = cp_mod.chunk_loss(logits, full_ids, lay.cp, ci)
                    loss = own.detach().clone()
                    dist.all_reduce(loss, group=groups["cp"])
                else:
                    own = loss = lm_loss(logits, ids)
                st.step("backward")
                (own / d if manual_sync else own).backward()
            st.step("grad_sync")
            if manual_sync:
                experts = set(_expert_param_names(model, ep_names))
                sync_grads(model, groups["data_cp" if lay.cp > 1 else "data"], skip=experts)
                if experts and lay.dp > 1:
                    # An expert shard's gradient already sums its ep group's tokens (the backward of
                    # the dispatch all-to-all); its copies on the dp replicas saw other sequences.
                    sync_grads(model, groups["dp"], only=experts)
            if tp_norms:
                for name, p in model.named_parameters():
                    if p.grad is not None and any(clean_name(name).startswith(n + ".") for n in tp_norms):
                        # Under fsdp x tp the gradient is this rank's fsdp shard (a DTensor).
                        dist.all_reduce(_local(p.grad), group=groups["tp"])
        res["peak_bytes"] = int(_peak(mt))
        if cap is not None:
            cap.remove()
        if logits is not None:
            out["logits"] = logits.detach()
            out["loss"] = loss.detach().float().reshape(1)
        params = [(clean_name(n), p) for n, p in wrapped.named_parameters() if p.requires_grad]
        st.step("gather_grads")
        with counter:
            expert_params = set(_expert_param_names(model, ep_names))
            for n, p in params:
                if p.grad is not None:
                    out[f"grad/{n}"] = self._full(p.grad, n in expert_params, groups, tp_split.get(n))
        if light:
            dist.barrier()
            return res, {k: v.detach().to("cpu").contiguous() for k, v in out.items()}
        res["grad_bytes_local"] = sum(_local(p.grad).numel() * p.grad.element_size() for _, p in params
                                      if p.grad is not None)
        st.step("optimizer")
        if lay.zero == 1:
            opt = zero1_optimizer([p for _, p in params], spec["lr"], groups["dp"])
        else:
            opt = make_optimizer([p for _, p in params], spec["lr"])
        with counter:  # ZeRO-1 broadcasts every updated partition from its owner
            opt.step()
        local_param_bytes = sum(_local(p).numel() * p.element_size() for _, p in params)
        # ZeroRedundancyOptimizer keeps its rank's state in the wrapped local optimizer.
        opt_state = getattr(opt, "optim", opt).state
        opt_bytes = sum(_local(v).numel() * v.element_size() for s in opt_state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
        res["param_bytes_local"], res["param_bytes_full"] = local_param_bytes, full_bytes
        res["optimizer_bytes_local"] = opt_bytes
        st.step("gather_weights")
        with counter:
            for n, p in params:
                out[f"weight/{n}"] = self._full(p.detach(), n in expert_params, groups, tp_split.get(n))
        st.step("forward_after_step")
        if rcap is not None:
            rcap.phase = "after"
        with counter:
            if sched is not None:
                after = sched.eval(ids) if stage.is_first else sched.eval(target=ids, losses=[])
                if not stage.is_first:
                    out["logits_after"] = after.detach()
            else:
                with torch.no_grad():
                    out["logits_after"] = wrapped(input_ids=ids, **fwd).logits.detach()
        if rcap is not None:
            rcap.remove()
            # A pipeline stage's first forward is a shape-inference run: the schedule's own calls only.
            routed = rcap.tensors(last=lay.microbatches if sched is not None else None)
            if lay.cp > 1:
                # Routing is compared per batch slice (harness.precision.routing): each cp rank gets
                # its slice's whole sequences, [b S / cp, .] -> [b S, .] in the reference's order.
                routed = {k: cp_mod.gather_tokens(routed[k], ids.shape[0], groups["cp"], lay.cp)
                          for k in sorted(routed)}
            out.update(routed)
        res["comm"] = counter.summary()
        res["ep"] = {"assignments": ep_mod.STATS.assignments, "dropped": ep_mod.STATS.dropped,
                     "max_expert_load": ep_mod.STATS.max_expert_load} if lay.ep > 1 else None
        if cap is not None:
            for name, ts in cap.outputs.items():
                if sched is not None:
                    # The stage's first forward is a shape-inference run of a microbatch: keep the
                    # schedule's own calls, one per microbatch in the order they ran.
                    ts = ts[-lay.microbatches:]
                shapes = {tuple(t.shape) for t in ts}
                # Several calls (pipeline microbatches): in call order along the batch dimension.
                out[f"act/{name}"] = torch.cat(ts) if len(ts) > 1 and len(shapes) == 1 else ts[0]
                res.setdefault("act_calls", {})[name] = len(ts)
        st.step("teardown_layout")
        dist.barrier()
        return res, {k: v.detach().to("cpu").contiguous() for k, v in out.items()}

    def _full(self, t: torch.Tensor, expert: bool, groups: dict, tp_split: tuple[int, bool] | None = None
              ) -> torch.Tensor:
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
    from harness.run.isolation import _die_with_parent

    _die_with_parent()
    with open(spec_path) as f:
        spec = json.load(f)
    run_dir = os.path.dirname(spec_path)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    status = StatusWriter(os.path.join(run_dir, f"status-{rank}"), rank)
    status.step("init_process_group")
    dist.init_process_group(spec["collective"], timeout=timedelta(seconds=spec["pg_timeout_s"]))
    runner = RankRun(spec, rank, world, status)
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
