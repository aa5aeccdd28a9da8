"""Faults injected into real ranks (``fault="tests.parallel.faults:<name>"``): each rank calls the
hook after its layout is applied, with ``ctx`` = layout, rank, model, wrapped model, pipeline stage
and schedule, mesh and groups. Each hook breaks only the layout it targets, so the healthy layouts of
the same matrix still run and must still pass."""

from __future__ import annotations

import os
import time

import torch


def skip_rowwise_allreduce(ctx, layer: int = 0) -> None:
    """tp: layer ``layer``'s attention output projection (row-parallel) returns its partial sum: the
    all-reduce that DTensor's RowwiseParallel issues on its output is skipped, on every rank."""
    if ctx.layout.tp < 2:
        return
    from torch.distributed.tensor import DTensor

    mod = ctx.model.get_submodule(f"model.layers.{layer}.self_attn.o_proj")
    mod._forward_hooks.clear()  # RowwiseParallel's output hook: Partial -> Replicate (the all-reduce)
    mod.register_forward_hook(lambda _m, _i, out: out.to_local() if isinstance(out, DTensor) else out)


def _feed_stale_shard(layer: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """FSDP2: the all-gather (unshard) of ``param`` in ``layer``'s unit keeps receiving the shard it held
    now, i.e. before the optimizer step."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    group = layer._get_fsdp_state()._fsdp_param_group
    target = next(p for p in group.fsdp_params if p.sharded_param is param)
    stale = target._sharded_param_data.detach().clone()
    orig = FSDPParam.all_gather_inputs

    def patched(self):
        out = orig.fget(self)
        return [stale.view(-1)] if self is target else out

    FSDPParam.all_gather_inputs = property(patched)


def ep_drop_tokens(ctx) -> None:
    """ep: rank 1's dispatch silently drops every 4th (token, expert) pair it routes."""
    if ctx.layout.ep < 2 or ctx.rank != 1:
        return
    from harness.parallel import ep

    orig = ep.plan_dispatch

    def dropping(flat_e, num_experts, n_ep, capacity):
        order, keep, counts = orig(flat_e, num_experts, n_ep, capacity)
        keep = keep.clone()
        keep[::4] = False
        owner = flat_e[order] // (num_experts // n_ep)
        return order, keep, torch.bincount(owner[keep], minlength=n_ep)

    ep.plan_dispatch = dropping


def pp_reorder_microbatches(ctx) -> None:
    """pp: the first stage runs its microbatches in reverse order (the last stage, and its targets,
    in the right one)."""
    if ctx.layout.pp < 2 or ctx.schedule is None or not ctx.stage.is_first:
        return
    sched = ctx.schedule
    orig = sched._split_inputs

    def reordered(args, kwargs=None):
        a, k = orig(args, kwargs)
        return list(reversed(a)), list(reversed(k))

    sched._split_inputs = reordered


def fsdp_stale_shard(ctx) -> None:
    """fsdp: rank 1 keeps feeding the all-gather (unshard) of layer 0's MLP down projection the
    shard it had before the optimizer step."""
    if ctx.layout.fsdp < 2 or ctx.rank != 1:
        return
    layer = ctx.model.model.layers[0]
    param = layer.get_parameter("mlp.down_proj.weight") if hasattr(layer.mlp, "down_proj") else next(
        p for n, p in layer.named_parameters() if n.endswith("down_proj"))
    _feed_stale_shard(layer, param)


def _on_layout(ctx, name: str, rank: int, fn) -> None:
    if ctx.layout.label == name and ctx.rank == rank:
        layer = ctx.model.model.layers[0]
        layer.register_forward_pre_hook(lambda _m, _a: fn())


def hang_dp2(ctx) -> None:
    """dp2: rank 1 stops in layer 0's forward (rank 0 goes on and waits in DDP's all-reduce)."""
    _on_layout(ctx, "dp2", 1, lambda: time.sleep(10**6))


def abort_tp2(ctx) -> None:
    """tp2: rank 1 calls abort() in layer 0's forward."""
    _on_layout(ctx, "tp2", 1, os.abort)


def several(ctx) -> None:
    """One fault per layout, for one launch: ep2 drops tokens, pp2 reorders microbatches, fsdp2
    gathers a stale shard (tp2 and dp2 stay healthy)."""
    ep_drop_tokens(ctx)
    pp_reorder_microbatches(ctx)
    fsdp_stale_shard(ctx)


def several_after_healthy_ep2(ctx) -> None:
    """`several` in a launch that first runs a healthy ep2 and fsdp2-ac: the faults on the layouts named
    ``ep2-drop`` (its dispatch patch stays for the rest of the rank's life: it comes after ep2), ``pp2``
    and ``fsdp2`` only."""
    if ctx.layout.label == "ep2-drop":
        ep_drop_tokens(ctx)
    if ctx.layout.label == "pp2":
        pp_reorder_microbatches(ctx)
    if ctx.layout.label == "fsdp2":
        fsdp_stale_shard(ctx)


def abort_at_exit_pp2(ctx) -> None:
    """pp2: rank 0 aborts when its interpreter exits, after every result is written (as DTensor
    teardown sometimes does)."""
    if ctx.layout.label == "pp2" and ctx.rank == 0:
        import atexit

        atexit.register(os.abort)


def hang_and_abort(ctx) -> None:
    hang_dp2(ctx)
    abort_tp2(ctx)
    abort_at_exit_pp2(ctx)


def wrong_topk_ep2(ctx) -> None:
    """ep2: rank 1's routers take the (k+1)-th best expert instead of the k-th for every second token
    (as tests/precision/faults.py's ``WrongTopK``): routing flips at whatever margin the router
    logits have, while the logits themselves stay right."""
    if ctx.layout.label != "ep2" or ctx.rank != 1:
        return
    from harness.anatomy.moe import is_router

    def hook(_m, _a, out):
        logits, weights, idx = out
        k = idx.shape[-1]
        order = torch.sort(logits.reshape(idx.shape[0], -1), dim=-1, descending=True, stable=True).indices
        idx = idx.clone()
        rows = torch.arange(0, idx.shape[0], 2)
        idx[rows, k - 1] = order[rows, k].to(idx.dtype)
        return logits, weights, idx

    for name, mod in ctx.model.named_modules():
        if is_router(name):
            mod.register_forward_hook(hook)


def pp2_waits_for_gate(ctx) -> None:
    """pp2: stage 0 waits in layer 0's forward until the file named by $HARNESS_TEST_GATE exists
    (the test creates it once an earlier layout's item has returned); stage 1 waits for it."""
    path = os.environ.get("HARNESS_TEST_GATE")
    if ctx.layout.label != "pp2" or not path:
        return

    def wait(_m, _a):
        while not os.path.exists(path):
            time.sleep(0.05)

    ctx.model.model.layers[0].register_forward_pre_hook(wait)


# --- 2-D layouts: each fault targets one named layout, so the healthy layouts of the same 4-rank
# launch (the same strategies without the fault) still run and must still pass.

_ORIG_ALL_REDUCE: list = []


def _restore_all_reduce() -> None:
    import torch.distributed as dist

    if _ORIG_ALL_REDUCE:
        dist.all_reduce = _ORIG_ALL_REDUCE.pop()


def tp_fsdp_skip_rowwise_allreduce(ctx) -> None:
    """tp x fsdp, the layout named ``tp2xfsdp2-skip-ar``: layer 0's o_proj returns its tp partial sum."""
    if ctx.layout.label == "tp2xfsdp2-skip-ar":
        skip_rowwise_allreduce(ctx)


def hsdp_mean_over_shard_group_only(ctx) -> None:
    """dp x fsdp (HSDP), the layout named ``hsdp-mean``: gradients averaged over the shard group only
    and summed over the replicas (FSDP2's divide factor set to the shard degree instead of the data
    degree, on every FSDP unit of every rank): each gradient x dp."""
    if ctx.layout.label != "hsdp-mean":
        return
    from torch.distributed.fsdp import FSDPModule

    for mod in ctx.model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(float(ctx.layout.fsdp))


def ep_dp_expert_grads_not_over_dp(ctx, label: str = "ep2xdp2-no-ar") -> None:
    """ep x dp, the layout named ``ep2xdp2-no-ar``: the experts' gradients (fused [E/ep, ...] 3-D
    parameters) are not summed over the dp replicas of their shard - as if the dispatch all-to-all's
    backward had already summed everything - on every rank (a consistent skip: nothing hangs)."""
    import torch.distributed as dist

    _restore_all_reduce()
    if ctx.layout.label != label:
        return
    orig, dp_group = dist.all_reduce, ctx.groups["dp"]
    _ORIG_ALL_REDUCE.append(orig)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is dp_group and tensor.dim() == 3:
            return None
        return orig(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


def two_d_faults(ctx) -> None:
    tp_fsdp_skip_rowwise_allreduce(ctx)
    hsdp_mean_over_shard_group_only(ctx)
    ep_dp_expert_grads_not_over_dp(ctx)


def three_d_faults(ctx) -> None:
    """8 ranks: dp x fsdp x tp (HSDP over TP DTensors) and ep x dp x tp, one fault each on a named layout -
    ``hsdp-tp-skip-ar``: layer 0's o_proj returns its tp partial sum; ``hsdp-tp-mean``: gradients
    averaged over the shard group only; ``ep-dp-tp-no-ar``: expert gradients not summed over dp."""
    if ctx.layout.label == "hsdp-tp-skip-ar":
        skip_rowwise_allreduce(ctx)
    if ctx.layout.label == "hsdp-tp-mean":
        from torch.distributed.fsdp import FSDPModule

        for mod in ctx.model.modules():
            if isinstance(mod, FSDPModule):
                mod.set_gradient_divide_factor(float(ctx.layout.fsdp))
    ep_dp_expert_grads_not_over_dp(ctx, label="ep-dp-tp-no-ar")


# --- ZeRO-1: the layout named ``dp2-zero1-nobcast`` -------------------------------------------------

_ZERO1_SKIP: list[bool] = [False]


def zero1_skip_broadcast(ctx) -> None:
    """ZeRO-1, the layout named ``dp2-zero1-nobcast``: ZeroRedundancyOptimizer steps its own partition
    but never broadcasts the updated partitions to the other ranks (its ``_sync_params`` skipped):
    each rank's copy of the parameters another rank owns keeps its old value, on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not hasattr(ZeroRedundancyOptimizer, "_harness_orig_sync"):
        ZeroRedundancyOptimizer._harness_orig_sync = ZeroRedundancyOptimizer._sync_params

        def sync(self):
            if not _ZERO1_SKIP[0]:
                ZeroRedundancyOptimizer._harness_orig_sync(self)

        ZeroRedundancyOptimizer._sync_params = sync
    _ZERO1_SKIP[0] = ctx.layout.label == "dp2-zero1-nobcast"


def pp_dp_last_stage_no_sync(ctx) -> None:
    """pp x dp, the layout named ``pp2xdp2-no-sync``: the last stage never tells its DDP that a
    backward is the step's last (``last_backward`` dropped), so every microbatch runs under
    ``no_sync`` and its dp replicas keep their own slice's gradient - the first stage is right."""
    if ctx.layout.label != "pp2xdp2-no-sync" or ctx.stage is None or not ctx.stage.is_last:
        return
    stage = ctx.stage
    orig = stage.backward_maybe_with_nosync

    def no_sync(backward_type, bwd_kwargs, last_backward=False):
        return orig(backward_type, bwd_kwargs, last_backward=False)

    stage.backward_maybe_with_nosync = no_sync


# --- tp inside fused experts (harness.parallel.tp_experts): layouts named tp2-experts-* ------------
def tp_experts_faults(ctx) -> None:
    """``tp2-experts-no-ar``: layer 0's experts return their partial sum (the output all-reduce hook
    removed); ``tp2-experts-no-f``: the gradient into layer 0's experts input is not summed over tp
    (the pre-hook removed), so the forward agrees and the gradients before it do not."""
    if not ctx.layout.label.startswith("tp2-experts-"):
        return
    mod = ctx.model.get_submodule("model.layers.0.mlp.experts")
    if ctx.layout.label == "tp2-experts-no-ar":
        mod._forward_hooks.clear()
    elif ctx.layout.label == "tp2-experts-no-f":
        mod._forward_pre_hooks.clear()


# --- pp x tp, pp x fsdp: layouts named pp2xtp2-skip-ar / pp2xfsdp2-stale; faults in the last stage --


def _last_layer(ctx) -> int | None:
    """Index of the last decoder layer, on the ranks of the last pipeline stage only (else None)."""
    if ctx.stage is None or not ctx.stage.is_last:
        return None
    return len(ctx.model.model.layers) - 1


def pp_last_stage_faults(ctx) -> None:
    """``pp2xtp2-skip-ar`` (and ``pp2xfsdp2xtp2-skip-ar``): the last layer's attention output
    projection (row-parallel) returns its tp partial sum, on every rank of the last stage. ``pp2xfsdp2-stale``: the fsdp rank 1 of the
    last stage keeps feeding the all-gather of the last layer's attention output projection the shard
    it had before the optimizer step."""
    last = _last_layer(ctx)
    if last is None:
        return
    if ctx.layout.label in ("pp2xtp2-skip-ar", "pp2xfsdp2xtp2-skip-ar"):
        skip_rowwise_allreduce(ctx, layer=last)
    elif ctx.layout.label == "pp2xfsdp2-stale" and ctx.mesh["fsdp"].get_local_rank() == 1:
        layer = ctx.model.model.layers[last]
        _feed_stale_shard(layer, layer.get_parameter("self_attn.o_proj.weight"))


def ep_fsdp_expert_divide_factor(ctx) -> None:
    """ep x fsdp, the layout named ``ep2xfsdp2-divide``: the experts' FSDP units average their
    gradients over their own fsdp mesh only (FSDP2's default divide factor, as if the all-to-all's
    backward had not already summed the ep group's tokens): each expert gradient x ep, on every rank."""
    if ctx.layout.label != "ep2xfsdp2-divide":
        return
    from torch.distributed.fsdp import FSDPModule

    for name, mod in ctx.model.named_modules():
        if isinstance(mod, FSDPModule) and name.endswith(".experts"):
            mod.set_gradient_divide_factor(float(ctx.layout.fsdp))


def cp_faults(ctx) -> None:
    """cp, by layout name: ``cp2-mask`` - layer 0's attention on the cp ranks >= 1 uses a plain local
    causal mask (ignores its chunk's offset: its queries see the first chunk's keys, not their own);
    ``cp2-gather`` - the K/V all-gather's backward skips its all-reduce on every rank (each rank keeps
    only its own queries' share of its keys' and values' gradients). Other layouts are left alone."""
    if ctx.layout.cp < 2:
        return
    from harness.parallel import cp

    label = ctx.layout.label
    if label.endswith("-mask") and ctx.layout.coords(ctx.rank)["cp"] >= 1:
        st = ctx.model.get_submodule("model.layers.0.self_attn")._harness_cp
        st.mask = lambda q, k, device: (torch.arange(k, device=device)[None, :]
                                        <= torch.arange(q, device=device)[:, None]).view(1, 1, q, k)
    if label.endswith("-gather"):

        class NoReduce(cp.GatherSeq):
            @staticmethod
            def backward(c, grad):
                return grad[:, :, c.rank * c.len:(c.rank + 1) * c.len].contiguous(), None, None, None

        for _name, mod in ctx.model.named_modules():
            st = getattr(mod, "_harness_cp", None)
            if st is not None:
                st.gather = lambda t, st=st: NoReduce.apply(t, st.group, st.rank, st.size)


_KEEP: list = []  # faults entered for the rest of the rank's life


def silu_backward_off(ctx) -> None:
    """Every layout: aten::silu_backward 5% off in the rank's dtype (the forward exact), as a backend
    whose activation derivative is wrong on every device - so the layout agrees with a single-process
    run on the same backend, and only the float64 comparison can see it."""
    from tests.precision.backward_faults import SiluBackward

    if not _KEEP:
        _KEEP.append(SiluBackward().__enter__())


def silu_backward_off_on_silu_layouts(ctx) -> None:
    """silu_backward_off on the layouts named ``*-silu`` only: the layouts before them in the same
    launch run the right kernel (the override is entered at the first ``*-silu`` layout, and left again
    at any other layout after it)."""
    if ctx.layout.label.endswith("-silu"):
        silu_backward_off(ctx)
    elif _KEEP:
        _KEEP.pop().__exit__(None, None, None)


def late_all_reduce_rank1(ctx, delay_s: float = 0.1) -> None:
    """Rank 1 enters every all-reduce ``delay_s`` late (a slow link or a straggler as its peers see
    it): rank 0's collective waits that long inside the collective library. Numerics unchanged."""
    if ctx.rank != 1:
        return
    import torch.distributed as dist

    orig = dist.all_reduce

    def late(*args, **kwargs):
        time.sleep(delay_s)
        return orig(*args, **kwargs)

    dist.all_reduce = late


def late_all_reduce_rank1_on_dp2_late(ctx, delay_s: float = 0.1) -> None:
    """late_all_reduce_rank1 on the layout named ``dp2-late`` only: the layouts before it in the same
    launch run on time (the all-reduce is restored at the next layout too)."""
    import torch.distributed as dist

    _restore_all_reduce()
    if ctx.layout.label != "dp2-late" or ctx.rank != 1:
        return
    orig = dist.all_reduce
    _ORIG_ALL_REDUCE.append(orig)

    def late(*args, **kwargs):
        time.sleep(delay_s)
        return orig(*args, **kwargs)

    dist.all_reduce = late


def rank1_stuck_every_layout(ctx) -> None:
    """Rank 1 is broken for every layout (a lost device, a dead link as its peers see it): it stops
    in layer 0's forward, whatever the layout; its peer waits in the layout's first collective."""
    if ctx.rank == 1:
        layers = getattr(getattr(ctx.model, "model", None), "layers", None)
        if layers is not None and len(layers) and layers[0] is not None:
            layers[0].register_forward_pre_hook(lambda _m, _a: time.sleep(10**6))


def lose_node1(ctx) -> None:
    """Every process of the node named ``node1`` (a multi-node rehearsal's second node) dies at once, in
    its first layout's forward, as a node losing power would: its torchrun agent's process group is
    killed (the rank's grandparent: rank <- rank wrapper <- agent), and the wrappers and ranks die with
    it (PR_SET_PDEATHSIG). The peers on the other node are left inside a collective."""
    import signal
    import socket

    import psutil

    if socket.gethostname() != "node1":
        return
    agent = psutil.Process(os.getpid()).parent().parent()

    def die(_m, _i):
        os.killpg(os.getpgid(agent.pid), signal.SIGKILL)

    next(m for m in ctx.model.modules() if len(list(m.children())) == 0).register_forward_pre_hook(die)


def rank1_aborts_every_layout(ctx) -> None:
    """Rank 1 calls abort() in layer 0's forward, whatever the layout (a device that faults on its first
    kernel): its peer then fails inside the layout's first collective (gloo: connection closed), so each
    launch ends with rank 1's SIGABRT and rank 0's error."""
    if ctx.rank == 1:
        layers = getattr(getattr(ctx.model, "model", None), "layers", None)
        if layers is not None and len(layers) and layers[0] is not None:
            layers[0].register_forward_pre_hook(lambda _m, _a: os.abort())


def dp_sum_not_mean(ctx, label: str = "dp2-sum") -> None:
    """dp, the layout named ``dp2-sum``: DDP's bucket all-reduce sums the replicas' gradients instead of
    averaging them (the bucket is scaled back up by the world size before the all-reduce that follows
    DDP's division), on every rank: each gradient x dp, the forward exact - the reduction is the fault."""
    import torch.distributed as dist

    _restore_all_reduce()
    if ctx.layout.label != label:
        return
    orig = dist.all_reduce
    _ORIG_ALL_REDUCE.append(orig)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op:  # DDP's comm hook (the only asynchronous all-reduce of a dp step)
            tensor.mul_(dist.get_world_size(group))
        return orig(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


def rowwise_and_zero1(ctx) -> None:
    """One 2-rank launch shared by two tests: tp layouts skip layer 0's row-parallel all-reduce;
    ``dp2-zero1-nobcast`` skips ZeRO-1's broadcast (dp2, pp2 and the other ZeRO layouts healthy)."""
    skip_rowwise_allreduce(ctx)
    zero1_skip_broadcast(ctx)


def qwen3_moe_world4_faults(ctx) -> None:
    """One 4-rank launch shared by three tests, each fault on its own named layouts: the 2-D faults,
    the pp x tp / pp x fsdp last-stage faults and ep x fsdp's divide factor."""
    two_d_faults(ctx)
    pp_last_stage_faults(ctx)
    ep_fsdp_expert_divide_factor(ctx)


def tp_skip_and_dp_sum(ctx) -> None:
    """One launch: tp layouts skip layer 0's row-parallel all-reduce; ``dp2-sum`` sums, not averages."""
    skip_rowwise_allreduce(ctx)
    dp_sum_not_mean(ctx)
