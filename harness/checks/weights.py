"""Check ``weights`` (nightly scope): the suite's real checkpoint, at full size.

Enabled only for suites that declare weights (``model.weights`` / ``model.weights_env``); where the
checkpoint is not on this machine the items skip with the reason (``$HARNESS_WEIGHTS_KIMI is not
set``). Two variants:

``layout``  every tensor the full model expects (meta-device model in the config's dtype, taken to
            checkpoint keys by transformers' reverse conversion) exists with that shape and dtype;
            missing, unexpected and mismatched tensors are listed; shards are checksummed against
            the manifest ``harness weights manifest DIR`` recorded. Headers and files only: no model
            is built, so it runs at any size (once per suite: on cpu, first dtype).
``stream``  the full model runs on the backend in the item's dtype, capturing the hidden states at
            every decoder-layer boundary; the host recomputes each layer in float64 from the shards,
            one layer at a time, fed the target's own input to that layer (MoE: only routed experts
            are read). Per-layer error and the first divergent layer. Skipped with the sizes when the
            model does not fit.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

import torch
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable
from harness.suite.loader import LoadedSuite

metrics.declare("tensors_expected", "", "none", "tensors the full model expects in its checkpoint")
metrics.declare("tensors_missing", "", "lower", "expected tensors absent from the checkpoint")
metrics.declare("tensors_unexpected", "", "lower", "checkpoint tensors the model does not use")
metrics.declare("tensors_mismatched", "", "lower", "tensors whose shape or dtype differs from the config's")
metrics.declare("shards_bad", "", "lower", "shards missing, resized or with another checksum than the manifest")
metrics.declare("checkpoint_bytes", "B", "none", "bytes of all shards")
metrics.declare("stream_layers", "", "none", "decoder layers compared against the streamed float64 reference")
metrics.declare("stream_first_divergent_layer", "", "none", "first layer over tolerance (-1: none)")
metrics.declare("stream_worst_rel_rmse", "", "lower", "largest per-layer rel_rmse against the float64 reference")
metrics.declare("stream_reference_bytes_read", "B", "none", "bytes the streamed reference read from the shards")
metrics.declare("stream_near_tie_flips", "", "none", "tokens the target routed otherwise than the float64 router "
                "would, at a near tie (followed by the reference)")
metrics.declare("stream_devices", "", "none", "devices the full-size target was placed over (decoder layers split in order)")


class WeightsConfig(CheckConfig):
    """Real checkpoint at full size: tensor layout and checksums; streamed float64 per-layer precision."""

    scope: Literal["commit", "nightly"] = Field(
        "nightly", description="Full-size work (checksums of every shard, the whole model on the device): "
        "nightly by default (`harness run --scope nightly`).")
    manifest: str | None = Field(
        None, description="Manifest path relative to the suite file (default: <checkpoint>/harness-manifest.json).")
    require_manifest: bool = Field(
        False, description="Fail when no manifest is recorded (otherwise: a note, and no checksums).")
    allow_unexpected: list[str] = Field(
        default_factory=list, description="fnmatch globs of checkpoint tensors the model may leave unused.")
    prompts: int = Field(2, ge=1, description="Prompts (batch rows) for the streamed precision run.")
    seq_len: int = Field(16, ge=2, description="Tokens per prompt for the streamed precision run.")
    seed: int = Field(0, description="Seed of the prompt tokens.")
    rel_rmse: dict[str, float] = Field(
        default_factory=lambda: {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3},
        description="Per target dtype, the largest rel_rmse of one layer's output fed its exact input.")
    router: dict[str, float] = Field(
        default_factory=lambda: {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2**-6, "float16": 2**-9},
        description="Per target dtype, the router-logit noise (relative to the router's largest logit): the "
        "reference follows the target's routing, and a token the target routed otherwise than the float64 "
        "router would is a near tie within 2x this, a routing fault beyond.")
    memory_fraction: float = Field(
        0.8, gt=0, le=1, description="Share of each device's free memory the full model may take (the rest is "
        "left for activations); the CPU backend's one device is the host's available memory.")
    devices: int | None = Field(
        None, ge=1, description="At most this many devices of the backend for the streamed run (default: every "
        "device it has). The decoder layers are split over them in order where one does not hold the model.")


def _config_dtype(raw: dict) -> torch.dtype:
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return getattr(torch, str(name), torch.bfloat16)


class WeightsCheck(Check):
    name = "weights"
    order = 70
    config_model = WeightsConfig
    description = "Real checkpoint at full size: layout, checksums, streamed float64 per-layer precision (nightly)."
    headline = ("tensors_missing", "stream_worst_rel_rmse")
    steps = ("locate", "checkpoint", "checksums", "layout", "fit", "capture", "reference")
    setup_steps = ("locate", "fit", "capture")

    def enabled(self, suite: LoadedSuite) -> bool:
        from harness.weights.source import has_weights

        return bool(self.config(suite).enabled) and has_weights(suite)

    def variants(self, suite: LoadedSuite, backend) -> list[str | None]:
        return ["layout", "stream"]

    # -- both variants ------------------------------------------------------------------------
    def locate(self, ctx: CheckContext, st) -> None:
        from harness.weights.source import locate

        st.cfg = ctx.config
        loc = locate(ctx.suite)
        if loc.path is None:
            raise NotApplicable(loc.reason)
        if ctx.variant == "layout" and (ctx.backend.device_type != "cpu" or ctx.dtype != ctx.suite.suite.dtypes[0]):
            raise NotApplicable(f"the checkpoint layout is checked once per suite (cpu, {ctx.suite.suite.dtypes[0]})")
        st.path = loc.path

    def checkpoint(self, ctx: CheckContext, st) -> None:
        """Open the index and every shard header: a truncated shard or a broken index fails here."""
        from harness.weights.layout import WeightsError, open_checkpoint

        try:
            st.ckpt = open_checkpoint(st.path, allow_pickle=ctx.suite.suite.model.weights_allow_pickle)
        except WeightsError as e:
            raise CheckFailure(str(e), metric="checkpoint") from None
        ctx.metric("checkpoint_bytes", st.ckpt.total_bytes)

    # -- layout --------------------------------------------------------------------------------
    def checksums(self, ctx: CheckContext, st) -> None:
        if ctx.variant != "layout":
            return
        from harness.weights.layout import WeightsError
        from harness.weights.manifest import MANIFEST_NAME, read_manifest, verify

        cfg = st.cfg
        mpath = (ctx.suite.path.parent / cfg.manifest).resolve() if cfg.manifest else st.ckpt.root / MANIFEST_NAME
        if not mpath.is_file():
            msg = f"no manifest at {mpath}: shards not checksummed (record one: harness weights manifest {st.ckpt.root})"
            if cfg.require_manifest:
                raise CheckFailure(msg, metric="manifest")
            ctx.notes.append(msg)
            return
        try:
            problems = verify(st.ckpt, read_manifest(mpath))
        except WeightsError as e:
            raise CheckFailure(str(e), metric="manifest") from None
        ctx.metric("shards_bad", len(problems))
        if problems:
            raise CheckFailure(f"{len(problems)} checkpoint file(s) differ from the manifest: {problems[0]}",
                               metric="shards_bad", expected=0, observed=len(problems), details="\n".join(problems))

    def layout(self, ctx: CheckContext, st) -> None:
        if ctx.variant != "layout":
            return
        from harness.models.build import instantiate
        from harness.models.config import build_config
        from harness.weights.expected import compare

        m = ctx.suite.suite.model
        mc = build_config(ctx.suite.raw_config, None, architecture=m.architecture, trust_remote_code=m.trust_remote_code)
        with torch.device("meta"):
            model = instantiate(ctx.suite, mc, torch.float32)
        rep = compare(model.to(_config_dtype(ctx.suite.raw_config)), st.ckpt)
        allowed = st.cfg.allow_unexpected
        rep.unexpected = [u for u in rep.unexpected if not any(fnmatch.fnmatchcase(u.split(" ")[0], g) for g in allowed)]
        ctx.notes.extend(rep.notes[:5])
        ctx.metric("tensors_expected", rep.expected)
        ctx.metric("tensors_missing", len(rep.missing))
        ctx.metric("tensors_unexpected", len(rep.unexpected))
        ctx.metric("tensors_mismatched", len(rep.mismatched))
        if not rep.ok:
            first = (rep.missing and f"missing {rep.missing[0]}") or (rep.mismatched and rep.mismatched[0]) or \
                f"unexpected {rep.unexpected[0]}"
            details = "\n".join([*(f"missing    {x}" for x in rep.missing[:50]),
                                 *(f"mismatched {x}" for x in rep.mismatched[:50]),
                                 *(f"unexpected {x}" for x in rep.unexpected[:50])])
            raise CheckFailure(f"checkpoint does not match the config: {rep.summary()}; first: {first}",
                               metric="tensors_missing+mismatched+unexpected", expected=0,
                               observed=len(rep.missing) + len(rep.mismatched) + len(rep.unexpected), details=details)

    # -- stream --------------------------------------------------------------------------------
    def fit(self, ctx: CheckContext, st) -> None:
        """Place the full model on the backend's devices (harness.weights.place): one device where it fits,
        its decoder layers split over several in order where not; skipped with the sizes where it does not
        fit them all. Nothing is built on the host first."""
        if ctx.variant != "stream":
            return
        from harness.models.build import instantiate, model_config, torch_dtype
        from harness.weights.place import PlacementUnknown, device_budgets, plan_placement

        st.full_mc = model_config(ctx.suite, pruned=False)
        with torch.device("meta"):
            st.meta = instantiate(ctx.suite, st.full_mc, torch.float32)
        try:
            budgets = device_budgets(ctx.backend, st.cfg.memory_fraction, st.cfg.devices, first=ctx.device)
        except PlacementUnknown as e:
            raise NotApplicable(f"cannot place the full model on {ctx.backend.name}: {e}") from None
        pl = plan_placement(st.meta, torch_dtype(ctx.dtype), budgets)
        if isinstance(pl, str):
            raise NotApplicable(f"does not fit: {pl} (memory_fraction {st.cfg.memory_fraction} of each device's "
                                f"free memory on {ctx.backend.name})")
        st.placement = pl
        ctx.metric("stream_devices", len(pl.devices))
        if len(pl.devices) > 1:
            ctx.notes.append(f"full model placed over {len(pl.devices)} devices: {pl.describe()}")

    def capture(self, ctx: CheckContext, st) -> None:
        if ctx.variant != "stream":
            return
        from harness.models.build import seeded_tokens, torch_dtype
        from harness.precision.stream import capture_layers
        from harness.weights.place import build_placed

        model, kinds = build_placed(ctx.suite, st.full_mc, torch_dtype(ctx.dtype), st.placement, st.ckpt)
        q = {k: v for k, v in kinds.items() if k != "plain"}
        if q:
            ctx.notes.append("target dequantized on load: " + ", ".join(f"{v} {k} tensors" for k, v in sorted(q.items())))
        model.eval()
        ids = seeded_tokens(st.full_mc.config.vocab_size, st.cfg.prompts, st.cfg.seq_len, st.cfg.seed + 1)
        ids = ids.to(st.placement.rest)
        transform = getattr(st, "transform", None)  # tests inject a fault into the target here
        if transform is not None:
            transform(model)
        st.captured = capture_layers(model, ids)
        del model
        ctx.backend.synchronize()

    def reference(self, ctx: CheckContext, st) -> None:
        if ctx.variant != "stream":
            return
        from harness.precision.stream import float64_rotary, stream_reference

        tol = st.cfg.rel_rmse.get(ctx.dtype, 3e-2)
        ctx.tolerance("stream_rel_rmse", tol)
        rtol = st.cfg.router.get(ctx.dtype, 2**-6)
        ctx.tolerance("stream_router", rtol)
        rep = stream_reference(st.meta, st.ckpt, st.captured, tol, rotary=float64_rotary(st.meta), router_tol=rtol)
        st.report = rep
        ctx.notes.extend(rep.notes[:5])
        worst = max((r.metrics["rel_rmse"] for r in rep.layers), default=0.0)
        ctx.metric("stream_layers", len(rep.layers))
        ctx.metric("stream_near_tie_flips", sum(r.near_tie_flips for r in rep.layers))
        ctx.metric("stream_worst_rel_rmse", worst)
        ctx.metric("stream_reference_bytes_read", rep.bytes_read)
        first = rep.first_divergent
        ctx.metric("stream_first_divergent_layer", -1 if first is None else first)
        if first is not None and rep.layers[first].routing and rep.layers[first].metrics["rel_rmse"] <= tol:
            ctx.detail("first_divergent_layer", str(first))
            raise CheckFailure(f"decoder layer {first}: {rep.layers[first].routing[0]}", metric="stream_router",
                               expected="near-tie flips only", observed=f"{len(rep.layers[first].routing)} router(s)",
                               tolerance=rtol, details=rep.render())
        if first is not None:
            ctx.detail("first_divergent_layer", str(first))
            bad = rep.layers[first].metrics["rel_rmse"]
            raise CheckFailure(f"decoder layer {first} diverges from the float64 reference (fed the target's own input "
                               f"to that layer)", metric="stream_rel_rmse", expected=f"<= {tol}",
                               observed=f"{bad:.3g}", tolerance=tol, details=rep.render())
        from harness.settings import env

        if env("HARNESS_WEIGHTS_VERBOSE"):
            ctx.notes.append(rep.render())


def register(registry: CheckRegistry) -> None:
    registry.add(WeightsCheck())
