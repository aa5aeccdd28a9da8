"""Where a perf phase spends its time and holds its memory: operator and module profiles, measured in
repeats of their own (never the timed ones), stored with the samples and the baseline, and compared
when a phase regresses (issue #30).

* **operators**: ``torch.profiler`` self time per operator (CPU activity, plus the backend's device
  activity where it has one), per repeat, each attributed to the innermost decoder module it ran in;
* **modules**: inclusive forward time per module, layer indices folded (``model.layers.*.mlp``: every
  layer's MLP together), from ``record_function`` ranges the forward hooks open and close;
* **memory**: the peak of live tensor storage during one repeat (a TorchDispatchMode that counts
  every storage an op returns, freed when the storage is: the allocator's view without an allocator,
  so the same on every backend), and at that peak the bytes each module allocated and still holds.

``explain`` turns a baseline's profile and the run's into the lines a regression verdict carries:
the operators and modules whose calibrated time grew most, with their share of the phase before and
after, and the module holding the extra memory at the peak.
"""

from __future__ import annotations

import re
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

TOP_OPS = 40  # operators kept per phase; the rest summed as OTHER
OTHER = "(other operators)"
OUTSIDE = "(outside the modules: backward, optimizer, host)"
PREFIX = "module::"


def pattern(name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.*.mlp.experts``: one row for every layer's copy."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) or "(model)"


class _ModuleRanges:
    """Forward pre/post hooks that open a ``module::<pattern>`` profiler range around each module's
    forward and keep the stack of modules being run (for the memory owner)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.handles, self.stack = model, [], []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            label = pattern(name) if name else "(model)"

            def pre(_m, _a, label=label):
                rf = torch.autograd.profiler.record_function(PREFIX + label)
                rf.__enter__()
                self.stack.append((label, rf))

            def post(_m, _a, _o, label=label):
                while self.stack:  # a module that raised left its range open: close down to this one
                    got, rf = self.stack.pop()
                    rf.__exit__(None, None, None)
                    if got == label:
                        break

            self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return self

    def owner(self) -> str:
        return self.stack[-1][0] if self.stack else OUTSIDE

    def __exit__(self, *exc):
        while self.stack:
            self.stack.pop()[1].__exit__(None, None, None)
        for h in self.handles:
            h.remove()
        return False


class ModuleMemory(TorchDispatchMode):
    """Peak of live tensor storage while active, and at that peak the bytes by allocating module.
    Storages that exist before entering (weights, the cache) are not counted: the peak is what the
    phase adds."""

    def __init__(self, ranges: _ModuleRanges):
        super().__init__()
        self.ranges = ranges
        self._seen = WeakIdKeyDictionary()
        self._refs: list = []
        self.live = 0
        self.peak = 0
        self.by_owner: dict[str, int] = defaultdict(int)
        self.at_peak: dict[str, int] = {}

    def _free(self, rec: list) -> None:
        self.live -= rec[0]
        self.by_owner[rec[1]] -= rec[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st in self._seen:
                continue
            rec = [st.nbytes(), self.ranges.owner()]
            self._seen[st] = rec
            self._refs.append(weakref.ref(st, lambda _r, rec=rec, me=weakref.ref(self): me() and me()._free(rec)))
            self.live += rec[0]
            self.by_owner[rec[1]] += rec[0]
            if self.live > self.peak:
                self.peak = self.live
                self.at_peak = {k: v for k, v in self.by_owner.items() if v > 0}
        return out


def _module_event(ev):
    p = ev.cpu_parent
    while p is not None and not p.name.startswith(PREFIX):
        p = p.cpu_parent
    return p


def _module_of(ev) -> str:
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith(PREFIX):
            return p.name[len(PREFIX):]
        p = p.cpu_parent
    return OUTSIDE


def profile_phase(fn, model: torch.nn.Module, backend, repeats: int = 3) -> dict:
    """``repeats`` calls of a phase's sample function under the profiler with module ranges, then one
    under the memory accounting. Times in microseconds per repeat."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    dev = {"cuda": "CUDA", "xpu": "XPU", "mtia": "MTIA"}.get(backend.device_type,
                                                             "PrivateUse1" if backend.device_type != "cpu" else None)
    if dev is not None and hasattr(ProfilerActivity, dev):  # the device's own kernel times where it reports them
        activities.append(getattr(ProfilerActivity, dev))
    fn()  # warm: first-call costs are the timed phase's warm-up, not the profile's
    with _ModuleRanges(model), profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        backend.synchronize()
    ops: dict[str, float] = defaultdict(float)
    where: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    modules: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)  # a module's time less its child modules': where it grew
    for ev in prof.events():
        if ev.name.startswith(PREFIX):
            label = ev.name[len(PREFIX):]
            modules[label] += ev.cpu_time_total / repeats
            own[label] += ev.cpu_time_total / repeats
            parent = _module_event(ev)
            if parent is not None:
                own[parent.name[len(PREFIX):]] -= ev.cpu_time_total / repeats
            continue
        if ev.name.startswith(("autograd::", "ProfilerStep", "[memory]")):
            continue  # the engine's own wrappers: their ops are counted themselves
        # self (exclusive) time: an op that calls others counts only its own part
        t = (ev.self_cpu_time_total + getattr(ev, "self_device_time_total", 0)) / repeats
        ops[ev.name] += t
        where[ev.name][_module_of(ev)] += t
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])
    kept = dict(ranked[:TOP_OPS])
    if len(ranked) > TOP_OPS:
        kept[OTHER] = sum(v for _, v in ranked[TOP_OPS:])
    ranges = _ModuleRanges(model)
    with ranges, ModuleMemory(ranges) as mem:
        fn()
    del prof
    import gc

    gc.collect()  # the event tree is cyclic (parents <-> children): free it now, not in a later timed sample
    return {"repeats": repeats, "unit": "us", "total_us": sum(ops.values()),
            "ops": {k: round(v, 3) for k, v in kept.items()},
            "op_modules": {k: {m: round(v, 3) for m, v in sorted(where[k].items(), key=lambda kv: -kv[1])[:3]}
                           for k in kept if k in where},
            "modules": {k: round(v, 3) for k, v in sorted(modules.items(), key=lambda kv: -kv[1])},
            "modules_self": {k: round(v, 3) for k, v in sorted(own.items(), key=lambda kv: -kv[1])},
            "memory": {"peak_bytes": mem.peak, "at_peak": dict(sorted(mem.at_peak.items(), key=lambda kv: -kv[1]))}}


