"""Check ``training``: backward, optimizer step and loss trajectory against the float64 reference
(the golden's ``training`` section, ``harness.precision.backward``; docs/training.md).

Steps: ``golden`` (load it and its training section made with the suite's knobs; a missing or bad
one is "could not run") -> ``budgets`` (the section's clean errors measured in this dtype) ->
``backward`` (one forward + backward of the LM loss on the golden's ids, routers forced to the
golden's choices: every captured module's input and output gradient and every parameter's gradient
sketch against the golden) -> ``localize`` (walking backward, the first module whose input or
parameter gradient diverges while the gradient it received agrees) -> ``replay`` (each module's
isolated backward: fed the golden's forward inputs and output gradient) -> ``optimizer`` (AdamW on
seeded synthetic gradients: the optimizer alone, per parameter group) -> ``trajectory`` (``steps``
AdamW steps on the golden's batch stream: loss, gradient norm and update norm per step under the
measured envelope; the weight change per group) -> ``record`` -> ``verdict``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

from pydantic import Field, field_validator

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
from harness.golden.sections import GoldenSection, load_golden_for
from harness.precision import backward as bw

metrics.declare("training_backward_worst_budget_use", "", "lower", "largest module/parameter gradient error "
                "against the float64 golden / its measured budget (fails > 1)")
metrics.declare("training_backward_over_budget", "", "lower", "module input/output gradients and parameter "
                "gradient sketches over their budget")
metrics.declare("training_replay_worst_budget_use", "", "lower", "largest isolated-backward error (a module fed "
                "the golden's inputs and output gradient) / its budget")
metrics.declare("training_optimizer_worst_budget_use", "", "lower", "largest error of the weight change after "
                "the AdamW steps on seeded gradients (the optimizer alone) / its budget")
metrics.declare("training_update_worst_budget_use", "", "lower", "largest error of the weight change after the "
                "training steps on the batch stream / its budget")
metrics.declare("training_trajectory_worst_envelope_use", "", "lower", "largest per-step deviation of loss, "
                "gradient norm or update norm from the reference's curve / the measured envelope (fails > 1)")
metrics.declare("training_trajectory_first_step_out", "", "none", "first step whose loss, gradient norm or "
                "update norm leaves the envelope (-1: none)")
metrics.declare("training_loss_abs_err", "nats", "lower", "|loss - golden loss| of the first backward")
metrics.declare("training_unresolved", "", "none", "compared quantities whose clean error in this dtype is above "
                "the dtype's ceiling (not resolvable in it; reported, not judged)")
metrics.declare("training_signed_min_p", "", "higher", "smallest sign-test p of an isolated backward's signed "
                "error against the clean dtype run's (harness.precision.signed; fails below 1e-4 / quantities "
                "with an effect above the floor)")
metrics.declare("training_signed_max_effect", "", "lower", "largest |mean signed error - clean| of an isolated "
                "backward's input gradient or parameter sketch, relative to its RMS")
metrics.declare("grad_global_norm_rel_err", "", "lower", "|global gradient norm / the golden's - 1| of the "
                "first backward")


class TrainingConfig(CheckConfig):
    """Training numerics against the float64 reference: gradients module by module, AdamW, loss trajectory."""

    steps: int = Field(3, ge=1, le=64, description="AdamW steps of the trajectory and of the optimizer-alone "
                       "comparison (a handful: the reference's float64 steps are made at golden generate).")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay of the decay group (matrices); "
                                "vectors (norm weights, biases) are the no-decay group.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], description="AdamW (beta1, beta2).")
    optimizer: Literal["fused", "foreach", "loop"] = Field(
        "fused", description="The target's AdamW implementation: 'fused' (the backend's fused kernel, what "
        "vendors train with), 'foreach' or 'loop'. The float64 reference always runs the plain loop.")
    master_fp32: bool = Field(False, description="Also train with float32 master weights (bf16/fp16 parameters, "
                              "gradients cast to float32, the AdamW step on the masters), as vendors train: variant "
                              "'master_fp32' (the default item trains plain in the run dtype).")
    sketch_size: int = Field(256, ge=16, description="Gradient elements per parameter kept in the golden "
                             "(seeded, among the gradient's nonzero entries).")
    trajectory_draws: int = Field(3, ge=1, description="Batch streams over which `golden generate` measures "
                                  "the trajectory envelope (stream 0 is the one the check runs).")
    budget_k: float = Field(1.5, ge=1, description="A quantity fails above budget_k x its clean error (max "
                            "over draws) + the dtype's floor.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError(f"must be two numbers in [0, 1), got {v}")
        return v


MASTER_VARIANT = "master_fp32"  # item training[<backend>-<dtype>-master_fp32]
# The golden's training section: the float64 reference's gradients, optimizer steps and loss trajectory,
# with the budgets measured in each dtype (its producer is harness/precision/backward.py).
SECTION = GoldenSection(bw.SECTION, bw.spec, bw.build)


@dataclass
class Row:
    kind: str  # gin, gout, param, replay_gin, replay_param, opt, upd
    name: str  # module or parameter
    err: float
    budget: float | None  # None: not resolvable in this dtype

    @property
    def ok(self) -> bool:
        return self.budget is None or self.err <= self.budget

    @property
    def use(self) -> float:
        return self.err / self.budget if self.budget else 0.0

    def text(self) -> str:
        b = "not resolvable" if self.budget is None else f"budget {self.budget:.3g}"
        return f"{self.kind} rel_rmse {self.err:.3g} ({b})"


def run_training(ctx: CheckContext, *, transform=None, context=None, golden_root=None, results_dir=None):
    """The check with options: ``transform`` (model -> model) / ``context`` (() -> context manager
    around every forward, backward and optimizer step of the target) inject faults; ``golden_root`` /
    ``results_dir`` redirect files. Returns the state (rows, trajectory) when it passes."""
    return TrainingCheck().run(ctx, transform=transform, context=context, golden_root=golden_root,
                               results_dir=results_dir)


class TrainingCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "training"
    order = 25
    config_model = TrainingConfig
    description = "backward, optimizer and loss trajectory against the float64 golden"
    headline = ("training_backward_worst_budget_use", "training_trajectory_worst_envelope_use")
    steps = ("golden", "budgets", "backward", "localize", "replay", "optimizer", "trajectory", "record", "verdict")
    setup_steps = ("golden", "budgets")
    golden_sections = (SECTION,)

    def variants(self, suite, backend) -> list[str | None]:
        return [None, MASTER_VARIANT] if self.config(suite).master_fp32 else [None]

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(transform=None, context=None, golden_root=None, results_dir=None)

    def golden(self, ctx: CheckContext, st) -> None:
        if ctx.dtype == "float64":
            raise NotApplicable("float64 is the reference's dtype: nothing to compare against")
        st.master = ctx.variant == MASTER_VARIANT
        if st.master and ctx.dtype not in bw.MASTER_DTYPES:
            raise NotApplicable(f"float32 master weights of {ctx.dtype} parameters are the plain run")
        st.g = load_golden_for(ctx, st.golden_root)
        st.spec = bw.spec(ctx.suite)
        sec = SECTION.read(st.g, ctx.suite)
        st.entry, st.t = sec.entry, sec.tensors
        st.rows, st.notes = [], []

    def budgets(self, ctx: CheckContext, st) -> None:
        st.clean = (st.entry.get("budgets") or {}).get(ctx.dtype)
        if not st.clean:
            raise CouldNotRun(f"the golden's training section has no budgets for {ctx.dtype} (measured for "
                              f"{sorted(st.entry.get('budgets') or {})}); add {ctx.dtype} to the suite's dtypes and "
                              f"regenerate with `harness golden generate {ctx.suite.name} --update`", step="budgets")
        if st.master:  # the optimizer's and the trajectory's budgets of the mixed-precision run
            st.clean = {**st.clean, **(st.entry["budgets"].get(ctx.dtype + bw.MASTER) or {})}
            if ctx.dtype + bw.MASTER not in st.entry["budgets"]:
                raise CouldNotRun(f"the golden's training section has no {ctx.dtype} master-weight budgets; regenerate "
                                  f"with `harness golden generate {ctx.suite.name} --update`", step="budgets")
        k = ctx.config.budget_k
        st.budget = lambda kind, name: bw.budget(st.clean.get(kind, {}).get(name, math.inf), ctx.dtype, k)
        st.routes = {r: st.t[f"route/{r}"] for r in st.entry.get("routers", [])}
        st.idx = {n: st.t[f"pidx/{n}"] for n in st.entry["params"]}
        ctx.detail("budget_source", f"measured clean error x {k:g} + floor over {st.entry.get('draws')} draws "
                   f"({ctx.dtype}); above the ceiling {bw.CEILINGS.get(ctx.dtype, bw.CEILINGS['float32']):g}: not judged")

    def backward(self, ctx: CheckContext, st) -> None:
        from harness.precision.runner import build_target

        ls = ctx.suite
        st.model, mc = build_target(ls, ctx.backend, ctx.dtype, st.transform, st.g)
        ctx.notes.extend(mc.notes)
        ids = st.t["labels"].to(ctx.device)
        st.run = bw.grad_run(st.model, ids, ls.suite.checks.precision.capture, routes=st.routes, context=st.context)
        if st.run.unforced:
            st.notes.append(f"routers not forced to the golden's choices: {', '.join(st.run.unforced)}")
        gin = {m: st.t[f"gin/{m}"] for m, e in st.entry["modules"].items() if e["grad_in"]}
        gout = {m: st.t[f"gout/{m}"] for m, e in st.entry["modules"].items() if e["grad_out"]}
        errs = bw.module_errors(st.run, gin, gout)
        errs["param"] = bw.param_errors(st.run.grads, st.idx, {n: st.t[f"pgrad/{n}"] for n in st.idx})
        for kind, by in errs.items():
            st.rows += [Row(kind, n, e, st.budget(kind, n)) for n, e in by.items()]
        st.gout = gout

    def localize(self, ctx: CheckContext, st) -> None:
        """Walking backward: the first module whose input or parameter gradient is over budget while
        the gradient it received (its output's) is within it; else the first module over budget."""
        by = {(r.kind, r.name): r for r in st.rows}
        st.first = None
        for m in st.entry["backward_order"]:
            own = [r for r in st.rows if r.kind == "param" and r.name.startswith(m + ".")]
            bad = [r for r in [by.get(("gin", m)), *own] if r is not None and not r.ok]
            got = by.get(("gout", m))
            if bad and (got is None or got.ok):
                st.first = (m, bad[0], "while the gradient it received agrees")
                return
        order = {m: i for i, m in enumerate(st.entry["backward_order"])}
        # the received (output) gradient first: it is where this module's error shows
        bad = sorted((r for r in st.rows if not r.ok),
                     key=lambda r: (order.get(_owner(r.name, order), len(order)), r.kind != "gout"))
        if bad:
            st.first = (_owner(bad[0].name, order), bad[0], "and the gradient it receives already diverges: the "
                        "loss's own backward, before every captured module")

    def replay(self, ctx: CheckContext, st) -> None:
        """Each module's isolated backward on the golden's forward inputs and output gradient."""
        from harness.models.build import torch_dtype

        st.replayed = {}
        if not st.g.structures:
            st.notes.append("golden has no recorded module inputs (sampled): no isolated backward")
            return
        tied = {a for p in st.entry["params"].values() for a in p["tied"]}
        tied |= {n for n, p in st.entry["params"].items() if p["tied"]}
        rp = bw.replay_all(st.model, st.g.structures, st.g.modules, st.g.module_inputs, st.gout,
                           torch_dtype(ctx.dtype), ctx.device, st.routes, st.context, tied,
                           {m: e["out_index"] for m, e in st.entry["modules"].items()})
        gin = {m: st.t[f"gin/{m}"] for m, e in st.entry["modules"].items() if e["grad_in"]}
        errs = bw.replay_errors(rp, gin, st.idx, {n: st.t[f"pgrad/{n}"] for n in st.idx})
        for kind, vals in errs.items():
            st.rows += [Row(f"replay_{kind}", m, e, st.budget(f"replay_{kind}", m)) for m, e in vals.items()]
        st.replayed = rp
        self._signed(ctx, st, rp, gin)

    def _signed(self, ctx: CheckContext, st, rp: dict, gin: dict) -> None:
        """The sign test of each replayed quantity against the clean dtype run's signed errors (the
        section's ``signed/<dtype>/...``): a biased backward kernel inside the magnitude budgets."""
        from harness.precision import signed

        prefix = f"signed/{ctx.dtype}/"
        clean = {k.removeprefix(prefix): v for k, v in st.t.items() if k.startswith(prefix)}
        st.signed = {}
        if not clean:
            st.notes.append(f"no backward signed-error test: the golden's training section has no clean signed "
                            f"errors for {ctx.dtype} (regenerate with `harness golden generate {ctx.suite.name} --update`)")
            return
        pref = {n: st.t[f"pgrad/{n}"] for n in st.idx}
        quantities = bw.signed_quantities(rp, gin, st.idx, pref)
        st.signed_limit = signed.limit(ctx.dtype, len(clean))
        for q, (got, r) in quantities.items():
            if q in clean:
                res = signed.signed_test(got, r, clean[q])
                if res is not None:
                    st.signed[q] = res

    def optimizer(self, ctx: CheckContext, st) -> None:
        """AdamW alone: the target's optimizer on seeded synthetic gradients, per parameter."""
        alone = bw.optimizer_alone(copy.deepcopy(st.model), st.spec, st.spec["optimizer"], st.context, st.master)
        st.rows += [Row("opt", n, bw.rel_rmse(bw.at(alone[n], i), st.t[f"opt/{n}"]), st.budget("opt", n))
                    for n, i in st.idx.items() if n in alone]

    def trajectory(self, ctx: CheckContext, st) -> None:
        """``steps`` AdamW steps on the golden's batch stream (routers forced to the golden's choices
        at every step): per-step loss, gradient norm and update norm against the reference's curve."""
        p, sp = ctx.suite.suite.checks.precision, st.spec
        vocab = st.model.config.get_text_config().vocab_size
        batches = [b.to(ctx.device) for b in bw.batch_stream(vocab, p.batch_size, p.seq_len, sp["seed"], 0, sp["steps"])]
        routes = [{r: st.t[f"troute/{s}/{r}"] for r in st.entry.get("routers", [])} for s in range(sp["steps"])]
        tr = bw.trajectory(st.model, batches, sp, sp["optimizer"], routes if st.routes else None, st.context, st.master)
        st.model = None
        st.rows += [Row("upd", n, bw.rel_rmse(bw.at(tr.delta[n], i), st.t[f"upd/{n}"]), st.budget("upd", n))
                    for n, i in st.idx.items() if n in tr.delta]
        ref = st.entry["trajectory"]
        devs = bw.trajectory_devs(tr, ref)
        st.env = {k: bw.envelope(st.clean["traj"][k], ref[k], ctx.dtype, ctx.config.budget_k, k != "loss")
                  for k in devs}
        st.traj, st.devs = tr, devs
        out = [(s, k) for s in range(sp["steps"]) for k in devs if not devs[k][s] <= st.env[k][s]]
        st.traj_out = out[0] if out else None

    def record(self, ctx: CheckContext, st) -> None:
        def worst(kinds):
            rs = [r for r in st.rows if r.kind in kinds and r.budget is not None]
            return max((r.use if math.isfinite(r.err) else math.inf for r in rs), default=0.0)

        ctx.metric("training_backward_worst_budget_use", worst(("gin", "gout", "param")))
        ctx.metric("training_backward_over_budget", sum(not r.ok for r in st.rows if r.kind in ("gin", "gout", "param")))
        ctx.metric("training_replay_worst_budget_use", worst(("replay_gin", "replay_param")))
        ctx.metric("training_optimizer_worst_budget_use", worst(("opt",)))
        ctx.metric("training_update_worst_budget_use", worst(("upd",)))
        use = max((d / e if e else math.inf) for k in st.devs for d, e in zip(st.devs[k], st.env[k], strict=True))
        ctx.metric("training_trajectory_worst_envelope_use", use)
        ctx.metric("training_trajectory_first_step_out", st.traj_out[0] if st.traj_out else -1)
        # what `harness report` plots: each module's worst backward budget use (backward order) and each
        # step's deviation with its envelope, compact
        order = {m: i for i, m in enumerate(st.entry["backward_order"])}
        per: dict[str, float] = {}
        for r in st.rows:
            if r.kind in ("gin", "gout", "param", "replay_gin", "replay_param") and r.budget is not None:
                m = _owner(r.name, order)
                per[m] = max(per.get(m, 0.0), r.use if math.isfinite(r.err) else math.inf)
        ctx.detail("module_budget_use", metrics.budget_use_json(sorted(per.items(), key=lambda kv: order.get(kv[0], len(order)))))
        ctx.detail("trajectory", json.dumps({k: [[float(f"{d:.3g}"), float(f"{e:.3g}")] for d, e in zip(st.devs[k], st.env[k], strict=True)]
                                             for k in st.devs}, separators=(",", ":")))
        ctx.metric("training_loss_abs_err", abs(st.run.loss - st.entry["loss"]))
        gn = math.sqrt(sum(g.double().pow(2).sum().item() for g in st.run.grads.values()))
        ref_gn = math.sqrt(sum(p["norm"] ** 2 for p in st.entry["params"].values()))
        ctx.metric("grad_global_norm_rel_err", abs(gn / ref_gn - 1) if ref_gn else gn)
        ctx.metric("training_unresolved", sum(r.budget is None for r in st.rows))
        if getattr(st, "signed", None):
            ctx.metric("training_signed_min_p", min(t.p for t in st.signed.values()))
            ctx.metric("training_signed_max_effect", max(abs(t.effect) for t in st.signed.values()))
        ctx.notes.extend(st.notes)

    def verdict(self, ctx: CheckContext, st) -> None:
        table = _table(st.rows)
        if st.first is not None:
            m, row, extra = st.first
            ctx.detail("first_divergent_backward_module", m)
            raise CheckFailure(f"{m}: backward diverges from the golden ({row.name} {row.text()} {extra}; "
                               f"{_replay_verdict(st, m)})", metric=f"{m}.{row.kind}_rel_rmse",
                               expected=f"<= {row.budget:.3g}", observed=f"{row.err:.4g}", tolerance=row.budget,
                               details=table)
        for kinds, what in ((("replay_gin", "replay_param"), "isolated backward diverges from the golden"),):
            bad = [r for r in st.rows if r.kind in kinds and not r.ok]
            if bad:
                order = {n: i for i, n in enumerate(st.entry["backward_order"])}
                r = min(bad, key=lambda r: order.get(r.name, len(order)))
                ctx.detail("first_divergent_backward_module", r.name)
                raise CheckFailure(f"{r.name}: {what} ({r.text()}; the gradient it received agrees propagated)",
                                   metric=f"{r.name}.{r.kind}_rel_rmse", expected=f"<= {r.budget:.3g}",
                                   observed=f"{r.err:.4g}", tolerance=r.budget, details=table)
        _signed_verdict(ctx, st, table)
        _optimizer_verdict(ctx, st, table)
        _trajectory_verdict(ctx, st, table)


def _signed_verdict(ctx: CheckContext, st, table: str) -> None:
    """The first quantity, in backward order, whose isolated backward is biased: its signed error departs
    from the clean dtype run's beyond chance (p below the item's limit) and beyond the effect floor."""
    if not getattr(st, "signed", None):
        return
    p_lim, floor = st.signed_limit
    biased = {q: t for q, t in st.signed.items() if t.p < p_lim and abs(t.effect) > floor}
    if not biased:
        return
    order = {n: i for i, n in enumerate(st.entry["backward_order"])}
    q = min(biased, key=lambda q: (order.get(_owner(q.split("/", 1)[1], order), len(order)), q))
    t, (kind, name) = biased[q], q.split("/", 1)
    what = "input gradient" if kind == "gin" else "gradient (sketch entries)"
    m = _owner(name, order)
    ctx.detail("first_divergent_backward_module", m)
    raise CheckFailure(f"{m}: isolated backward is biased: its {what} {name} has a signed error of {t.effect:+.3g} "
                       f"of its RMS against the clean {ctx.dtype} run, one sign in {t.same_sign} of {t.rows} rows "
                       f"(sign test p {t.p:.2g} < {p_lim:.2g}) while its size is within budget: a biased kernel",
                       metric=f"{name}.training_signed_p", expected=f">= {p_lim:.2g} or |effect| <= {floor:.2g}",
                       observed=f"p {t.p:.3g}, effect {t.effect:+.3g}", details=table)


def _owner(param_or_module: str, order: dict) -> str:
    """The innermost module of the backward order that a parameter (or module) belongs to."""
    parts = param_or_module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in order:
            return ".".join(parts[:i])
    return param_or_module


def _replay_verdict(st, m: str) -> str:
    rows = [r for r in st.rows if r.kind in ("replay_gin", "replay_param") and r.name == m]
    if not rows:
        return "isolated backward: no recorded inputs for it"
    bad = [r for r in rows if not r.ok]
    if bad:
        return f"isolated backward: {bad[0].text()}: the module's own backward is wrong"
    worst = max(rows, key=lambda r: r.use)
    return f"isolated backward agrees, {worst.text()}: it inherits the error"


def _groups(st, kind: str) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in st.rows:
        if r.kind == kind and not r.ok:
            out.setdefault(st.entry["params"][r.name]["group"], []).append(r)
    return out


def _optimizer_verdict(ctx: CheckContext, st, table: str) -> None:
    bad = _groups(st, "opt")
    if bad:
        g, rows = next(iter(sorted(bad.items())))
        r = max(rows, key=lambda r: r.use)
        impl = st.spec["optimizer"] + (", float32 master weights" if st.master else "")
        raise CheckFailure(f"optimizer: AdamW ({impl}) diverges from the float64 reference in the "
                           f"{g} group on seeded gradients ({len(rows)} parameter(s); worst {r.name}: {r.text()})",
                           metric=f"{r.name}.opt_rel_rmse", expected=f"<= {r.budget:.3g}", observed=f"{r.err:.4g}",
                           tolerance=r.budget, details=table)


def _trajectory_verdict(ctx: CheckContext, st, table: str) -> None:
    if st.traj_out is not None:
        s, k = st.traj_out
        raise CheckFailure(f"loss trajectory leaves the reference's envelope at step {s} ({k} deviation "
                           f"{st.devs[k][s]:.4g} > envelope {st.env[k][s]:.4g})", metric=f"trajectory_{k}",
                           expected=f"<= {st.env[k][s]:.4g}", observed=f"{st.devs[k][s]:.4g}",
                           tolerance=st.env[k][s], details=_trajectory_table(st) + "\n" + table)
    bad = _groups(st, "upd")
    if bad:
        g, rows = next(iter(sorted(bad.items())))
        r = max(rows, key=lambda r: r.use)
        raise CheckFailure(f"weights after {st.spec['steps']} AdamW steps diverge from the reference in the {g} group "
                           f"({len(rows)} parameter(s); worst {r.name}: {r.text()})", metric=f"{r.name}.upd_rel_rmse",
                           expected=f"<= {r.budget:.3g}", observed=f"{r.err:.4g}", tolerance=r.budget, details=table)


def _trajectory_table(st) -> str:
    lines = ["step  " + "  ".join(f"{k:>24}" for k in st.devs)]
    for s in range(len(st.devs["loss"])):
        lines.append(f"{s:>4}  " + "  ".join(f"{st.devs[k][s]:>11.4g} / {st.env[k][s]:<10.4g}" for k in st.devs))
    return "\n".join(lines)


def _table(rows: list[Row], n: int = 40) -> str:
    """The worst rows by budget use (failing first), one line each."""
    ranked = sorted(rows, key=lambda r: (r.ok, -(r.use if math.isfinite(r.err) else math.inf)))
    return "\n".join(f"{'FAIL' if not r.ok else 'ok  '} {r.kind:<13} {r.name:<60} {r.text()}" for r in ranked[:n])


def register(registry: CheckRegistry) -> None:
    registry.add(TrainingCheck())
