"""The operator inventory: every aten overload one forward + one backward of the model calls.

A ``TorchDispatchMode`` sees each op *after* autograd and after ``CompositeImplicitAutograd``
decompositions, i.e. the ops a backend must actually provide. A module tracker (torch's
``ModuleTracker`` with fully qualified names) says which module each call came from, in the
forward and in the backward.

On the meta device nothing is computed, so the full trillion-parameter model traces in seconds.
Where ATen's choice depends on the *device* (``scaled_dot_product_attention`` picks its fused
kernel per device type), the meta trace asks the target device type's selector (``cpu`` by default)
which kernel it would pick and calls that one, so that a meta trace equals the real trace on that
device. Python-level device branches in model code (transformers feeds ``histc`` floats on
cpu/mps and ints elsewhere) see ``meta`` as a non-CPU device: same overloads, other dtypes.

The *real* CPU trace of the pruned model (its op inputs are what the ``ops`` check runs each op on)
applies the suite's realistic-numerics gains first (:func:`trace_numerics`): the committed golden's
``numerics`` when a golden for this config exists, else the same calibration the golden would make,
so attention logits and the residual stream have trained-model-like scales instead of the bare
initialisation's (std 0.02 weights: near-uniform attention, tiny residual updates).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.module_tracker import ModuleTracker

from harness.messages import display, first_line

TRACE_FORMAT = 1
MAX_SIGNATURES = 8  # distinct input signatures kept per op in the inventory
MAX_SAMPLES = 2  # real input samples kept per op (for the conformance check)

_SHORT = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "b8", torch.float8_e4m3fn: "f8e4m3", torch.complex64: "c64"}


def short_dtype(dt: torch.dtype) -> str:
    return _SHORT.get(dt, str(dt).replace("torch.", ""))


def _fmt(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{short_dtype(x.dtype)}[{','.join(map(str, x.shape))}]"
    if isinstance(x, (list, tuple)):
        inner = ",".join(_fmt(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, torch.dtype):
        return short_dtype(x)
    if isinstance(x, torch.device):
        return "device"
    if isinstance(x, torch.memory_format | torch.layout):
        return str(x).replace("torch.", "")
    return repr(x)


def signature(args: tuple, kwargs: dict) -> str:
    parts = [_fmt(a) for a in args] + [f"{k}={_fmt(v)}" for k, v in kwargs.items() if k != "device"]
    return "(" + ", ".join(parts) + ")"


def op_name(func) -> str:
    """``aten.mm.default``: what the inventory, the op lists and the ``ops`` items call an overload."""
    return str(func)


def general_module(fqn: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.*.mlp.experts``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


@dataclass
class OpRecord:
    name: str
    count: int = 0
    forward: int = 0
    backward: int = 0
    signatures: Counter = field(default_factory=Counter)
    dtypes: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)  # "model.layers.*.mlp.experts [DeepseekV3Experts]"

    def to_dict(self) -> dict:
        return {"count": self.count, "forward": self.forward, "backward": self.backward,
                "signatures": dict(self.signatures.most_common(MAX_SIGNATURES)),
                "distinct_signatures": len(self.signatures),
                "dtypes": sorted(self.dtypes), "modules": sorted(self.modules)}

    @classmethod
    def from_dict(cls, name: str, d: dict) -> OpRecord:
        return cls(name, d["count"], d["forward"], d["backward"], Counter(d["signatures"]), set(d["dtypes"]),
                   set(d["modules"]))


@dataclass
class Sample:
    """One real call of an op: inputs as the model passed them (cloned before the call), on CPU."""

    args: tuple
    kwargs: dict
    signature: str
    module: str


@dataclass
class Inventory:
    ops: dict[str, OpRecord]
    meta: dict = field(default_factory=dict)  # model, device, dtype, batch, seq, versions, wall time
    samples: dict[str, list[Sample]] = field(default_factory=dict, repr=False)  # only for real traces

    def names(self) -> list[str]:
        return sorted(self.ops)

    def to_dict(self) -> dict:
        return {"format": TRACE_FORMAT, "meta": self.meta,
                "ops": {k: self.ops[k].to_dict() for k in sorted(self.ops)}}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            from harness.files import atomic

            atomic.write_text(path, text)
        return text

    @classmethod
    def from_dict(cls, d: dict) -> Inventory:
        return cls({k: OpRecord.from_dict(k, v) for k, v in d["ops"].items()}, d.get("meta", {}))

    def modules_of(self, op: str) -> list[str]:
        rec = self.ops.get(op)
        return sorted(rec.modules) if rec else []


class _FqnTracker(ModuleTracker):
    """torch's ModuleTracker (forward and backward), naming modules by their fqn in ``model``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {m: (n or "<root>") for n, m in model.named_modules()}
        self.classes = {(n or "<root>"): type(m).__name__ for n, m in model.named_modules()}

    def _get_mod_name(self, mod):
        return self.names.get(mod, type(mod).__name__)

    def innermost(self) -> str:
        best, depth = "<root>", -1
        for p in self.parents:
            if p == "Global" or p not in self.classes:
                continue
            d = 0 if p == "<root>" else p.count(".") + 1
            if d > depth:
                best, depth = p, d
        return best

    def label(self, fqn: str) -> str:
        return f"{general_module(fqn)} [{self.classes.get(fqn, '?')}]"


