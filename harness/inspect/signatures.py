"""The unpruned model's operator signatures at their real shapes (issue #47 item 1).

``harness inspect``'s meta trace (:mod:`harness.inspect.trace`) keeps op names and a few signature
strings; kernels pick their code path by shape, so the ``shapes`` check needs every distinct
(operator, shapes, dtypes, strides, scalar arguments) one forward + backward of the *full* model runs,
with the modules that call each. :func:`suite_signatures` records them on the meta device (seconds,
whatever the size) and caches them on disk next to the op lists (``HARNESS_CACHE_DIR``).

A signature is then materialized on the host: :func:`shrink` slices a tensor too large to hold in
float64 (``max_numel``) along its largest dimension that is not a reduction the kernel dispatches on
(the vocabulary of the embedding and the lm_head, never a matmul's K or attention's head_dim), the
same value replaced everywhere in the signature (``embedding_dense_backward``'s ``num_weights`` too),
and :func:`make_inputs` fills it with seeded values: N(0, 1) floats, integers in
``[0, smallest float dimension)`` (valid indices and class targets), mostly-true masks, and a grouped
GEMM's offsets as the router makes them (:func:`routed_offsets`), the expert count kept
(:func:`protected_dims`); :func:`grouped_mm_reference` is its float64 reference.

:func:`budget` is the per-signature error budget: ``factor * (u(dtype) + u_acc * sqrt(R))`` with ``u``
the unit roundoff of the lowest-precision float dtype of the signature (its output rounding), ``u_acc``
the accumulator's (float32's for float32 and below, as CPU and GPU kernels accumulate, float64's for
float64) and ``R`` the reduction length (a matmul's K, attention's max(head_dim, keys), 1 for a
pointwise op, the last dimension otherwise): a random-walk bound on the accumulated rounding.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.inspect.trace import _FqnTracker, _Recorder, cache_dir, emulate_device, suite_key

SIG_FORMAT = 2
UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (K index of the first operand, operand holding K): the matmul family, where K is the reduction
MATMUL = {"aten.mm.default": 0, "aten.bmm.default": 0, "aten.addmm.default": 1, "aten.baddbmm.default": 1,
          "aten._grouped_mm.default": 0}
ATTENTION = "aten._scaled_dot_product"
GROUPED = "aten._grouped_mm.default"  # (mat_a, mat_b, offs): the MoE experts' GEMM in transformers 5


def _enc(x: Any) -> Any:
    """A JSON tree of an argument: tensors as their (shape, stride, dtype), never their values."""
    if isinstance(x, torch.Tensor):
        return {"T": [list(x.shape), list(x.stride()), str(x.dtype).removeprefix("torch.")]}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": None}
    if isinstance(x, torch.memory_format | torch.layout):
        return {"enum": str(x).removeprefix("torch.")}
    if isinstance(x, tuple | list):
        items = [_enc(v) for v in x]
        return {"tuple": items} if isinstance(x, tuple) else items
    if isinstance(x, dict):
        return {"kw": {k: _enc(v) for k, v in x.items()}}
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return {"opaque": repr(x)[:80]}  # not executable from its signature: left out, with the reason


@dataclass
class Signature:
    op: str
    args: list  # encoded (see _enc)
    kwargs: dict
    count: int = 0
    forward: int = 0
    backward: int = 0
    modules: list[str] = field(default_factory=list)  # "model.layers.*.mlp.down_proj [Linear]"
    example: str = ""  # one concrete calling module: model.layers.0.mlp.down_proj
    out: Any = None  # the outputs' specs (encoded): what the host must hold besides the inputs

    def tensors(self, outputs: bool = False) -> list[tuple[list[int], list[int], str]]:
        found: list = []
        _walk([self.args, self.kwargs] + ([self.out] if outputs else []), lambda t: found.append(t))
        return found

    def shape_text(self) -> str:
        return ", ".join(f"{dt}[{','.join(map(str, s))}]" + ("" if _dense(s, st) else f" stride {tuple(st)}")
                         for s, st, dt in self.tensors())

    def callers(self) -> str:
        more = f" (e.g. {self.example})" if self.example else ""
        return "; ".join(self.modules) + more


def _walk(x, fn) -> None:
    if isinstance(x, dict):
        if "T" in x:
            fn(x["T"])
            return
        for v in x.values():
            _walk(v, fn)
    elif isinstance(x, list):
        for v in x:
            _walk(v, fn)


def _dense(shape, stride) -> bool:
    return list(stride) == _contiguous(shape)


def _contiguous(shape) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return out[::-1]


class _SigRecorder(_Recorder):
    """The inventory's recorder (module attribution in forward and backward), keeping every distinct
    signature with the modules that call it."""

    def __init__(self, tracker: _FqnTracker):
        super().__init__(tracker, keep_samples=False)
        self.sigs: dict[str, Signature] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a, k = [_enc(x) for x in args], {n: _enc(v) for n, v in kwargs.items() if n != "device"}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(func)
        key = json.dumps([name, a, k], sort_keys=True)
        sig = self.sigs.get(key)
        if sig is None:
            sig = self.sigs[key] = Signature(name, a, k, example=self.last_module, out=_enc(out))
        sig.count += 1
        sig.backward += bool(self.tracker.is_bw)
        sig.forward += not self.tracker.is_bw
        label = self.tracker.label(self.last_module)
        if label not in sig.modules:
            sig.modules.append(label)
        return out


def trace_signatures(model: torch.nn.Module, vocab_size: int, *, batch: int = 1, seq: int = 32, seed: int = 1,
                     backward: bool = True) -> list[Signature]:
    """Every distinct signature of one forward (with labels: the loss) and one backward of ``model``."""
    from harness.models.build import seeded_tokens

    device = next(iter(model.parameters())).device
    ids = seeded_tokens(vocab_size, batch, seq, seed).to(device)
    tracker = _FqnTracker(model)
    rec = _SigRecorder(tracker)
    model.train()
    with emulate_device("cpu"), tracker, rec:
        out = model(input_ids=ids, labels=ids)
        if backward:
            out.loss.backward()
    return list(rec.sigs.values())


def suite_signatures(ls, dtype: str, *, tokens: int = 32, backward: bool = True) -> tuple[list[Signature], dict]:
    """The unpruned model's signatures in ``dtype`` (traced on meta), cached on disk by config,
    dtype, torch/transformers versions and trace length. Returns (signatures, meta)."""
    from harness.files import atomic, paths

    key = suite_key(ls, dtype, f"sig{SIG_FORMAT}-full-1x{tokens}-{backward}", "meta")
    path = paths.join(cache_dir() / "signatures", f"{ls.path.stem}-{dtype}-{key}.json", source=ls.path,
                      field="suite file name")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [Signature(**s) for s in data["signatures"]], data["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from harness.inspect.params import Target, meta_model

    t = time.perf_counter()
    model, _ = meta_model(Target(ls.name, ls.raw_config, ls, ls.path), pruned=False, dtype=getattr(torch, dtype))
    sigs = trace_signatures(model, model.config.vocab_size, seq=tokens, seed=ls.suite.checks.smoke.seed + 1,
                            backward=backward)
    del model
    meta = {"model": ls.name, "dtype": dtype, "tokens": tokens, "backward": backward,
            "trace_s": round(time.perf_counter() - t, 3), "torch": torch.__version__}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, {"meta": meta, "signatures": [s.__dict__ for s in sigs]}, indent=None, newline=False)
    except OSError as e:
        print(f"note: {path}: signature cache not written ({e})", file=sys.stderr)
    return sigs, meta


# --- materializing one signature on the host ----------------------------------------------------------
def protected_dims(sig: Signature) -> set[int]:
    """Dimension sizes the kernel dispatches on, never sliced: a matmul's K, attention's head_dim,
    and a grouped GEMM's group count (the expert count: grouped kernels pick tiles and schedules by
    groups and rows per group, so 128 experts must stay 128)."""
    ts = sig.tensors()
    if sig.op == GROUPED and len(ts) >= 3:
        return {ts[0][0][-1], ts[2][0][0]}
    if sig.op in MATMUL and len(ts) > MATMUL[sig.op]:
        return {ts[MATMUL[sig.op]][0][-1]}
    if sig.op.startswith(ATTENTION) and ts:
        return {ts[0][0][-1]}
    return set()


def shrink(sig: Signature, max_numel: int) -> dict[int, int] | None:
    """{old size: new size} so that every tensor holds at most ``max_numel`` elements ({} when all
    do already); None when only a protected dimension could be sliced."""
    plan: dict[int, int] = {}
    keep = protected_dims(sig)
    for _ in range(4):
        over = [s for s, _, _ in sig.tensors(outputs=True) if math.prod(plan.get(d, d) for d in s) > max_numel]
        if not over:
            return plan
        shape = [plan.get(d, d) for d in over[0]]
        free = [d for d in over[0] if d not in keep and d not in plan and d > 1]
        if not free:
            return None
        d = max(free)
        rest = math.prod(shape) // d
        new = max(1, max_numel // rest)
        # whole tiles where there is room for them; 16 rows at least (grouped GEMMs require 16-byte strides)
        tile = 256 if new >= 512 else 16 if new >= 16 else 1
        plan[d] = new - new % tile
    return None


def _strides(shape: list[int], old_shape: list[int], old_stride: list[int]) -> list[int]:
    """Dense strides in the old layout's order (broadcast dims keep stride 0)."""
    if list(shape) == list(old_shape):
        return list(old_stride)
    order = sorted(range(len(shape)), key=lambda i: (old_stride[i], i))  # innermost first
    out, acc = [0] * len(shape), 1
    for i in order:
        if old_stride[i] == 0 and old_shape[i] != 1:
            continue
        out[i] = acc
        acc *= max(shape[i], 1)
    return out


