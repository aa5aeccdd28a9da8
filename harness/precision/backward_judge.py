"""The training check's judging steps as library calls (harness/checks/training.py; docs/training.md).

Every compared quantity of a run (a module's input or output gradient, a parameter's gradient sketch,
an isolated backward's, the weight change after the optimizer alone or after the trajectory's steps) is
a ``Row`` against its budget measured at golden generation (``harness.precision.backward``). From the
rows: the first module whose backward diverges (``first_divergent``), the figures the check records
(``figures``, ``plots``, ``run_figures``) and the one failure it raises (``failure``: the first
divergent module, else an isolated backward over budget, a biased one, the optimizer, the trajectory).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from harness import metrics
from harness.precision import backward as bw

BACKWARD = ("gin", "gout", "param")
REPLAY = ("replay_gin", "replay_param")


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


@dataclass
class Failure:
    message: str
    fields: dict  # CheckFailure's metric, expected, observed, tolerance, details
    module: str | None = None  # the first_divergent_backward_module detail, where one module is named


@dataclass
class Trajectory:
    """The trajectory's per-step deviations from the reference's curve, their envelopes, and the
    first (step, quantity) outside its envelope (None: every step within)."""

    devs: dict[str, list[float]]
    env: dict[str, list[float]]
    out: tuple[int, str] | None = None


def rows(errs: dict[str, dict[str, float]], budget, prefix: str = "") -> list[Row]:
    """One row per quantity of ``errs`` (kind -> name -> error), kinds prefixed with ``prefix``, each
    against ``budget(kind, name)``; in the order of ``errs``."""
    return [Row(prefix + kind, n, e, budget(prefix + kind, n)) for kind, by in errs.items() for n, e in by.items()]


def weight_errors(got: dict[str, torch.Tensor], idx: dict[str, torch.Tensor], t: dict, kind: str) -> dict[str, float]:
    """rel_rmse of each parameter's weight change (its sketch entries ``idx``) against the golden's
    ``<kind>/<name>`` (``opt``: the optimizer alone; ``upd``: after the trajectory's steps)."""
    return {n: bw.rel_rmse(bw.at(got[n], i), t[f"{kind}/{n}"]) for n, i in idx.items() if n in got}


def owner(param_or_module: str, order: dict) -> str:
    """The innermost module of the backward order that a parameter (or module) belongs to."""
    parts = param_or_module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in order:
            return ".".join(parts[:i])
    return param_or_module


def first_divergent(rs: list[Row], backward_order: list[str]) -> tuple[str, Row, str] | None:
    """Walking backward: the first module whose input or parameter gradient is over budget while
    the gradient it received (its output's) is within it; else the first module over budget.
    (module, its worst row, why it is the one) or None when every row is within budget."""
    by = {(r.kind, r.name): r for r in rs}
    for m in backward_order:
        own = [r for r in rs if r.kind == "param" and r.name.startswith(m + ".")]
        bad = [r for r in [by.get(("gin", m)), *own] if r is not None and not r.ok]
        got = by.get(("gout", m))
        if bad and (got is None or got.ok):
            return m, bad[0], "while the gradient it received agrees"
    order = {m: i for i, m in enumerate(backward_order)}
    # the received (output) gradient first: it is where this module's error shows
    bad = sorted((r for r in rs if not r.ok), key=lambda r: (order.get(owner(r.name, order), len(order)), r.kind != "gout"))
    if bad:
        return (owner(bad[0].name, order), bad[0], "and the gradient it receives already diverges: the "
                "loss's own backward, before every captured module")
    return None


def trajectory(tr: bw.Trajectory, ref: dict, clean: dict, dtype: str, k: float, steps: int) -> Trajectory:
    """Deviations of the run's trajectory ``tr`` from the reference's curve ``ref``, against the
    envelope measured at golden generation (``clean``: the section's clean per-step maxima)."""
    devs = bw.trajectory_devs(tr, ref)
    env = {q: bw.envelope(clean[q], ref[q], dtype, k, q != "loss") for q in devs}
    out = [(s, q) for s in range(steps) for q in devs if not devs[q][s] <= env[q][s]]
    return Trajectory(devs, env, out[0] if out else None)


def signed_tests(t: dict, dtype: str, rp: dict, gin: dict, idx: dict) -> tuple[dict, tuple[float, float]] | None:
    """The sign test of each replayed quantity against the clean dtype run's signed errors (the
    section's ``signed/<dtype>/...``): a biased backward kernel inside the magnitude budgets.
    (quantity -> test, the item's (p limit, effect floor)); None when the golden has no clean ones."""
    from harness.precision import signed

    prefix = f"signed/{dtype}/"
    clean = {k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix)}
    if not clean:
        return None
    quantities = bw.signed_quantities(rp, gin, idx, {n: t[f"pgrad/{n}"] for n in idx})
    limit = signed.limit(dtype, len(clean))
    tests = {}
    for q, (got, r) in quantities.items():
        if q in clean:
            res = signed.signed_test(got, r, clean[q])
            if res is not None:
                tests[q] = res
    return tests, limit