def _clone_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self, tracker: _FqnTracker, keep_samples: bool):
        super().__init__()
        self.tracker, self.keep = tracker, keep_samples
        self.ops: dict[str, OpRecord] = {}
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        # Backward attribution: an op's autograd node is created just before the op is dispatched,
        # so the sequence number seen at forward dispatch names the node; in backward the node being
        # run (torch._C._current_autograd_node) leads back to the forward module that made it.
        self.seq_module: dict[int, str] = {}
        self.last_module = "<root>"  # the module of the last op dispatched (where a backward failed)

    def current_module(self) -> tuple[str, bool]:
        bw = self.tracker.is_bw
        if not bw:
            mod = self.tracker.innermost()
            self.seq_module.setdefault(torch._C._autograd._get_sequence_nr(), mod)
            return mod, False
        node = torch._C._current_autograd_node()
        if node is not None:
            mod = self.seq_module.get(node._sequence_nr() + 1)
            if mod is not None:
                return mod, True
        return self.tracker.innermost(), True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        rec = self.ops.get(name)
        if rec is None:
            rec = self.ops[name] = OpRecord(name)
        sig = signature(args, kwargs)
        mod, bw = self.current_module()
        rec.count += 1
        if bw:
            rec.backward += 1
        else:
            rec.forward += 1
        rec.signatures[sig] += 1
        flat, _ = tree_flatten((args, kwargs))
        rec.dtypes.update(short_dtype(t.dtype) for t in flat if isinstance(t, torch.Tensor))
        rec.modules.add(self.tracker.label(mod))
        self.last_module = mod
        if self.keep and len(self.samples[name]) < MAX_SAMPLES and all(s.signature != sig for s in self.samples[name]):
            a, k = tree_map(_clone_cpu, (args, kwargs))
            self.samples[name].append(Sample(a, k, sig, self.tracker.label(mod)))
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            out = _meta_fallback(func, args, kwargs)
            if out is None:
                raise
            return out


def _meta_fallback(func, args, kwargs):
    """Shape rules for ops whose meta kernel is narrower than the CPU kernel. torch's meta
    ``_grouped_mm`` insists on bfloat16 (a CUDA constraint) while the CPU kernel takes float32."""
    if func is not torch.ops.aten._grouped_mm.default or not args or args[0].device.type != "meta":
        return None
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    dtype = kwargs.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    else:
        return None
    return torch.empty(shape, dtype=dtype, device="meta")


# --- device emulation on meta ---------------------------------------------------------------------
_SDP_FLASH = 1  # torch._fused_sdp_choice: 0 math, 1 flash, 2 efficient, 3 cudnn, 4 overrideable