def resized(sig: Signature, plan: dict[int, int]) -> tuple[list, dict]:
    """The signature's (args, kwargs) with each planned size replaced, in shapes and int arguments."""
    def sub(x):
        if isinstance(x, dict) and "T" in x:
            s, st, dt = x["T"]
            ns = [plan.get(d, d) for d in s]
            return {"T": [ns, _strides(ns, s, st), dt]}
        if isinstance(x, dict):
            return {k: sub(v) for k, v in x.items()}
        if isinstance(x, list):
            return [sub(v) for v in x]
        if isinstance(x, int) and not isinstance(x, bool):
            return plan.get(x, x)
        return x
    return sub(sig.args), sub(sig.kwargs)


def _int_high(args, kwargs) -> int:
    dims = []
    _walk([args, kwargs], lambda t: dims.extend(d for d in t[0] if d > 1) if "float" in t[2] else None)
    return min(dims) if dims else 16


def make_inputs(args: list, kwargs: dict, seed: int, op: str = "") -> tuple[tuple, dict]:
    """Seeded CPU tensors for an encoded (args, kwargs); raises ValueError for an opaque argument.
    A grouped GEMM's ``offs`` get routed offsets (:func:`routed_offsets`), not random integers."""
    g = torch.Generator().manual_seed(seed)
    high = _int_high(args, kwargs)

    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "T" in x:
            return _tensor(*x["T"], g, high)
        if "tuple" in x:
            return tuple(dec(v) for v in x["tuple"])
        if "kw" in x:
            return {k: dec(v) for k, v in x["kw"].items()}
        if "dtype" in x:
            return getattr(torch, x["dtype"])
        if "device" in x:
            return torch.device("cpu")
        if "enum" in x:
            return getattr(torch, x["enum"])
        raise ValueError(f"argument {x['opaque']} cannot be rebuilt from the signature")

    a, k = tuple(dec(x) for x in args), {n: dec(v) for n, v in kwargs.items()}
    if op == GROUPED:
        a, k = _with_routed_offsets(a, k, g)
    return a, k