def _growth(now: dict, base: dict, ratio: float, total_now: float, total_base: float, top: int) -> list[dict]:
    rows = []
    for k in set(now) | set(base):
        n, b = now.get(k, 0.0) / ratio, base.get(k, 0.0)
        rows.append({"name": k, "now_us": n, "base_us": b, "delta_us": n - b,
                     "change": (n / b - 1) if b > 0 else float("inf") if n > 0 else 0.0,
                     "share_before": b / total_base if total_base else 0.0,
                     "share_after": n / total_now if total_now else 0.0})
    rows.sort(key=lambda r: -r["delta_us"])
    return rows[:top]


def explain(now: dict | None, base: dict | None, ratio: float | None = None, top: int = 3) -> dict | None:
    """The operators and modules whose calibrated time grew most between a baseline's profile and
    this run's (``ratio``: the calibration kernels' now/baseline, so a slower machine is not read as
    a slower operator), and the module holding the extra memory at the peak. None without both."""
    if not now or not base:
        return None
    r = ratio if ratio and ratio > 0 else 1.0
    tn, tb = now.get("total_us", 0.0) / r, base.get("total_us", 0.0)
    ops = _growth(now.get("ops", {}), base.get("ops", {}), r, tn, tb, top)
    for row in ops:  # the module where this operator's growth sits
        wn, wb = (now.get("op_modules") or {}).get(row["name"], {}), (base.get("op_modules") or {}).get(row["name"], {})
        mods = {m: wn.get(m, 0.0) / r - wb.get(m, 0.0) for m in set(wn) | set(wb)}
        row["module"] = max(mods, key=mods.get) if mods else None
    # modules by their own time (less their child modules'): the innermost module that grew, not every
    # module around it; shares of the whole forward
    mods_now, mods_base = now.get("modules_self", {}), base.get("modules_self", {})
    modules = _growth(mods_now, mods_base, r, sum(mods_now.values()) / r, sum(mods_base.values()), top)
    for row in modules:
        row["inclusive_change"] = ((now.get("modules", {}).get(row["name"], 0.0) / r)
                                   / base.get("modules", {}).get(row["name"], float("nan")) - 1)
    # what counts as "where": an operator or module holding at least a fifth of the phase's growth
    grown = max(sum(x["delta_us"] for x in _growth(now.get("ops", {}), base.get("ops", {}), r, 1, 1, 10**6)
                    if x["delta_us"] > 0),
                sum(x["delta_us"] for x in _growth(mods_now, mods_base, r, 1, 1, 10**6) if x["delta_us"] > 0))
    for row in ops + modules:
        row["named"] = grown > 0 and row["delta_us"] >= 0.2 * grown
    mn, mb = now.get("memory") or {}, base.get("memory") or {}
    mem = None
    if mn.get("peak_bytes") is not None and mb.get("peak_bytes") is not None:
        an, ab = mn.get("at_peak") or {}, mb.get("at_peak") or {}
        grown = sorted(((k, an.get(k, 0) - ab.get(k, 0)) for k in set(an) | set(ab)), key=lambda kv: -kv[1])
        mem = {"peak_bytes": mn["peak_bytes"], "base_peak_bytes": mb["peak_bytes"],
               "change": mn["peak_bytes"] / mb["peak_bytes"] - 1 if mb["peak_bytes"] else 0.0,
               "module": grown[0][0] if grown and grown[0][1] > 0 else None,
               "module_bytes": grown[0][1] if grown else 0}
    return {"ops": ops, "modules": modules, "memory": mem}


