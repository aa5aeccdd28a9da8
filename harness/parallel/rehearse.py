"""``harness plan --rehearse``: the full-size model parallelized at the production world size, with no
device and no peer: every sampled rank builds the model on the meta device (shapes and dtypes, no
bytes), joins torch's fake process group (``fake``: one process stands for any rank of any world
size, every collective returns at once; each rank in a forked child, ``_forked``) and runs the
parallel check's own steps
(``worker.parallelize``: split_stage -> apply_tp -> apply_ep -> apply_cp -> apply_ac -> apply_fsdp ->
apply_dp | pipeline_stage), then its forward, backward and gradient reductions
(``worker.forward_backward`` / ``sync_gradients``) on meta tensors. What comes out per rank:

* the divisibility errors of the layout at the full size (experts over ep, layers over pp, heads over
  tp, a tp-split Linear's width, the batch over the data ranks), each by name;
* parameter, gradient and optimizer-state bytes the rank holds (its shards: DTensor local shapes);
* the sequence of collectives it issues (kind, group, shape, dtype, step), recorded by a dispatch
  mode over the comm check's op tables (``harness.parallel.comm``), and the pipeline's sends and
  receives (each with its peer). FSDP2 runs on meta too (``_fsdp_on_meta``): its all-gathers and
  reduce-scatters are its own.

Ranks that share a group must issue the same sequence on it, and what a stage sends its neighbour
must be what the neighbour receives: a mismatch is a hang predicted before any device is booked,
named by the ranks, the step and the collective (``order_mismatches``).

The meta device has no values, so the few data-dependent operations of the forward are answered
by :class:`_MetaValues`: the experts run transformers' ``batched_mm`` implementation (no per-expert
loop over the tokens an expert received), a boolean mask keeps every element (the dropless
dispatch), and a count the expert-parallel dispatch reads back (``tolist``) is the even split. The
*number and order* of collectives do not depend on the routing; their sizes under ep are those of a
perfectly balanced router.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field

import torch

MAX_SAMPLED_RANKS = 24
MAX_MICROBATCHES = 4  # a pipeline's microbatches actually run (the rest repeat them)


@dataclass
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast ...
    group: str  # the mesh dimension(s) of the group ("tp", "fsdp+ep"), or its ranks' count
    ranks: tuple[int, ...]  # the group's global ranks: the key ranks are matched on
    shape: tuple[int, ...]
    dtype: str
    step: str  # parallelize, forward, backward, grad_sync

    def text(self) -> str:
        return f"{self.kind}({self.group}, {self.dtype}{list(self.shape)}) in {self.step}"


@dataclass
class RankRehearsal:
    rank: int
    coords: dict[str, int]
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0
    activation_bytes: int = 0  # peak of the meta forward + backward's tensors beyond the parameters
    # the rank's parameters as the checkpoint stores them (FP8 / NVFP4 / INT4 weights and their scales
    # where the release quantizes, 16 bits elsewhere): what an inference deployment holds
    stored_bytes: int = 0
    collectives: list[Collective] = field(default_factory=list)
    recorded: str = ""  # "forward+backward" or "parallelization only (<why>)"
    error: str = ""

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[f"{c.kind}:{c.group}"] = out.get(f"{c.kind}:{c.group}", 0) + 1
        return out


@dataclass
class Rehearsal:
    target: str
    layout: str
    world: int
    errors: list[str]  # divisibility and the check's own refusals: the layout cannot run as is
    notes: list[str]
    ranks: list[RankRehearsal]
    hangs: list[str]
    seconds: float = 0.0
    plan_bytes: dict[str, float] = field(default_factory=dict)  # the plan's per-device figures, if any
    plan_messages: dict[str, float] = field(default_factory=dict)  # the plan's collectives per step, by group
    training: bool = True  # what the plan counts: forward, backward and gradient sync, or forward only
    microbatch_scale: float = 1.0  # the layout's microbatches / those the pipeline schedule ran

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def failed(self) -> bool:
        """A finding: the layout does not divide the model, a rank failed to parallelize, or a hang is
        predicted. A rank whose meta forward stopped early is not one (the meta device's limit)."""
        return bool(self.errors or self.hangs or any(r.error for r in self.ranks))


# --- the layout ---------------------------------------------------------------------------------


def from_plan(b, mode: str, batch: int):
    """``harness plan``'s layout (tp, pp, dp, ep, cp, ZeRO, recompute; ep carved from tp x dp) as
    the parallel check's (``harness.parallel.layouts.Layout``: ep a data dimension of its own).
    ZeRO-3 is fsdp; ep takes its ranks from the data dimension, so ep must divide it. A pipeline runs
    one microbatch per sequence of a replica, as the plan counts them."""
    from harness.parallel.layouts import Layout

    data = "fsdp" if mode == "training" and b.zero >= 3 else "dp"
    if b.ep > 1 and b.dp % b.ep:
        raise ValueError(f"{b.name}: ep{b.ep} over the tp ranks is not a layout the parallel check applies "
                         f"(its ep is a data dimension: ep must divide dp{b.dp})")
    deg = {"tp": b.tp, "pp": b.pp, "cp": b.cp, "ep": b.ep, data: b.dp // b.ep}
    zero = b.zero if mode == "training" and b.zero in (1, 2) else 0
    if zero and deg[data] == 1:
        raise ValueError(f"{b.name}: ZeRO-{zero} over the ep ranks is not a layout the parallel check applies (its "
                         "ZeRO shards over dp, and ep took every data rank)")
    return Layout(**{k: v for k, v in deg.items() if v > 1}, zero=zero, recompute=b.recompute,
                  microbatches=max(1, -(-batch // b.dp)))


def chosen_layout(name: str, world: int, rep=None, *, mode: str = "inference", batch: int = 1):
    """What ``harness plan --rehearse [LAYOUT]`` and the nightly ``rehearse`` check rehearse, as
    ``(layout, the plan's estimate of it or None, notes)``: for ``name`` "best" the plan ``rep``'s
    top layout the parallel check applies (one it does not - ep over the tp ranks, ZeRO over the ep
    ranks - is skipped and named in a note), else the parallel-check layout ``name``; a ValueError
    saying why not (no layout at all, none the check applies, a world other than the cluster's)."""
    from harness.parallel.layouts import parse_name

    est, notes = None, []
    if name == "best":
        if not rep.ranked:
            raise ValueError(rep.recommendation)
        for e in [e for e in rep.ranked if e.fits == rep.ranked[0].fits]:
            try:
                lay, est = from_plan(e.layout, mode, batch), e
                break
            except ValueError as why:
                notes.append(f"the plan's better-ranked layout {why}: the next one is rehearsed")
        else:
            raise ValueError(f"no layout of the plan is one the parallel check applies ({notes[0]})")
    else:
        lay = parse_name(name)
    if lay.world != world:
        raise ValueError(f"{lay.label} has {lay.world} ranks, the cluster {world}")
    return lay, est, notes


def plan_figures(e, rep, mode: str) -> dict[str, float]:
    """The plan's per-device figures the rehearsal is held against, from its estimate ``e``: in
    training its bf16 weights and gradients and fp32 Adam state; in inference its weights in the
    format it planned (the checkpoint's FP8 / NVFP4 where the release quantizes: held against the
    ranks' shards as stored, ``stored_bytes``; bf16: against the bf16 shards; float32: not held)."""
    if e is None:  # a layout named by the user: the plan has no figures of its own for it
        return {}
    if mode == "training":
        return {"weights": e.weights, "gradients": e.gradients, "optimizer": e.optimizer}
    fmt = rep.model.weight_format
    if fmt == "float32":
        return {}
    return {"weights" if fmt == "bfloat16" else "stored weights": e.weights}


_FIGURES = {"weights": "param_bytes", "gradients": "grad_bytes", "optimizer": "optim_bytes",
            "stored weights": "stored_bytes"}


def plan_messages(e) -> dict[str, float]:
    """The plan's collectives per step and device, by group, in its estimate ``e`` of the layout."""
    return {} if e is None else dict(e.comm_messages_by)


def rehearsed_messages(rep: Rehearsal, rr: RankRehearsal) -> dict[str, float]:
    """What ``rr`` issued per step on each group the plan counts: forward (and in training backward)
    scaled from the microbatches the schedule ran to the layout's, the gradient sync once."""
    steps = ("forward", "backward") if rep.training else ("forward",)
    out: dict[str, float] = {}
    for c in rr.collectives:
        if c.group not in rep.plan_messages:
            continue
        if c.step in steps:
            out[c.group] = out.get(c.group, 0.0) + rep.microbatch_scale
        elif c.step == "grad_sync" and rep.training:
            out[c.group] = out.get(c.group, 0.0) + 1
    return out


def plan_errors(rep: Rehearsal) -> dict[str, float]:
    """The plan's relative error per figure, (planned - rehearsed) / rehearsed of the largest rank."""
    ok = [r for r in rep.ranks if not r.error]
    out = {}
    for key, attr in _FIGURES.items():
        got = max((getattr(r, attr) for r in ok), default=0)
        if key in rep.plan_bytes and got:
            out[key] = (rep.plan_bytes.get(key, 0.0) - got) / got
    return out


def divisibility(cfg, lay, *, batch: int, context: int) -> list[str]:
    """Every way ``lay`` does not divide the full-size model, by name (the first of each kind)."""
    from harness.anatomy.moe import num_experts
    from harness.inspect.flops import head_dims, text_config

    cfg = text_config(cfg)
    out = []
    n_exp = num_experts(cfg) or 0
    if lay.ep > 1 and not n_exp:
        out.append(f"ep{lay.ep} on a model without experts")
    elif lay.ep > 1 and n_exp % lay.ep:
        out.append(f"{n_exp} experts over ep={lay.ep}: {n_exp % lay.ep} left over")
    layers = int(cfg.num_hidden_layers)
    if lay.pp > layers:
        out.append(f"{layers} layers over pp={lay.pp} stages: {lay.pp - layers} stage(s) without a layer")
    heads, kvh, _, _ = head_dims(cfg)
    if lay.tp > 1 and heads % lay.tp:
        out.append(f"{heads} attention heads over tp={lay.tp}")
    if lay.tp > 1 and kvh % lay.tp and kvh != 1 and kvh != heads:
        out.append(f"{kvh} key/value heads over tp={lay.tp}")
    slices = lay.data_degree * (lay.microbatches if lay.pp > 1 else 1)
    if batch % slices:
        out.append(f"batch {batch} over {slices} slices (data ranks x microbatches)")
    if lay.cp > 1 and context % (2 * lay.cp) and context % lay.cp:
        out.append(f"context {context} over cp={lay.cp}")
    out += _shared_indexer_cuts(cfg, lay)
    return out


def _shared_indexer_cuts(cfg, lay) -> list[str]:
    """GLM-5's DSA layers of kind "shared" reuse the top-k keys the previous "full" layer's indexer
    chose (``indexer_types``); the pipeline sends its neighbour hidden states only, so a stage that
    starts on a shared layer has no top-k to reuse (transformers raises in the stage's forward)."""
    kinds = list(getattr(cfg, "indexer_types", None) or [])
    n = int(cfg.num_hidden_layers)
    if lay.pp < 2 or lay.pp > n or len(kinds) < n:
        return []
    out = []
    for j, b in enumerate([round(i * n / lay.pp) for i in range(1, lay.pp)], start=1):
        if kinds[b] == "shared":
            full = max((i for i in range(b) if kinds[i] == "full"), default=None)
            out.append(f"pipeline stage {j} starts at layer {b}, a 'shared' DSA layer: its top-k keys come from "
                       f"layer {full}'s indexer on stage {j - 1}, and a stage sends its neighbour hidden states "
                       "only (indexer_types; cut the stages at a 'full' layer)")
            break
    return out


def stage_note(cfg, lay) -> str:
    """How split_stage divides the layers (uneven stages are legal, and the slowest sets the pace)."""
    from harness.inspect.flops import text_config

    n = int(text_config(cfg).num_hidden_layers)
    if lay.pp < 2 or lay.pp > n:
        return ""
    bounds = [round(i * n / lay.pp) for i in range(lay.pp + 1)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    return "" if len(set(sizes)) == 1 else (f"{n} layers over pp={lay.pp} stages leave uneven stages "
                                            f"{'/'.join(map(str, sizes))}: the largest sets the pipeline's pace")


def largest_stage(cfg, lay) -> int:
    """The pipeline stage split_stage gives the most layers (the last of equals: MoE layers follow
    the dense ones), the one whose memory a plan must fit."""
    from harness.inspect.flops import text_config

    n = int(text_config(cfg).num_hidden_layers)
    bounds = [round(i * n / lay.pp) for i in range(lay.pp + 1)]
    return max(range(lay.pp), key=lambda j: (bounds[j + 1] - bounds[j], j))


def sample_ranks(lay, limit: int = MAX_SAMPLED_RANKS, stages: tuple[int, ...] = ()) -> list[int]:
    """Every distinct position in the mesh, few ranks: rank 0; along each dimension its last index
    (a different ep rank, tp rank, data replica ...) and, for pp, every stage (first, middle and last
    hold different layers, embedding and head); and the last rank (every index last at once). Each
    sampled rank shares a group with rank 0 along the dimension it differs in, which is what the
    order check compares."""
    names, sizes = lay.mesh_shape()
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    out = {0, lay.world - 1}
    for d, n, s in zip(names, sizes, strides, strict=True):
        idx = range(n) if d == "pp" and n <= limit // 2 else (n - 1, *(stages if d == "pp" else ()))
        out |= {i * s for i in idx}
        out.add((n - 1) * s + (lay.world - 1) % s)  # the last rank's other coordinates, this one last
    return sorted(out)[:limit]


# --- one rank -----------------------------------------------------------------------------------


class _Steps:
    """The worker's status writer, reduced to the step the rank is in (collectives are tagged with it)."""

    def __init__(self):
        self.now = "parallelize"

    def step(self, name: str) -> None:
        self.now = name

    def collective(self, name: str) -> None:
        pass

    def module(self, name: str) -> None:
        pass


def _group_ranks(args) -> tuple[int, ...] | None:
    """The global ranks of the process group a collective's arguments name (a ProcessGroup object for
    the c10d ops, a group name for the functional ones)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d ops see the group boxed (and the ReduceOp too)
            try:
                a = dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue
        if isinstance(a, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(a))
        if isinstance(a, str):
            try:
                return tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
            except (ValueError, RuntimeError, KeyError):
                continue
    return None


def _collective_log():
    """A CommCounter (its op tables and DTensor rule) that also keeps each collective in order."""
    from torch.utils._pytree import tree_leaves

    from harness.parallel.comm import _COMM, CommCounter, _kind

    class CollectiveLog(CommCounter):
        def __init__(self, steps: _Steps, labels: dict[tuple[int, ...], str]):
            super().__init__()
            self.steps, self.labels, self.log = steps, labels, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = getattr(func, "_overloadpacket", None)
            if packet in _P2P:
                self._p2p(packet, args)
            elif packet in _COMM and not any(getattr(t, "__name__", "") == "DTensor" for t in types):
                ranks = _group_ranks(list(args) + list((kwargs or {}).values())) or ()
                first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
                if first is not None:
                    self.log.append(Collective(_kind(packet), self.labels.get(ranks, f"{len(ranks)} ranks"), ranks,
                                               tuple(first.shape), str(first.dtype).removeprefix("torch."),
                                               self.steps.now))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _p2p(self, packet, args) -> None:
            # c10d.send / c10d.recv_ (tensors, group, the peer's rank in the group, tag): a pipeline
            # stage's activations and gradients. Kept under the directed pair (sender, receiver), which
            # is what order_mismatches matches a send with its receive on.
            group = _group_ranks(args[1:2])
            tensors = [t for t in args[0] if isinstance(t, torch.Tensor)]
            if not (group and tensors) or not isinstance(args[2], int) or args[2] >= len(group):
                return
            me, peer = torch.distributed.get_rank(), group[args[2]]
            kind = "send" if packet is torch.ops.c10d.send else "recv"
            t = tensors[0]
            self.log.append(Collective(kind, self.labels.get(group, f"{len(group)} ranks"),
                                       (me, peer) if kind == "send" else (peer, me), tuple(t.shape),
                                       str(t.dtype).removeprefix("torch."), self.steps.now))

    return CollectiveLog


_P2P = {torch.ops.c10d.send, torch.ops.c10d.recv_}


class _MetaValues:
    """Answers for the forward's data-dependent operations on meta tensors (module docstring): a
    boolean mask keeps everything (nonzero: every index), a bincount is the even split of what it
    counts, and a count read back to the host (``tolist``, ``int``) is that split."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            split: list[int] = [1]

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                x = args[0] if args else None
                if not (isinstance(x, torch.Tensor) and x.device.type == "meta"):
                    return func(*args, **kwargs)
                aten = torch.ops.aten
                if func is aten.nonzero.default:
                    return torch.empty(x.numel(), x.dim(), dtype=torch.int64, device="meta")
                if func is aten.bincount.default:
                    n = max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0)), 1)
                    q, r = divmod(x.numel(), n)
                    self.split = [q + (i < r) for i in range(n)]
                    return torch.empty(n, dtype=torch.int64, device="meta")
                if func is aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
                    if x.numel() == len(self.split):
                        return torch.tensor(self.split, dtype=kwargs.get("dtype") or x.dtype)
                    return torch.ones(x.shape, dtype=kwargs.get("dtype") or x.dtype)
                if func is aten._local_scalar_dense.default:
                    return max(self.split) if x.dtype in (torch.int64, torch.int32) else 1
                return func(*args, **kwargs)

        return Mode()


def _labels(groups: dict) -> dict[tuple[int, ...], str]:
    import torch.distributed as dist

    out: dict[tuple[int, ...], str] = {}
    for name, g in groups.items():
        out.setdefault(tuple(dist.get_process_group_ranks(g)), name)
    return out


def _local_bytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _state_bytes(s, rr: RankRehearsal, stored, extra: int = 0) -> None:
    """Parameters and gradients as this rank holds them (local shards), the same shards as the
    checkpoint stores them (``stored``: harness.inspect.params.StoredBytes), and Adam's float32 master
    weights, m and v (12 B per local parameter, split by dp under ZeRO-1), as the plan counts them.
    ``extra``: parameters outside what the layout splits that this rank holds whole (a wrapper's
    vision tower on the first stage), in bf16 as the rest."""
    from harness.parallel.reference import clean_name

    params = extra
    rr.param_bytes = rr.stored_bytes = rr.grad_bytes = 2 * extra
    for name, p in s.wrapped.named_parameters():
        local = getattr(p, "_local_tensor", p)
        rr.param_bytes += _local_bytes(p)
        rr.stored_bytes += stored.of(clean_name(name), local)
        params += local.numel()
        if p.grad is not None:
            rr.grad_bytes += _local_bytes(p.grad)
    rr.optim_bytes = 12 * params // (s.lay.dp if s.lay.zero == 1 else 1)
    if not rr.recorded.startswith("forward+backward"):
        rr.grad_bytes = rr.param_bytes  # no backward ran: bf16 gradients the shape of the local shards


def _build_step(model, cfg, lay, rank: int, batch: int, context: int, steps: _Steps):
    from torch.distributed.device_mesh import init_device_mesh

    from harness.parallel import worker

    names, sizes = lay.mesh_shape()
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    groups = worker._subgroups(mesh, lay)
    seqs = max(batch // lay.data_degree, 1)
    ids = torch.zeros(seqs, context // lay.cp, dtype=torch.int64, device="meta")
    full = torch.zeros(seqs, context, dtype=torch.int64, device="meta")
    fwd = {}
    if lay.cp > 1:
        fwd = {"position_ids": torch.zeros(1, context // lay.cp, dtype=torch.int64, device="meta")}
    log = _collective_log()(steps, _labels(groups))
    return worker._Step(lay, model, mesh, groups, log, {"notes": []}, ids, full, fwd, lay.coords(rank)["cp"],
                        0)


def rehearse_rank(target, lay, rank: int, *, batch: int, context: int, decoder=None) -> RankRehearsal:
    """One rank of ``lay`` at its real world size on the fake process group: parallelized by the
    parallel check's steps, then its meta forward, backward and gradient reductions. ``decoder``:
    what the layout splits (``plan.language_decoder``: a wrapper's language decoder)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.inspect.params import StoredBytes, meta_model
    from harness.parallel import worker
    from harness.parallel.plan import language_decoder

    rr = RankRehearsal(rank, {k: v for k, v in lay.coords(rank).items() if getattr(lay, k) > 1})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world)
    try:
        dec = decoder or language_decoder(target)
        mc = dec.mc
        mc.config._experts_implementation = "batched_mm"  # no per-expert loop over routed tokens
        model, _ = meta_model(dec.target, pruned=False, dtype=torch.bfloat16, mc=mc)
        stored = StoredBytes(model, mc)  # by the whole model's names, before any step renames or splits
        model.train()
        steps = _Steps()
        s = _build_step(model, mc.config, lay, rank, batch, context, steps)
        with _fsdp_on_meta():
            try:
                worker.parallelize(s, {"capacity_factor": 0.0}, mc.config, lay.recompute)
            except Exception as e:  # noqa: BLE001 - what the check's own steps refuse at this size is the finding
                rr.error = f"parallelize: {_root_cause(e)}"
                rr.collectives = list(s.counter.log)
                return rr
            if s.stage is not None:
                _static_stage_meta(s, mc.config, batch // lay.data_degree, context // lay.cp)
                _label_stage_steps(s.stage, steps)
            _forward_backward(s, steps, rr)
        _state_bytes(s, rr, stored, sum(dec.extra.values()) if lay.coords(rank).get("pp", 0) == 0 else 0)
    finally:
        dist.destroy_process_group()
    return rr


@contextlib.contextmanager
def _fsdp_on_meta():
    """FSDP2 on the meta device. fully_shard takes the device its all-gathers write into from the
    mesh (``cpu`` here: real host buffers at the full size - an 8B model's forward took 143 s and
    its logits came back on the host); it is told ``meta`` instead, and meta's streams and events
    are the CPU's no-ops. Its refusal of meta parameters (they are the point here) is lifted. The
    sharding, the all-gathers and reduce-scatters it issues (their number, order, groups and
    shapes) are FSDP2's own."""
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_param_group,
        _fsdp_state,
        _fully_shard,
    )

    saved = [(_fully_shard, "_get_device_from_mesh", _fully_shard._get_device_from_mesh),
             (_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params",
              _fsdp_param_group.FSDPParamGroup._validate_no_meta_params)]
    saved += [(m, "_get_device_handle", m._get_device_handle)
              for m in (_fsdp_param_group, _fsdp_state, _fsdp_collectives)]
    try:
        _fully_shard._get_device_from_mesh = lambda mesh: torch.device("meta")
        _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
        for m, _, orig in saved[2:]:
            m._get_device_handle = lambda kind, orig=orig: torch.cpu if kind == "meta" else orig(kind)
        yield
    finally:
        for obj, name, orig in saved:
            setattr(obj, name, orig)


def _forward_backward(s, steps: _Steps, rr: RankRehearsal) -> None:
    from torch.fx.experimental import _config as fx_config

    from harness.parallel import worker

    try:
        # A boolean index (x[mask]) asks the meta kernel for nonzero below any dispatch mode: torch's
        # own switch answers it as _MetaValues does (every element kept).
        with fx_config.patch(meta_nonzero_assume_all_nonzero=True), _MetaValues(), s.counter:
            steps.step("forward")
            worker.forward_backward(s, steps, s.lay.recompute)
            steps.step("grad_sync")
            worker.sync_gradients(s)
        rr.recorded = "forward+backward"
    except Exception as e:  # noqa: BLE001 - the meta forward's limit, reported, the parallelization still is
        rr.recorded = f"parallelization, then {steps.now} until {_root_cause(e)}"
    rr.collectives = list(s.counter.log)


def _root_cause(e: BaseException) -> str:
    """The innermost exception's type and first non-blank line: torch's pipeline wraps a stage's
    failure in a RuntimeError whose message starts with a newline (it read as a blank error)."""
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    first = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    return f"{type(e).__name__}: {first[:160]}"


def _label_stage_steps(stage, steps: _Steps) -> None:
    """The pipeline schedule interleaves microbatches' forwards and backwards inside one call: each
    chunk's collectives are tagged with the step it is really in."""
    def tagged(fn, name):
        def run(*a, **k):
            steps.step(name)
            return fn(*a, **k)
        return run

    for attr, name in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                       ("backward_weight_one_chunk", "backward")):
        if hasattr(stage, attr):
            setattr(stage, attr, tagged(getattr(stage, attr), name))


def _static_stage_meta(s, cfg, seqs: int, tokens: int) -> None:
    """A pipeline stage learns its neighbours' shapes from them (metadata sent point to point and a
    vote on whether to), which the fake process group cannot deliver: this stage is told its input and
    output per microbatch instead (torch's static metadata; ids into the first stage, hidden states
    between stages, logits out of the last), so the schedule runs without asking."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    from harness.inspect.flops import text_config

    cfg = text_config(cfg)
    mb = max(seqs // s.lay.microbatches, 1)
    # requires_grad on the hidden states: torch gives a stage a gradient receive buffer only for
    # an output its metadata says needs one (without it the backward gets None and fails blank).
    hidden = torch.empty(mb, tokens, int(cfg.hidden_size), dtype=torch.bfloat16, device="meta",
                         requires_grad=True)
    ids = torch.empty(mb, tokens, dtype=torch.int64, device="meta")
    logits = torch.empty(mb, tokens, int(cfg.vocab_size), dtype=torch.bfloat16, device="meta")
    st = s.stage
    st._user_meta = _StageMeta(inputs=extract_tensor_metas((ids if st.is_first else hidden,)),
                               outputs=extract_tensor_metas((logits if st.is_last else hidden,)),
                               input_grads=None, output_grads=None)


# --- every sampled rank, and the order check --------------------------------------------------------


def order_mismatches(ranks: list[RankRehearsal]) -> list[str]:
    """Ranks that share a group must issue the same collectives on it, in the same order: the first
    difference per group is a predicted hang, named by the ranks, the position and the collective."""
    by_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for rr in ranks:
        for c in rr.collectives:
            if c.kind not in ("send", "recv"):
                by_group.setdefault(c.ranks, {})
    # A rank whose meta forward stopped early has a cut sequence, not a different one: only complete
    # ranks are compared (the others say where they stopped).
    ranks = [rr for rr in ranks if not rr.error and rr.recorded == "forward+backward"]
    for key, seqs in by_group.items():
        for rr in ranks:
            if rr.rank in key:
                seqs[rr.rank] = [c for c in rr.collectives if c.ranks == key]
    out = []
    for key, seqs in by_group.items():
        items = sorted(seqs.items())
        if len(items) < 2:
            continue
        r0, ref = items[0]
        for r, seq in items[1:]:
            why = _first_difference(r0, ref, r, seq)
            if why:
                out.append(f"predicted hang in group {ref[0].group if ref else seq[0].group} "
                           f"({len(key)} ranks): {why}")
                break
    return out + _p2p_mismatches(ranks)


def _p2p_mismatches(ranks: list[RankRehearsal]) -> list[str]:
    """Point to point (pipeline stages): what a rank sends to a peer, in order, must be what the peer
    receives from it - one send more, or a shape the receiver's buffer does not have, blocks both.
    Checked for each directed pair whose two ranks were both sampled."""
    ok = {rr.rank: rr for rr in ranks if not rr.error and rr.recorded == "forward+backward"}
    out = []
    for src, rr in sorted(ok.items()):
        for dst in sorted({c.ranks[1] for c in rr.collectives if c.kind == "send" and c.ranks[0] == src}):
            if dst not in ok:
                continue
            sent = [c for c in rr.collectives if c.kind == "send" and c.ranks == (src, dst)]
            got = [c for c in ok[dst].collectives if c.kind == "recv" and c.ranks == (src, dst)]
            why = _first_difference(src, sent, dst, got)
            if why:
                out.append(f"predicted hang on the {sent[0].group} link {src}->{dst}: {why}")
    return out


def _first_difference(r0: int, a: list[Collective], r: int, b: list[Collective]) -> str:
    def sig(c: Collective) -> tuple:  # a send matches its receive: kind aside for point to point
        return ("p2p" if c.kind in ("send", "recv") else c.kind, c.shape, c.dtype)

    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if sig(x) != sig(y):
            return f"collective #{i + 1}: rank {r0} issues {x.text()}, rank {r} issues {y.text()}"
    if len(a) != len(b):
        longer, n = (r0, a) if len(a) > len(b) else (r, b)
        other = r if longer == r0 else r0
        c = n[min(len(a), len(b))]
        return (f"collective #{min(len(a), len(b)) + 1}: rank {longer} issues {c.text()}, rank {other} issues none "
                f"({len(a)} vs {len(b)} on this group)")
    return ""


def _forked(fn, target, lay, rank: int, **kw) -> RankRehearsal:
    """``fn`` for one rank in a forked child of this process: every sampled rank starts from the same
    clean state. In one process the ranks leak into each other - DTensor parallelizing rank 2 found
    parameters already placed on rank 0's (destroyed) tp mesh, and their reductions named groups the
    new world does not know - and a fork costs milliseconds where a fresh interpreter costs seconds
    of imports. A child that dies is that rank's error, not the rehearsal's."""
    import os
    import pickle

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one rank, its record down the pipe, and out without the parent's atexit
        code = 0
        try:
            os.close(rfd)
            try:
                out = fn(target, lay, rank, **kw)
            except Exception as e:  # noqa: BLE001 - reported as this rank's error by the parent
                out = RankRehearsal(rank, {}, error=f"rehearsal: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            with os.fdopen(wfd, "wb") as f:
                pickle.dump(out, f)
        except BaseException:  # noqa: BLE001 - never return into the parent's code from the child
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if data:
        return pickle.loads(data)
    return RankRehearsal(rank, {}, error=f"rehearsal: the rank's process died ({_status_text(status)})")


def _warm(dec) -> None:
    """What every forked rank would otherwise import again on its own (transformers' modeling module,
    torch's pipelining, tensor-parallel and fake-group modules): imported once, here, before the forks.
    Nothing distributed is set up in this process."""
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    from harness.inspect.params import meta_model
    from harness.parallel import worker  # noqa: F401

    meta_model(dec.target, pruned=False, dtype=torch.bfloat16, mc=dec.mc)


def _status_text(status: int) -> str:
    import os
    import signal

    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def rehearse(target, lay, *, batch: int, context: int, ranks: list[int] | None = None,
             fault=None) -> Rehearsal:
    """Rehearse ``lay`` (the parallel check's Layout) of ``target`` at its world size: divisibility,
    the sampled ranks one after another in this process (the fake process group is set up per rank),
    and the collective order across them. ``fault(rank, rr)`` may change a rank's record (the tests'
    planted mismatch)."""
    import dataclasses

    from harness.inspect.flops import text_config
    from harness.parallel.layouts import ArchFacts, _combination_refusal
    from harness.parallel.plan import language_decoder

    t0 = time.perf_counter()
    dec = language_decoder(target)
    cfg = dec.mc.config
    errors = divisibility(cfg, lay, batch=batch, context=context)
    notes = [n for n in [dec.note, stage_note(cfg, lay)] if n]
    refused = _combination_refusal(dataclasses.replace(lay, cp=1), ArchFacts(moe=False, num_layers=0), ())
    if lay.cp > 1 and (lay.pp > 1 or lay.fsdp > 1 or lay.ep > 1 or lay.zero):
        refused = "context parallelism combines with dp and tp only so far"
    if lay.cp > 1:
        from harness.parallel.cp import attention_facts, refusal

        # what the attention itself rules out (GLM-5's DSA indexer reads the mask cp builds inside the
        # call): the ranks' forward then stops where the note says, not at an unexplained TypeError
        refused = refusal(attention_facts(cfg), lay.cp, (context,)) or refused
    if refused:
        notes.append(f"the parallel check refuses this combination at the pruned size: {refused}")
    out = []
    run, run_batch = lay, batch
    if lay.pp > 1 and lay.microbatches > MAX_MICROBATCHES:
        # Every microbatch repeats the same sends, receives and stage collectives: the schedule runs
        # MAX_MICROBATCHES of them at the real microbatch size (256 took 30 s of CPU per stage).
        run = dataclasses.replace(lay, microbatches=MAX_MICROBATCHES)
        run_batch = batch // lay.microbatches * MAX_MICROBATCHES
        notes.append(f"the pipeline schedule ran {MAX_MICROBATCHES} of the layout's {lay.microbatches} microbatches "
                     "(each repeats the same collectives)")
    if not errors:
        _warm(dec)
        stages = (largest_stage(cfg, lay),) if lay.pp > 1 and lay.pp <= int(text_config(cfg).num_hidden_layers) else ()
        for r in ranks if ranks is not None else sample_ranks(lay, stages=stages):
            rr = _forked(rehearse_rank, target, run, r, batch=run_batch, context=context, decoder=dec)
            if fault is not None:
                fault(r, rr)
            out.append(rr)
    rep = Rehearsal(target.name, lay.label, lay.world, errors, notes, out, order_mismatches(out))
    rep.microbatch_scale = lay.microbatches / run.microbatches if lay.pp > 1 else 1.0
    rep.seconds = time.perf_counter() - t0
    return rep


def render(rep: Rehearsal) -> str:
    gib = 2**30
    lines = [f"rehearsal of {rep.target} {rep.layout} at {rep.world} ranks (fake process group, meta device): "
             f"{len(rep.ranks)} sampled ranks in {rep.seconds:.1f} s"]
    lines += [f"  divisibility error: {e}" for e in rep.errors] + [f"  note: {n}" for n in rep.notes]
    for rr in rep.ranks:
        coords = " ".join(f"{k}{v}" for k, v in rr.coords.items())
        if rr.error:
            lines.append(f"  rank {rr.rank:>5} [{coords}]: {rr.error}")
            continue
        counts = ", ".join(f"{n} {k}" for k, n in sorted(rr.summary().items()))
        stored = f" ({rr.stored_bytes / gib:.2f} GiB as stored)" if rr.stored_bytes != rr.param_bytes else ""
        lines.append(f"  rank {rr.rank:>5} [{coords}]: params {rr.param_bytes / gib:.2f} GiB{stored}, grads "
                     f"{rr.grad_bytes / gib:.2f} GiB, Adam {rr.optim_bytes / gib:.2f} GiB; "
                     f"{len(rr.collectives)} collectives ({counts or 'none'}); recorded: {rr.recorded}")
    lines += [f"  {h}" for h in rep.hangs]
    lines += _against_plan(rep)
    ok = not rep.failed
    lines.append("rehearsal: " + ("no divisibility error, no collective-order mismatch" if ok else
                                  f"{len(rep.errors)} divisibility error(s), {len(rep.hangs)} predicted hang(s), "
                                  f"{sum(bool(r.error) for r in rep.ranks)} rank(s) failed to parallelize"))
    return "\n".join(lines)


def _against_plan(rep: Rehearsal) -> list[str]:
    """The plan's per-device weights / gradients / optimizer state against the largest rehearsed rank,
    and its collectives per step against the busiest rank's, group by group."""
    out = []
    ok = [r for r in rep.ranks if r.recorded.startswith("forward+backward")]
    for group, planned in sorted(rep.plan_messages.items()):
        got = max((rehearsed_messages(rep, r).get(group, 0.0) for r in ok), default=0.0)
        if got:
            out.append(f"  plan vs rehearsal, {group} collectives per step (busiest rank): {planned:.0f} vs {got:.0f} "
                       f"({(planned - got) / got:+.1%})")
    for key, err in plan_errors(rep).items():
        got = max(getattr(r, _FIGURES[key]) for r in rep.ranks if not r.error)
        out.append(f"  plan vs rehearsal, {key} per device (largest rank): {rep.plan_bytes.get(key, 0.0) / 2**30:.2f} "
                   f"vs {got / 2**30:.2f} GiB ({err:+.1%})")
    return out
