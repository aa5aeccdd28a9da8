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

Each step is a call of harness/precision/backward.py (the target's runs and their errors against the
golden) or harness/precision/backward_judge.py (rows against budgets, the first divergent module, the
figures recorded, the one failure raised).
"""

from __future__ import annotations

import copy
import json
import math
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
from harness.precision import backward_judge as judge
from harness.precision import kernels

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
    machine_budgets: bool = Field(True, description="On a device other than the CPU, also measure the weight "
                                  "change's clean error on this machine's CPU (the check's stream, once per kernel "
                                  "choice) and judge it against the larger budget: the golden's is measured on the "
                                  "machine that made it, and another machine's order of arithmetic moves the few "
                                  "sign-following entries of an AdamW update otherwise. The CPU's own item keeps "
                                  "the golden's (measuring the CPU under test would excuse its own faults).")

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
    steps = ("golden", "budgets", "machine", "backward", "localize", "replay", "optimizer", "trajectory", "record",
             "verdict")
    setup_steps = ("golden", "budgets", "machine")
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
            mb = st.entry["budgets"].get(ctx.dtype + bw.MASTER) or {}
            st.clean = {**st.clean, **mb, "bound": {**st.clean.get("bound", {}), **mb.get("bound", {})}}
            if ctx.dtype + bw.MASTER not in st.entry["budgets"]:
                raise CouldNotRun(f"the golden's training section has no {ctx.dtype} master-weight budgets; regenerate "
                                  f"with `harness golden generate {ctx.suite.name} --update`", step="budgets")
        k = ctx.config.budget_k
        # the larger of k x the clean maximum and the clean errors' spread bound over kernel choices and
        # draws (issue #50; goldens made before it have no bounds: k x max alone)
        bound = st.clean.get("bound", {})
        st.budget = lambda kind, name: bw.budget(st.clean.get(kind, {}).get(name, math.inf), ctx.dtype, k,
                                                 bound.get(kind, {}).get(name))
        st.routes = {r: st.t[f"route/{r}"] for r in st.entry.get("routers", [])}
        st.idx = {n: st.t[f"pidx/{n}"] for n in st.entry["params"]}
        ctx.detail("budget_source", f"measured clean error x {k:g} (or its spread's 99.9 % prediction bound over "
                   f"kernel choices, where larger) + floor over {st.entry.get('draws')} draws "
                   f"({ctx.dtype}); above the ceiling {bw.CEILINGS.get(ctx.dtype, bw.CEILINGS['float32']):g}: not judged")

    def machine(self, ctx: CheckContext, st) -> None:
        """On a device other than the CPU: the weight change's clean error measured on this machine's
        CPU (``bw.machine_update_errors``), its budget the larger of the golden's and this machine's."""
        import torch

        from harness.backends import get
        from harness.precision.runner import build_target

        st.machine = {}
        if torch.device(ctx.device).type == "cpu" or not ctx.config.machine_budgets:
            return
        model, _ = build_target(ctx.suite, get("cpu"), ctx.dtype, None, st.g)
        st.machine = bw.machine_update_errors(model, self._batches(ctx, st, model, "cpu"), st.spec, st.idx,
                                              {n: st.t[f"upd/{n}"] for n in st.idx}, self._routes(st), st.master)
        golden, k = st.budget, ctx.config.budget_k
        st.budget = lambda kind, name: (bw.widened(golden(kind, name), st.machine.get(name), ctx.dtype, k)
                                        if kind == "upd" else golden(kind, name))
        wider = {n: round(st.budget("upd", n) / golden("upd", n), 3) for n in st.idx
                 if golden("upd", n) and st.budget("upd", n) > golden("upd", n)}
        ctx.detail("machine_budgets", json.dumps({"worst_clean": max((max(v) for v in st.machine.values()), default=0.0),
                                                  "widened": wider}))
        if wider:
            top = max(wider, key=wider.get)
            st.notes.append(f"weight-change budgets of {len(wider)} parameter(s) widened to this machine's own clean "
                            f"error (CPU, {len(kernels.KERNELS)} kernel choices; largest x{wider[top]:g}: {top})")

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
        st.rows += judge.rows(errs, st.budget)
        st.gout = gout

    def localize(self, ctx: CheckContext, st) -> None:
        """Walking backward: the first module whose input or parameter gradient is over budget while
        the gradient it received (its output's) is within it; else the first module over budget."""
        st.first = judge.first_divergent(st.rows, st.entry["backward_order"])

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
        st.rows += judge.rows(bw.replay_errors(rp, gin, st.idx, {n: st.t[f"pgrad/{n}"] for n in st.idx}), st.budget,
                              prefix="replay_")
        st.replayed = rp
        self._signed(ctx, st, rp, gin)

    def _signed(self, ctx: CheckContext, st, rp: dict, gin: dict) -> None:
        """The sign test of each replayed quantity against the clean dtype run's signed errors (the
        section's ``signed/<dtype>/...``): a biased backward kernel inside the magnitude budgets."""
        st.signed = {}
        tested = judge.signed_tests(st.t, ctx.dtype, rp, gin, st.idx)
        if tested is None:
            st.notes.append(f"no backward signed-error test: the golden's training section has no clean signed "
                            f"errors for {ctx.dtype} (regenerate with `harness golden generate {ctx.suite.name} --update`)")
            return
        st.signed, st.signed_limit = tested

    def optimizer(self, ctx: CheckContext, st) -> None:
        """AdamW alone: the target's optimizer on seeded synthetic gradients, per parameter."""
        alone = bw.optimizer_alone(copy.deepcopy(st.model), st.spec, st.spec["optimizer"], st.context, st.master)
        st.rows += judge.rows({"opt": judge.weight_errors(alone, st.idx, st.t, "opt")}, st.budget)

    def trajectory(self, ctx: CheckContext, st) -> None:
        """``steps`` AdamW steps on the golden's batch stream (routers forced to the golden's choices
        at every step): per-step loss, gradient norm and update norm against the reference's curve."""
        sp = st.spec
        st.traj = bw.trajectory(st.model, self._batches(ctx, st, st.model, ctx.device), sp, sp["optimizer"],
                                self._routes(st), st.context, st.master)
        st.model = None
        st.rows += judge.rows({"upd": judge.weight_errors(st.traj.delta, st.idx, st.t, "upd")}, st.budget)
        st.judged = judge.trajectory(st.traj, st.entry["trajectory"], st.clean["traj"], ctx.dtype, ctx.config.budget_k,
                                     sp["steps"])

    @staticmethod
    def _batches(ctx: CheckContext, st, model, device) -> list:
        """The golden's batch stream (draw 0): ``steps`` batches [B, S] on ``device``."""
        p, sp = ctx.suite.suite.checks.precision, st.spec
        vocab = model.config.get_text_config().vocab_size
        return [b.to(device) for b in bw.batch_stream(vocab, p.batch_size, p.seq_len, sp["seed"], 0, sp["steps"])]

    @staticmethod
    def _routes(st) -> list | None:
        """The golden's router choices at every step (None for a model without routers)."""
        if not st.routes:
            return None
        return [{r: st.t[f"troute/{s}/{r}"] for r in st.entry.get("routers", [])} for s in range(st.spec["steps"])]

    def record(self, ctx: CheckContext, st) -> None:
        for name, v in judge.figures(st.rows, st.judged).items():
            ctx.metric(name, v)
        for key, text in judge.plots(st.rows, st.judged, st.entry["backward_order"]).items():
            ctx.detail(key, text)
        for name, v in judge.run_figures(st.run, st.entry, st.rows, getattr(st, "signed", None)).items():
            ctx.metric(name, v)
        ctx.notes.extend(st.notes)

    def verdict(self, ctx: CheckContext, st) -> None:
        found = judge.failure(st.rows, st.first, st.entry, getattr(st, "signed", None), getattr(st, "signed_limit", None),
                              ctx.dtype, st.spec, st.master, st.judged)
        if found is None:
            return
        if found.module is not None:
            ctx.detail("first_divergent_backward_module", found.module)
        raise CheckFailure(found.message, **found.fields)


def register(registry: CheckRegistry) -> None:
    registry.add(TrainingCheck())