@contextlib.contextmanager
def emulate_device(target: str = "cpu"):
    """On meta tensors, make ``F.scaled_dot_product_attention`` take the kernel ``target`` would."""
    F = torch.nn.functional
    orig = F.scaled_dot_product_attention
    if target != "cpu":  # only the CPU selector can be asked on a machine without the device
        yield
        return

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta":
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        with _disable_current_modes():
            def real(t):
                return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)

            choice = torch._fused_sdp_choice(real(query), real(key), real(value), real(attn_mask), dropout_p,
                                             is_causal, scale=scale, enable_gqa=enable_gqa)
        if choice != _SDP_FLASH:
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:  # as ATen's convert_boolean_attn_mask
            mask = torch.where(mask.logical_not(), torch.scalar_tensor(float("-inf"), dtype=query.dtype,
                                                                       device=query.device),
                               torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def trace_model(model: torch.nn.Module, vocab_size: int, *, batch: int = 1, seq: int = 16, seed: int = 1,
                backward: bool = True, keep_samples: bool = False, target: str = "cpu",
                meta: dict | None = None) -> Inventory:
    """Run one forward (with labels, so the loss is included) and one backward under the recorder."""
    from harness.models.build import seeded_tokens

    device = next(iter(model.parameters())).device
    ids = seeded_tokens(vocab_size, batch, seq, seed).to(device)
    tracker = _FqnTracker(model)
    rec = _Recorder(tracker, keep_samples)
    model.train()
    t = time.perf_counter()
    phase, failed = "forward", None
    with emulate_device(target), tracker, rec:
        try:
            out = model(input_ids=ids, labels=ids)
            phase = "backward"
            if backward:
                out.loss.backward()
        except Exception as e:  # noqa: BLE001 - model code: whatever it raises, the ops so far are kept
            # the module it raised in is still among the tracker's parents (its post hook never ran)
            failed = (e, tracker.innermost() if phase == "forward" else rec.last_module)
    info = dict(meta or {})
    info.update({"device": device.type, "batch": batch, "seq": seq, "backward": backward,
                 "emulated_target": target if device.type == "meta" else None,
                 "torch": torch.__version__, "trace_s": round(time.perf_counter() - t, 3)})
    inv = Inventory(rec.ops, info, dict(rec.samples))
    if failed is not None:
        raise TraceError(failed[0], failed[1], phase, inv) from failed[0]
    return inv


class TraceError(Exception):
    """The traced forward or backward raised: which module, in which phase, and the inventory of the
    ops recorded before it (``partial``)."""

    def __init__(self, error: BaseException, module: str, phase: str, partial: Inventory):
        self.error, self.module, self.phase, self.partial = error, module, phase, partial
        super().__init__(f"{phase} raised in {module}: {type(error).__name__}: {first_line(error, 160)}")


# --- realistic numerics for the real trace ----------------------------------------------------------
@dataclass(frozen=True)
class TraceNumerics:
    """Which weight rescaling the real trace applies (``harness.models.numerics``).

    ``source``: ``golden`` (the committed golden's gains for this config), ``calibrated`` (no usable
    golden: calibrated here the way ``golden generate`` does, on the float64 model and the golden's
    input ids), ``init`` (bare initialisation: the suite or ``[checks.ops] realistic = false`` says so)
    or ``weights`` (the suite's real weights, used as they are). ``key`` identifies the gains without
    computing them (the calibration's inputs for ``calibrated``), so the on-disk op-name cache can be
    keyed by it at collection time for free."""

    source: str
    detail: str
    key: str
    seed: int  # the weight seed the gains belong to
    gains: dict | None = None  # golden: read from the manifest; calibrated: computed on first use


def _valid_gains(num) -> dict | None:
    """The manifest's gains as data: {attention_gain, residual_gain} of layer -> finite positive float."""
    if not isinstance(num, dict):
        return None
    out = {}
    for k in ("attention_gain", "residual_gain"):
        g = num.get(k, {})
        if not isinstance(g, dict) or not all(isinstance(i, str) and i.isdigit() and isinstance(v, int | float)
                                              and not isinstance(v, bool) and 0 < v < 1e6 for i, v in g.items()):
            return None
        out[k] = {i: float(v) for i, v in g.items()}
    return out


def trace_numerics(ls, realistic: bool | None = None) -> TraceNumerics:
    """The gains the real trace of ``ls`` applies (cheap: reads at most the golden's manifest).
    ``realistic`` None: the suite's ``[checks.ops] realistic``."""
    from harness.golden import store

    ops_cfg = getattr(ls.suite.checks, "ops", None)
    if realistic is None:
        realistic = getattr(ops_cfg, "realistic", True)
    p = ls.suite.checks.precision
    bare_seed = ls.suite.checks.smoke.seed
    if not realistic:
        return TraceNumerics("init", "bare initialisation ([checks.ops] realistic = false)", "init", bare_seed)
    if ls.weights_path is not None:
        return TraceNumerics("weights", "the suite's real weights (no gains)", "weights", bare_seed)
    if p.numerics == "init":
        return TraceNumerics("init", "bare initialisation ([checks.precision] numerics = 'init')", "init",
                             bare_seed)
    why = "no golden"
    try:
        path = store.golden_dir(ls.name)
        if path.exists():
            manifest = store.read_manifest(path)
            gains = _valid_gains(manifest.get("numerics"))
            if manifest.get("config_hash") != store.config_hash(ls):
                why = f"golden {display(path)} is for another config"
            elif gains is None:
                why = f"golden {display(path)} has no usable numerics gains"
            else:
                key = store.canonical_hash({"golden": gains})[:16]
                num = manifest["numerics"]
                return TraceNumerics(
                    "golden", f"realistic: gains of golden {display(path)} (attention logit std "
                    f"{num.get('attention_logit_std')}, residual growth {num.get('residual_growth')})",
                    f"golden:{key}", p.seed, gains)
    except store.GoldenError as e:
        why = str(e)
    params = [p.attention_logit_std, p.residual_growth, p.seed, p.batch_size, p.seq_len]
    return TraceNumerics("calibrated", f"realistic: calibrated here ({why}; attention logit std "
                         f"{p.attention_logit_std}, residual growth {p.residual_growth})",
                         "calibrated:" + json.dumps(params), p.seed)


_CALIBRATED: dict[tuple[str, str], dict] = {}


def numerics_gains(ls, num: TraceNumerics) -> dict | None:
    """The gains to apply (``None``: none). ``calibrated``: as ``golden generate`` calibrates (float64
    model on the CPU, the golden's seeded input ids), once per process per suite."""
    if num.source == "golden":
        return num.gains
    if num.source != "calibrated":
        return None
    ck = (str(ls.path), num.key)
    if ck not in _CALIBRATED:
        from harness.models import numerics
        from harness.models.build import build_model, seeded_tokens

        p = ls.suite.checks.precision
        model, mc = build_model(ls, "float64", "cpu", seed=p.seed)
        model.eval()
        ids = seeded_tokens(mc.config.vocab_size, p.batch_size, p.seq_len, p.seed + 1)
        got = numerics.calibrate(model, ids, p.attention_logit_std, p.residual_growth)
        _CALIBRATED[ck] = {k: got[k] for k in ("attention_gain", "residual_gain")}
        del model
    return _CALIBRATED[ck]


# --- inventories of a suite, cached ---------------------------------------------------------------
def cache_dir() -> Path:
    from harness.settings import env

    if env("HARNESS_CACHE_DIR"):
        return env("HARNESS_CACHE_DIR")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness"


def suite_key(ls, dtype: str, extra: str = "", numerics_key: str | None = None) -> str:
    """Cache key of the suite's real trace; ``numerics_key`` None: that of :func:`trace_numerics`
    (so a regenerated golden with other gains, or a switch to bare init, never reuses a stale trace)."""
    import transformers

    if numerics_key is None:
        numerics_key = trace_numerics(ls).key
    blob = json.dumps({"raw": ls.raw_config, "suite": ls.suite.model_dump(mode="json", exclude={"checks"}),
                       "dtype": dtype, "torch": torch.__version__, "transformers": transformers.__version__,
                       "format": TRACE_FORMAT, "extra": extra, "numerics": numerics_key}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


_REAL: dict[tuple, Inventory] = {}


def real_inventory(ls, dtype: str, *, batch: int = 2, seq: int = 16, realistic: bool | None = None) -> Inventory:
    """Trace the pruned model for real on CPU (values, samples), with the realistic-numerics gains of
    :func:`trace_numerics`: once per process per suite x dtype x numerics."""
    from harness.models import numerics
    from harness.models.build import build_model

    num = trace_numerics(ls, realistic)
    key = (str(ls.path), dtype, num.key, batch, seq)
    inv = _REAL.get(key)
    if inv is None:
        gains = numerics_gains(ls, num)
        model, mc = build_model(ls, dtype, "cpu", seed=num.seed)
        numerics.apply(model, gains)
        inv = trace_model(model, mc.config.vocab_size, batch=batch, seq=seq, seed=ls.suite.checks.smoke.seed + 1,
                          keep_samples=True, meta={"model": ls.name, "dtype": dtype, "pruned": True,
                                                   "numerics": {"source": num.source, "detail": num.detail,
                                                                "key": num.key}})
        del model
        _REAL[key] = inv
    return inv


def suite_op_names(ls, dtypes: list[str], *, batch: int = 2, seq: int = 16,
                   realistic: bool | None = None) -> dict[str, list[str]]:
    """dtype -> op names of the pruned model's real CPU trace, from an on-disk cache keyed by the
    config, the suite's model/prune sections, dtype, the torch/transformers versions and the trace's
    numerics (:func:`trace_numerics`)."""
    out = {}
    nkey = trace_numerics(ls, realistic).key
    for dtype in dtypes:
        from harness.files import paths

        path = paths.join(cache_dir() / "ops", f"{ls.path.stem}-{dtype}-{suite_key(ls, dtype, f'{batch}x{seq}', nkey)}"
                          ".json", source=ls.path, field="suite file name")
        try:
            ops = json.loads(path.read_text(encoding="utf-8"))["ops"]
            if isinstance(ops, list) and ops and all(isinstance(o, str) and o.count(".") >= 2 for o in ops):
                out[dtype] = ops
                continue
            # Valid JSON but not an op list (a corrupt or foreign cache file), or an empty one: a real
            # model runs ops, so an empty list is a broken cache, never "this suite has no op items".
            print(f"note: {path}: op-list cache {'is empty' if ops == [] else 'is not an op list'}; "
                  "recomputing it", file=sys.stderr)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        names = real_inventory(ls, dtype, batch=batch, seq=seq, realistic=realistic).names()
        if not names:  # nothing to cache: an empty list read back would hide every op item
            out[dtype] = names
            continue
        try:
            from harness.files import atomic

            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(path, {"ops": names}, indent=None, newline=False)
        except OSError:
            pass
        out[dtype] = names
    return out