def _pct(x: float) -> str:
    return "new" if x == float("inf") else f"{x:+.0%}"


def lines(ex: dict, phase: str) -> list[str]:
    """The table a regression's failure details (and its GitHub issue) carry."""
    out = [f"where {phase} grew (profile repeats, calibrated to the baseline machine speed):",
           f"  {'operator':<40} {'change':>7} {'share before -> after':>22}  module"]
    for r in ex["ops"]:
        out.append(f"  {r['name'][:40]:<40} {_pct(r['change']):>7} {r['share_before']:>10.1%} -> "
                   f"{r['share_after']:<8.1%}  {r.get('module') or ''}")
    out.append(f"  {'module (forward, own time)':<40} {'change':>7} {'share before -> after':>22}")
    for r in ex["modules"]:
        out.append(f"  {r['name'][:40]:<40} {_pct(r['change']):>7} {r['share_before']:>10.1%} -> "
                   f"{r['share_after']:<8.1%}")
    return out


def headline(ex: dict) -> str:
    """``aten::mm +19% (model.layers.*.mlp); module model.layers.*.mlp +25%``: the top of each table."""
    bits = [f"{r['name']} {_pct(r['change'])}" + (f" ({r['module']})" if r.get("module") else "")
            for r in ex["ops"] if r.get("named")]
    bits += [f"module {r['name']} {_pct(r['change'])} (own time)" for r in ex["modules"] if r.get("named")]
    if not any(r.get("named") for r in ex["ops"]) and bits:
        bits.append("no operator grew as much: the time is in the module's own Python or host code")
    return "; ".join(bits)