def _worst(rs: list[Row], kinds: tuple[str, ...]) -> float:
    judged = [r for r in rs if r.kind in kinds and r.budget is not None]
    return max((r.use if math.isfinite(r.err) else math.inf for r in judged), default=0.0)


def figures(rs: list[Row], traj: Trajectory) -> dict[str, float]:
    """The worst budget use of each kind of quantity and of the trajectory (metrics, in record order)."""
    use = max((d / e if e else math.inf) for q in traj.devs for d, e in zip(traj.devs[q], traj.env[q], strict=True))
    return {"training_backward_worst_budget_use": _worst(rs, BACKWARD),
            "training_backward_over_budget": sum(not r.ok for r in rs if r.kind in BACKWARD),
            "training_replay_worst_budget_use": _worst(rs, REPLAY),
            "training_optimizer_worst_budget_use": _worst(rs, ("opt",)),
            "training_update_worst_budget_use": _worst(rs, ("upd",)),
            "training_trajectory_worst_envelope_use": use,
            "training_trajectory_first_step_out": traj.out[0] if traj.out else -1}


def plots(rs: list[Row], traj: Trajectory, backward_order: list[str]) -> dict[str, str]:
    """What `harness report` plots (details): each module's worst backward budget use (backward order)
    and each step's deviation with its envelope, compact."""
    order = {m: i for i, m in enumerate(backward_order)}
    per: dict[str, float] = {}
    for r in rs:
        if r.kind in BACKWARD + REPLAY and r.budget is not None:
            m = owner(r.name, order)
            per[m] = max(per.get(m, 0.0), r.use if math.isfinite(r.err) else math.inf)
    return {"module_budget_use": metrics.budget_use_json(sorted(per.items(), key=lambda kv: order.get(kv[0], len(order)))),
            "trajectory": json.dumps({q: [[float(f"{d:.3g}"), float(f"{e:.3g}")]
                                          for d, e in zip(traj.devs[q], traj.env[q], strict=True)]
                                      for q in traj.devs}, separators=(",", ":"))}


def run_figures(run: bw.GradRun, entry: dict, rs: list[Row], signed: dict | None) -> dict[str, float]:
    """The first backward's loss and global gradient norm against the golden's, the unresolved count
    and, where the sign test ran, its smallest p and largest effect (metrics, in record order)."""
    gn = math.sqrt(sum(g.double().pow(2).sum().item() for g in run.grads.values()))
    ref_gn = math.sqrt(sum(p["norm"] ** 2 for p in entry["params"].values()))
    out = {"training_loss_abs_err": abs(run.loss - entry["loss"]),
           "grad_global_norm_rel_err": abs(gn / ref_gn - 1) if ref_gn else gn,
           "training_unresolved": sum(r.budget is None for r in rs)}
    if signed:
        out["training_signed_min_p"] = min(t.p for t in signed.values())
        out["training_signed_max_effect"] = max(abs(t.effect) for t in signed.values())
    return out


def failure(rs: list[Row], first: tuple[str, Row, str] | None, entry: dict, signed: dict | None,
            signed_limit: tuple[float, float] | None, dtype: str, spec: dict, master: bool,
            traj: Trajectory) -> Failure | None:
    """The item's failure, the first that applies: the first divergent module (with its isolated
    backward's verdict), an isolated backward over budget, a biased one, the optimizer alone, the
    trajectory, the weights after it (``entry``: the golden's training section). None: the run is
    within every budget."""
    table, backward_order, params = _table(rs), entry["backward_order"], entry["params"]
    if first is not None:
        m, row, extra = first
        return Failure(f"{m}: backward diverges from the golden ({row.name} {row.text()} {extra}; "
                       f"{_replay_verdict(rs, m)})",
                       dict(metric=f"{m}.{row.kind}_rel_rmse", expected=f"<= {row.budget:.3g}", observed=f"{row.err:.4g}",
                            tolerance=row.budget, details=table), module=m)
    bad = [r for r in rs if r.kind in REPLAY and not r.ok]
    if bad:
        order = {n: i for i, n in enumerate(backward_order)}
        r = min(bad, key=lambda r: order.get(r.name, len(order)))
        return Failure(f"{r.name}: isolated backward diverges from the golden ({r.text()}; the gradient it "
                       "received agrees propagated)",
                       dict(metric=f"{r.name}.{r.kind}_rel_rmse", expected=f"<= {r.budget:.3g}", observed=f"{r.err:.4g}",
                            tolerance=r.budget, details=table), module=r.name)
    return (_signed_failure(signed, signed_limit, backward_order, dtype, table)
            or _optimizer_failure(rs, params, spec, master, table) or _trajectory_failure(rs, traj, params, spec, table))


