"""Check ``rehearse`` (nightly scope): the plan's top layout for the suite's declared cluster, rehearsed at
its real world size (issue #48 item 4).

One item per suite, in its ``cpu`` item of the first dtype (the rehearsal needs no device: the
full-size model on the meta device, every sampled rank on torch's fake process group, each in a
forked child; the other backend x dtype items say so in one line). Suites without a ``[plan]`` table
have no cluster to rehearse and skip naming it. Steps, over ``harness.parallel.plan`` and
``harness.parallel.rehearse`` (the same functions as ``harness plan SUITE --rehearse``):

``plan``      the plan of the full-size model for ``[plan]`` (devices x nodes, device memory, mode) and
              its top layout, or ``layout``; none that fits the cluster fails here;
``rehearse``  the parallel check's own parallelization, forward, backward and gradient reductions of
              that layout on the sampled ranks (``rehearse.rehearse``);
``record``    sampled ranks, seconds, collectives and parameters of the largest rank, the plan's
              per-device figures against it (a note over ``memory_tolerance``), the rehearsal's text;
``verdict``   a divisibility error, a rank that failed to parallelize or a predicted hang (ranks that
              share a group issuing different collectives) fails the item, naming it.

So a transformers or harness change that breaks parallelizing the full model shows the night after,
before any device is booked. Numerics are the parallel check's job (pruned model, real ranks).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable

metrics.declare("rehearse_ranks", "", "none", "ranks of the production world size the rehearsal sampled")
metrics.declare("rehearse_s", "s", "lower", "wall time of the rehearsal (every sampled rank, forked one after another)")
metrics.declare("rehearse_collectives", "", "none", "collectives (and pipeline sends/receives) the busiest sampled "
                "rank issues in one forward + backward step")
metrics.declare("rehearse_param_gib", "GiB", "none", "parameter bytes the largest sampled rank holds (its local shards)")
metrics.declare("rehearse_plan_memory_error", "", "lower", "largest |relative error| of harness plan's per-device "
                "weights, gradients and optimizer state against the largest rehearsed rank (training plans)")


class RehearseConfig(CheckConfig):
    """The plan's top layout rehearsed at the suite's [plan] cluster size (meta device, fake process group)."""

    scope: Literal["commit", "nightly"] = Field(
        "nightly", description="Full-size rehearsal at the production world size (tens of seconds a suite): "
        "nightly by default (`harness run --scope nightly`).")
    layout: str = Field(
        "best", description="'best': the top layout `harness plan` ranks for the suite's [plan] cluster; else a "
        "parallel-check layout name (e.g. ep32xtp8xpp4) with devices x nodes ranks.")
    # Bounds far above any production step (a million sequences, 16M tokens: Llama 4 Scout's window is
    # 10M) and below what would make the pipeline's microbatch arithmetic or the plan's figures absurd.
    batch: int = Field(1, ge=1, le=2**20, description="Sequences per step (as `harness plan --batch`).")
    context: int = Field(4096, ge=1, le=2**24, description="Tokens per sequence (as `harness plan --context`).")
    memory_tolerance: float = Field(
        0.05, gt=0, le=1, allow_inf_nan=False, description="Largest relative error of the plan's per-device weights, "
        "gradients and optimizer state against the largest rehearsed rank before a note says so.")

    @field_validator("layout")
    @classmethod
    def _layout_name(cls, v: str) -> str:
        if v != "best":
            from harness.parallel.layouts import parse_name

            parse_name(v)  # ValueError naming the bad name, at suite load
        return v


class RehearseCheck(Check):
    name = "rehearse"
    order = 55  # after the parallel check's items
    cpu_threads = 1  # meta tensors: nothing to compute, no thread to spin
    config_model = RehearseConfig
    description = "The plan's top layout at the [plan] cluster's world size: meta device, fake process group (nightly)."
    headline = ("rehearse_ranks", "rehearse_s")
    steps = ("plan", "rehearse", "record", "verdict")
    setup_steps = ("plan",)  # a plan that cannot be made (the config, a named layout's world) is not the model's

    def new_state(self, ctx: CheckContext):
        from types import SimpleNamespace

        return SimpleNamespace(fault=None)  # tests plant a collective-order mismatch: fault(rank, rr)

    def plan(self, ctx: CheckContext, st) -> None:
        from harness.inspect.params import Target
        from harness.parallel import plan, rehearse

        suite = ctx.suite.suite
        if suite.plan is None:
            raise NotApplicable("no [plan] table: the suite declares no cluster to rehearse")
        if ctx.backend.device_type != "cpu" or ctx.dtype != suite.dtypes[0]:
            raise NotApplicable(f"rehearsed once per suite, in its cpu-{suite.dtypes[0]} item (meta device, "
                                "fake process group: no device needed)")
        cfg = st.cfg = ctx.config
        p = suite.plan
        st.target = Target(ctx.suite.name, ctx.suite.raw_config, ctx.suite, ctx.suite.path)
        world, rep = p.devices * p.nodes, None
        if cfg.layout == "best":  # a named layout needs no plan: its world is checked against the cluster's
            facts = plan.model_facts(st.target, "checkpoint", cfg.context)
            rep = plan.plan(facts, devices_per_node=p.devices, nodes=p.nodes, mode=p.mode, batch=cfg.batch,
                            device_memory=plan.parse_bytes(f"{p.device_memory_gib}GiB"), context=cfg.context)
            if not (rep.ranked and rep.ranked[0].fits):
                raise CheckFailure(f"no layout of {ctx.suite.name} fits its [plan] cluster: {rep.recommendation}",
                                   metric="plan", details=plan.render(rep))
        st.layout, est, st.skipped = rehearse.chosen_layout(cfg.layout, world, rep, mode=p.mode, batch=cfg.batch)
        st.plan_bytes, st.plan_messages = rehearse.plan_figures(est, rep, p.mode), rehearse.plan_messages(est)
        ctx.detail("rehearse_layout", st.layout.label)

    def rehearse(self, ctx: CheckContext, st) -> None:
        from harness.parallel import rehearse

        st.res = rehearse.rehearse(st.target, st.layout, batch=st.cfg.batch, context=st.cfg.context, fault=st.fault)
        st.res.plan_bytes, st.res.plan_messages = st.plan_bytes, st.plan_messages
        st.res.notes[:0] = st.skipped
        st.res.training = ctx.suite.suite.plan.mode == "training"

    def record(self, ctx: CheckContext, st) -> None:
        from harness.parallel import rehearse

        res = st.res
        ctx.detail("rehearsal", rehearse.render(res))
        ctx.notes.extend(res.notes)
        ctx.metric("rehearse_ranks", len(res.ranks))
        ctx.metric("rehearse_s", round(res.seconds, 2))
        ok = [r for r in res.ranks if not r.error]
        if ok:
            ctx.metric("rehearse_collectives", max(len(r.collectives) for r in ok))
            ctx.metric("rehearse_param_gib", max(r.param_bytes for r in ok) / 2**30)
        ctx.notes.extend(f"rank {r.rank}: {r.recorded}" for r in ok if r.recorded != "forward+backward")
        errors = rehearse.plan_errors(res)
        if errors:
            key = max(errors, key=lambda k: abs(errors[k]))
            tol = st.cfg.memory_tolerance
            ctx.tolerance("rehearse_plan_memory_error", tol)
            ctx.metric("rehearse_plan_memory_error", abs(errors[key]))
            # Over the tolerance it is harness's plan that is off (its memory model against what the
            # parallel check's steps really hold), not the model: a note for harness, not the item's failure.
            if abs(errors[key]) > tol:
                ctx.notes.append(f"harness plan's {key} per device is {errors[key]:+.1%} off the largest rehearsed "
                                 f"rank (tolerance {tol:.0%}): the plan's memory model needs correcting")

    def verdict(self, ctx: CheckContext, st) -> None:
        from harness.parallel import rehearse

        res = st.res
        where = f"{res.layout} at {res.world} ranks"
        found = [f"divisibility error in {where}: {e}" for e in res.errors]
        for r in res.ranks:
            if r.error:
                coords = " ".join(f"{k}{v}" for k, v in r.coords.items()) or "-"
                found.append(f"rank {r.rank} [{coords}] of {where} failed to parallelize: "
                             f"{r.error.removeprefix('parallelize: ')}")
        found += [f"{h} ({where})" for h in res.hangs]
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise CheckFailure(found[0] + more, metric="rehearsal", expected="no finding",
                               observed=f"{len(found)} finding(s)", details="\n".join(found) + "\n\n" +
                               rehearse.render(res))


def register(registry: CheckRegistry) -> None:
    registry.add(RehearseCheck())