def grouped_length(mat_a: torch.Tensor, mat_b: torch.Tensor) -> int:
    """The length ``offs`` partitions: tokens (2d x 3d: rows of a; 2d x 2d, the weight gradient: the
    shared K) or the columns of b (3d x 2d)."""
    if mat_a.dim() == 2:
        return mat_a.shape[0] if mat_b.dim() == 3 else mat_a.shape[1]
    return mat_b.shape[-1]


def routed_offsets(length: int, groups: int, g: torch.Generator) -> torch.Tensor:
    """Group ends as the experts' forward makes them (histc of the routed expert ids, cumsum): each of
    ``length`` rows sent to a seeded uniform expert, so some experts get none and some several, and
    the last offset is ``length`` (every row is computed: no uninitialized output to compare)."""
    expert = torch.randint(0, groups, (length,), generator=g)
    return torch.cumsum(torch.bincount(expert, minlength=groups), 0).to(torch.int32)


def _with_routed_offsets(a: tuple, k: dict, g: torch.Generator) -> tuple[tuple, dict]:
    offs = k.get("offs", a[2] if len(a) > 2 else None)
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1:
        return a, k  # 3d x 3d: a plain batched GEMM, no groups
    new = routed_offsets(grouped_length(a[0], a[1]), offs.shape[0], g)
    if "offs" in k:
        return a, {**k, "offs": new}
    return a[:2] + (new,) + a[3:], k