def _signed_failure(signed: dict | None, limit: tuple[float, float] | None, backward_order: list[str], dtype: str,
                    table: str) -> Failure | None:
    """The first quantity, in backward order, whose isolated backward is biased: its signed error departs
    from the clean dtype run's beyond chance (p below the item's limit) and beyond the effect floor."""
    if not signed:
        return None
    p_lim, floor = limit
    biased = {q: t for q, t in signed.items() if t.p < p_lim and abs(t.effect) > floor}
    if not biased:
        return None
    order = {n: i for i, n in enumerate(backward_order)}
    q = min(biased, key=lambda q: (order.get(owner(q.split("/", 1)[1], order), len(order)), q))
    t, (kind, name) = biased[q], q.split("/", 1)
    what = "input gradient" if kind == "gin" else "gradient (sketch entries)"
    m = owner(name, order)
    return Failure(f"{m}: isolated backward is biased: its {what} {name} has a signed error of {t.effect:+.3g} "
                   f"of its RMS against the clean {dtype} run, one sign in {t.same_sign} of {t.rows} rows "
                   f"(sign test p {t.p:.2g} < {p_lim:.2g}) while its size is within budget: a biased kernel",
                   dict(metric=f"{name}.training_signed_p", expected=f">= {p_lim:.2g} or |effect| <= {floor:.2g}",
                        observed=f"p {t.p:.3g}, effect {t.effect:+.3g}", details=table), module=m)


def _replay_verdict(rs: list[Row], m: str) -> str:
    own = [r for r in rs if r.kind in REPLAY and r.name == m]
    if not own:
        return "isolated backward: no recorded inputs for it"
    bad = [r for r in own if not r.ok]
    if bad:
        return f"isolated backward: {bad[0].text()}: the module's own backward is wrong"
    worst = max(own, key=lambda r: r.use)
    return f"isolated backward agrees, {worst.text()}: it inherits the error"


def _groups(rs: list[Row], kind: str, params: dict) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rs:
        if r.kind == kind and not r.ok:
            out.setdefault(params[r.name]["group"], []).append(r)
    return out


def _optimizer_failure(rs: list[Row], params: dict, spec: dict, master: bool, table: str) -> Failure | None:
    bad = _groups(rs, "opt", params)
    if not bad:
        return None
    g, group = next(iter(sorted(bad.items())))
    r = max(group, key=lambda r: r.use)
    impl = spec["optimizer"] + (", float32 master weights" if master else "")
    return Failure(f"optimizer: AdamW ({impl}) diverges from the float64 reference in the "
                   f"{g} group on seeded gradients ({len(group)} parameter(s); worst {r.name}: {r.text()})",
                   dict(metric=f"{r.name}.opt_rel_rmse", expected=f"<= {r.budget:.3g}", observed=f"{r.err:.4g}",
                        tolerance=r.budget, details=table))


def _trajectory_failure(rs: list[Row], traj: Trajectory, params: dict, spec: dict, table: str) -> Failure | None:
    if traj.out is not None:
        s, k = traj.out
        return Failure(f"loss trajectory leaves the reference's envelope at step {s} ({k} deviation "
                       f"{traj.devs[k][s]:.4g} > envelope {traj.env[k][s]:.4g})",
                       dict(metric=f"trajectory_{k}", expected=f"<= {traj.env[k][s]:.4g}", observed=f"{traj.devs[k][s]:.4g}",
                            tolerance=traj.env[k][s], details=_trajectory_table(traj) + "\n" + table))
    bad = _groups(rs, "upd", params)
    if not bad:
        return None
    g, group = next(iter(sorted(bad.items())))
    r = max(group, key=lambda r: r.use)
    return Failure(f"weights after {spec['steps']} AdamW steps diverge from the reference in the {g} group "
                   f"({len(group)} parameter(s); worst {r.name}: {r.text()})",
                   dict(metric=f"{r.name}.upd_rel_rmse", expected=f"<= {r.budget:.3g}", observed=f"{r.err:.4g}",
                        tolerance=r.budget, details=table))


def _trajectory_table(traj: Trajectory) -> str:
    lines = ["step  " + "  ".join(f"{k:>24}" for k in traj.devs)]
    for s in range(len(traj.devs["loss"])):
        lines.append(f"{s:>4}  " + "  ".join(f"{traj.devs[k][s]:>11.4g} / {traj.env[k][s]:<10.4g}" for k in traj.devs))
    return "\n".join(lines)


def _table(rs: list[Row], n: int = 40) -> str:
    """The worst rows by budget use (failing first), one line each."""
    ranked = sorted(rs, key=lambda r: (r.ok, -(r.use if math.isfinite(r.err) else math.inf)))
    return "\n".join(f"{'FAIL' if not r.ok else 'ok  '} {r.kind:<13} {r.name:<60} {r.text()}" for r in ranked[:n])