def grouped_mm_reference(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm`` group by group with ``torch.mm``: its float64 reference (the CPU kernel
    takes float32 and below only, so the check would otherwise compare the backend with the CPU's
    kernel in the same dtype, and on the CPU with itself)."""
    if offs is None:
        out = torch.bmm(mat_a, mat_b)
    else:
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        if mat_a.dim() == 2 and mat_b.dim() == 3:  # tokens grouped by expert: rows of a
            out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[-1])
            for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
                out[s:t] = mat_a[s:t] @ mat_b[e]
        elif mat_a.dim() == 2:  # the weight gradient: one (M, N) per expert over its slice of K
            out = mat_a.new_zeros(len(ends), mat_a.shape[0], mat_b.shape[-1])
            for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
                out[e] = mat_a[:, s:t] @ mat_b[s:t]
        else:  # 3d x 2d: columns of b grouped
            out = mat_a.new_zeros(mat_a.shape[1], mat_b.shape[-1])
            for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
                out[:, s:t] = mat_a[e] @ mat_b[:, s:t]
    if bias is not None:  # no model of the bundled suites passes one (transformers adds it after)
        raise NotImplementedError("grouped_mm_reference: bias")
    return out


def _tensor(shape, stride, dtype, g, high) -> torch.Tensor:
    """Seeded values laid out with the signature's strides (broadcast and gapped views included:
    the storage is filled, then viewed)."""
    dt = getattr(torch, dtype)
    n = 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
    if dt.is_floating_point:
        v = torch.randn(n, generator=g, dtype=torch.float32)
    elif dt == torch.bool:
        v = torch.rand(n, generator=g) < 0.9
    else:
        v = torch.randint(0, high, (n,), generator=g)
    return v.to(dt).as_strided(shape, stride)


def reduction_length(sig: Signature, args: list) -> int:
    ts: list = []
    _walk(args, lambda t: ts.append(t))
    if sig.op in MATMUL and len(ts) > MATMUL[sig.op]:
        return ts[MATMUL[sig.op]][0][-1]
    if sig.op.startswith(ATTENTION) and len(ts) >= 2:
        return max(ts[0][0][-1], ts[1][0][-2] if len(ts[1][0]) >= 2 else 1)
    ns, name, overload = sig.op.split(".", 2)
    try:
        if torch.Tag.pointwise in getattr(getattr(getattr(torch.ops, ns), name), overload).tags:
            return 1
    except AttributeError:
        pass
    floats = [t for t in ts if "float" in t[2] and t[0]]
    return floats[0][0][-1] if floats else 1


def budget(sig: Signature, args: list, factor: float) -> float:
    dts = [getattr(torch, t[2]) for t in sig.tensors() if getattr(torch, t[2]) in UNIT]
    if not dts:
        return 0.0  # integers and booleans: exact
    u = max(UNIT[d] for d in dts)
    acc = UNIT[torch.float64] if u == UNIT[torch.float64] else UNIT[torch.float32]
    return factor * (u + acc * math.sqrt(reduction_length(sig, args)))

