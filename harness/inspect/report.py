"""Run the whole inspection and render it: plain text for people, JSON for tools."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from harness.inspect.coverage import COMPOSITE, FALLBACK, MISSING, NATIVE, UNKNOWN, Coverage, coverage
from harness.inspect.flops import FlopsReport, compute_flops
from harness.inspect.params import ParamReport, Target, count_parameters, inspect_params, meta_model
from harness.inspect.trace import Inventory, TraceError, trace_model
from harness.messages import first_line


@dataclass
class InspectReport:
    target: str
    architecture: str
    model_type: str
    params: ParamReport
    flops: FlopsReport
    inventory: Inventory | None
    coverages: list[Coverage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"target": self.target, "architecture": self.architecture, "model_type": self.model_type,
                "params": self.params.to_dict(), "flops": self.flops.to_dict(),
                "inventory": self.inventory.to_dict() if self.inventory else None,
                "coverage": [c.to_dict() for c in self.coverages], "notes": self.notes, "timings": self.timings}


def inspect(target: Target, *, backends: list[str] | None = None, trace: str = "full", batch: int = 1,
            seq: int = 16, prefill_len: int = 4096, decode_context: int = 4096,
            dtype: torch.dtype = torch.bfloat16) -> InspectReport:
    """``trace``: ``full`` (unpruned model on meta), ``pruned`` (the suite's pruned model on meta) or
    ``none``."""
    t0 = time.perf_counter()
    timings = {}
    model, mc = meta_model(target, pruned=False, dtype=dtype)
    timings["build_meta_s"] = time.perf_counter() - t0
    params = count_parameters(model, mc)
    _wrapper_note(target, mc, params)
    flops = compute_flops(mc.config, params, prefill_len, decode_context)
    timings["params_s"] = time.perf_counter() - t0 - timings["build_meta_s"]
    inv = None
    if trace != "none":
        t = time.perf_counter()
        if trace == "pruned":
            if target.suite is None:
                raise ValueError("--trace pruned needs a suite (a bare config.json has no pruning); use --trace full")
            del model
            model, _ = meta_model(target, pruned=True, dtype=dtype)
        inv, trace_notes = trace_target(target, model, trace == "pruned", dtype, batch=batch, seq=seq)
        timings["trace_s"] = time.perf_counter() - t
    else:
        trace_notes = []
    del model
    covs = []
    if inv is not None:
        covs = [coverage(inv, b, target.suite) for b in backends or []]
    timings = {k: round(v, 3) for k, v in timings.items()}
    return InspectReport(target.name, mc.architecture, mc.model_type, params, flops, inv, covs,
                         trace_notes + list(mc.notes), timings)


def trace_target(target: Target, model: torch.nn.Module, pruned: bool, dtype: torch.dtype, *, batch: int = 1,
                 seq: int = 16) -> tuple[Inventory, list[str]]:
    """The op inventory of one forward + backward of ``model`` (on meta), and notes saying what was
    not traced and why. Model code that branches on tensor values (``.item()``, ``nonzero()``,
    a data-dependent expert loop) cannot run on meta: then the suite's pruned model is traced on the
    CPU with seeded weights (the same modules and operators, small shapes); where that fails too, the
    inventory is the ops recorded before the first failure, marked incomplete. Never raises for what
    the model code does: the totals and FLOPs never depend on the trace."""
    meta = {"model": target.name, "dtype": str(dtype).replace("torch.", ""), "pruned": pruned}
    try:
        return trace_model(model, model.config.vocab_size, batch=batch, seq=seq, meta=meta), []
    except TraceError as e:
        first = e
    why = (f"the {'pruned' if pruned else 'full'} model's trace on meta stopped in {first.module} during its "
           f"{first.phase} ({type(first.error).__name__}: {first_line(first.error, 160)})")
    try:
        small = _cpu_pruned_model(target, dtype)
        inv = trace_model(small, small.config.vocab_size, batch=batch, seq=seq,
                          meta=dict(meta, pruned=True, fallback=why))
        return inv, [f"trace: {why}; the op inventory is the pruned model's, traced on cpu with seeded weights "
                     "(the same operators, pruned shapes)"]
    except Exception as e:  # noqa: BLE001 - the pruned build or its trace failed as well: keep what the first recorded
        again = (f"{e.phase} in {e.module} ({type(e.error).__name__}: {first_line(e.error, 160)})" if isinstance(e, TraceError)
                 else f"{type(e).__name__}: {first_line(e, 160)}")
    inv = first.partial
    inv.meta.update(incomplete=why, fallback_failed=again)
    done = "its forward" if first.phase == "backward" else "the modules before it"
    return inv, [f"trace: {why}; the pruned model on cpu failed too ({again}): the op inventory is incomplete, "
                 f"{len(inv.ops)} ops from {done}"]


FALLBACK_MAX_PARAMS = 100_000_000  # pruned suites have 0.1-5M; the host trace of 100M in bf16 takes seconds


def _cpu_pruned_model(target: Target, dtype: torch.dtype) -> torch.nn.Module:
    """The suite's pruned model (a bare config.json: pruned as ``harness init`` would) on the CPU with
    seeded random weights: values, so data-dependent model code runs."""
    from harness.models.build import cast_model, instantiate
    from harness.models.config import architecture_class, build_config
    from harness.models.prune import plan_for
    from harness.suite.schema import PruneSection

    if target.suite is not None:
        mc = target.model_config(pruned=True)
    else:  # what `harness init` would write for it (a wrapper: its decoder, or a 1-layer vision tower)
        plan, _ = plan_for(target.raw_config, target.path.name if target.path else target.name)
        mc = build_config(target.raw_config, PruneSection.model_validate(plan.prune), architecture=plan.architecture)
    # never a large model on the host: a wrapper's vision tower, or a part the pruning does not reach,
    # can leave billions of parameters (a 26B wrapper was killed for memory here)
    shape, _ = meta_model(target, pruned=True, dtype=dtype, mc=mc)
    n = sum(p.numel() for p in shape.parameters())
    del shape
    if n > FALLBACK_MAX_PARAMS:
        raise ValueError(f"its pruned model still has {n / 1e6:.0f}M parameters (over {FALLBACK_MAX_PARAMS / 1e6:.0f}M: "
                         "not run on the host)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("cpu"):
            model = (instantiate(target.suite, mc, dtype) if target.suite is not None
                     else architecture_class(mc.architecture)(mc.config))
    return cast_model(model, dtype, "cpu")


def _wrapper_note(target: Target, mc, params) -> None:
    """A suite that tests a multimodal wrapper's language decoder (``mc.part``: built from
    ``text_config``) is inspected as that decoder; the note gives the whole wrapper's parts, so the
    official total (which counts the vision tower) is on the same page."""
    if target.suite is None or not mc.part:
        return
    try:
        whole, wmc = inspect_params(Target(target.name, target.raw_config))
    except Exception as e:  # the decoder's report stands on its own; say why the whole is missing
        params.notes.append(f"the whole wrapper could not be counted ({type(e).__name__}: {str(e)[:120]})")
        return
    parts = ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in (whole.by_part or {"overall": whole.total}).items())
    src = target.suite.config_path
    params.notes.append(f"this suite tests the language decoder only; the whole {wmc.architecture}: {parts} "
                        f"(`harness inspect {src}` reports it)")


# --- text -----------------------------------------------------------------------------------------
def _n(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3f}{unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*map(str, r)) for r in rows]


def coverage_text(cov: Coverage, max_modules: int = 4) -> list[str]:
    lines = [f"Coverage on backend {cov.backend} (source: {cov.source})"] + [f"  {w}" for w in cov.warnings]
    counts = cov.counts()
    lines.append("  " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    miss = cov.by_status(MISSING)
    if miss:
        lines.append(f"  MISSING ({len(miss)}):")
        for o in miss:
            tag = " [known gap, tracked]" if o.known_gap else ""
            mods = ", ".join(o.modules[:max_modules]) + (f" (+{len(o.modules) - max_modules})"
                                                          if len(o.modules) > max_modules else "")
            lines.append(f"    {o.op}{tag}: {o.how}; needed by {mods}")
    for status in (UNKNOWN, FALLBACK):
        items = cov.by_status(status)
        if items:
            lines.append(f"  {status} ({len(items)}): " + ", ".join(o.op for o in items))
    lines += [f"  note: {n}" for n in cov.notes]
    return lines


def inventory_table(inv: Inventory, max_modules: int = 3) -> list[str]:
    rows = []
    for name in sorted(inv.ops, key=lambda k: (-inv.ops[k].count, k)):
        r = inv.ops[name]
        sig = r.signatures.most_common(1)[0][0] if r.signatures else ""
        if len(sig) > 60:
            sig = sig[:57] + "..."
        mods = sorted(r.modules)
        m = ", ".join(x.split(" [")[0] for x in mods[:max_modules]) + (f" (+{len(mods) - max_modules})"
                                                                      if len(mods) > max_modules else "")
        rows.append([name, r.count, r.forward, r.backward, ",".join(sorted(r.dtypes)), sig, m])
    return _table(rows, ["op", "calls", "fwd", "bwd", "dtypes", "most common inputs", "modules"])


def render_text(rep: InspectReport, show_inventory: bool = True) -> str:
    p, f = rep.params, rep.flops
    out: list[str] = [f"== {rep.target}: {rep.architecture} (model_type {rep.model_type or '?'}) =="]
    for cov in rep.coverages:  # what is missing leads
        out += coverage_text(cov) + [""]
    out += [f"note: {n}" for n in rep.notes + p.notes + f.notes]
    out += ["", "Parameters (unpruned, meta device; buffers excluded)",
            f"  total                     {_n(p.total):>10}   ({p.total:,})",
            f"  activated per token       {_n(p.activated):>10}   excl. input embedding, incl. lm_head "
            "(DeepSeek/Moonshot convention)",
            f"  activated incl. embedding {_n(p.activated_with_embedding):>10}   (Qwen/Mistral convention)",
            f"  non-embedding             {_n(p.non_embedding):>10}   (excl. embedding and lm_head)",
            f"  layers {p.num_layers}, routed experts {p.num_experts or '-'}, top-k {p.experts_per_token or '-'}"
            f"{', tied embeddings' if p.tied_embeddings else ''}", ""]
    out += ["  " + line for line in _table(
        [[k, _n(v), _n(p.activated_by_kind.get(k, 0)), f"{100 * v / p.total:.1f}%"] for k, v in p.by_kind.items()],
        ["module kind", "params", "activated", "share"])]
    out += ["", "Checkpoint bytes"]
    for scen, parts in p.bytes.items():
        out.append(f"  {scen}: {_bytes(parts['total'])}")
        if len(parts) > 2:
            out += [f"    {k}: {_bytes(v)}" for k, v in parts.items() if k != "total"]
    out += ["", f"FLOPs per token (multiply-add = 2): matmuls {_n(f.matmul_flops_per_token)}, "
            f"prefill ({f.prefill_len} tokens) {_n(f.prefill_flops_per_token)}, "
            f"decode (context {f.decode_context}) {_n(f.decode_flops_per_token)}"
            + (f" (as transformers runs MLA: {_n(f.decode_flops_per_token_hf)})" if f.decode_flops_per_token_hf else ""),
            f"KV cache per token ({f.kv_dtype_bytes}-byte elements):"]
    out += [f"  {k}: {_bytes(v)}" for k, v in f.kv_cache_bytes_per_token.items()]
    if rep.inventory is not None:
        m = rep.inventory.meta
        out += ["", f"Operator inventory: {len(rep.inventory.ops)} aten overloads, "
                f"{sum(r.count for r in rep.inventory.ops.values())} calls; "
                + ("INCOMPLETE (see the trace note); " if m.get("incomplete") else "")
                + f"one forward + backward of the "
                f"{'pruned' if m.get('pruned') else 'full'} model on {m.get('device')} in {m.get('dtype')}, "
                f"batch {m.get('batch')} x {m.get('seq')} tokens"]
        if show_inventory:
            out += ["  " + line for line in inventory_table(rep.inventory)]
    out += ["", "timings: " + ", ".join(f"{k} {v}" for k, v in rep.timings.items())]
    return "\n".join(out)


def missing_summary(covs: list[Coverage]) -> list[str]:
    return [f"{c.backend}: {o.op}" for c in covs for o in c.missing(include_known=False)]


# --- coverage matrix: models x backends ------------------------------------------------------------
_PREFERRED = ("cpu", "cuda", "rocm", "xpu", "npu", "musa", "mlu", "mps")


def all_backends() -> list[str]:
    """``--backends all``: the CPU, every backend (or flavour) with a declared op list, and every
    installed backend with a dispatch key, in a stable order."""
    from harness.backends import registry
    from harness.inspect.coverage import declared_op_lists

    names = {"cpu"} | set(declared_op_lists())
    for be in registry():
        if be.dispatch_key and be.available():
            names.add(be.name)
    return sorted(names, key=lambda n: (_PREFERRED.index(n) if n in _PREFERRED else len(_PREFERRED), n))


@dataclass
class CoverageMatrix:
    """Coverage of several models on several backends: ``cells[model][backend]``."""

    models: list[str]
    backends: list[str]
    cells: dict[str, dict[str, Coverage]]
    traces: dict[str, str] = field(default_factory=dict)  # model -> what was traced
    timings: dict[str, float] = field(default_factory=dict)
    # model -> why it has no row (a config init refuses, a suite that does not load, a model that
    # cannot be built): one bad model never costs the others their rows
    refused: dict[str, str] = field(default_factory=dict)

    def sources(self) -> dict[str, Coverage]:
        """backend -> one of its coverages (source, versions, warnings are per backend)."""
        return {b: self.cells[m][b] for m in self.models for b in self.backends}

    def needs(self, statuses=(MISSING, FALLBACK)) -> list[dict]:
        """One row per backend x op with that status: which models need it, through which modules.
        Missing ops that are not known gaps lead, then known gaps, then host fallbacks."""
        rows: dict[tuple[str, str], dict] = {}
        for m in self.models:
            for b in self.backends:
                for o in self.cells[m][b].ops.values():
                    if o.status not in statuses:
                        continue
                    r = rows.setdefault((b, o.op), {"backend": b, "op": o.op, "status": o.status, "how": o.how,
                                                    "known_gap": True, "models": {}})
                    r["known_gap"] = r["known_gap"] and o.known_gap
                    r["models"][m] = o.modules
        rank = {MISSING: 0, FALLBACK: 2}
        return sorted(rows.values(), key=lambda r: (rank.get(r["status"], 3) + (r["status"] == MISSING and
                                                                                r["known_gap"]),
                                                     self.backends.index(r["backend"]), r["op"]))

    def decomposed(self, reference: str = "cuda") -> list[dict]:
        """Ops that run as a composite decomposition on a backend while ``reference`` has a kernel for
        them (``_grouped_mm`` as per-expert matmuls): they run, but a kernel is worth asking for."""
        if reference not in self.backends:
            return []
        rows: dict[tuple[str, str], dict] = {}
        for m in self.models:
            ref = self.cells[m][reference]
            for b in self.backends:
                if b in (reference, "cpu"):
                    continue
                for o in self.cells[m][b].ops.values():
                    if o.status == COMPOSITE and ref.ops[o.op].status == NATIVE:
                        r = rows.setdefault((b, o.op), {"backend": b, "op": o.op, "how": o.how, "models": {}})
                        r["models"][m] = o.modules
        return sorted(rows.values(), key=lambda r: (self.backends.index(r["backend"]), r["op"]))

    def to_dict(self) -> dict:
        srcs = self.sources()
        return {"models": self.models, "backends": [
                    {"backend": b, "source": c.source, "version": c.version, "list_version": c.list_version,
                     "warnings": c.warnings} for b, c in srcs.items()],
                "counts": {m: {b: self.cells[m][b].counts() for b in self.backends} for m in self.models},
                "needs": self.needs(), "decomposed_where_cuda_has_a_kernel": self.decomposed(),
                "traces": self.traces, "timings": self.timings, "refused": self.refused}

    def _cell(self, cov: Coverage) -> str:
        c = cov.counts()
        miss = len(cov.missing(include_known=False))
        known = len(cov.missing()) - miss
        return (f"{c.get(NATIVE, 0)}/{c.get(COMPOSITE, 0)}/{c.get(FALLBACK, 0)}/{miss}"
                + (f"+{known}k" if known else "") + (f" ?{c[UNKNOWN]}" if c.get(UNKNOWN) else ""))

    def render_text(self, max_modules: int = 3) -> str:
        out = ["Operator coverage: models x backends (native/composite/fallback/missing ops; +Nk = known gaps, "
               "?N = unknown)"]
        needs = self.needs()
        if needs:
            out.append("")
        for r in needs:
            tag = r["status"].upper() + (" [known gap, tracked]" if r["status"] == MISSING and r["known_gap"] else "")
            out.append(f"{tag} on {r['backend']}: {r['op']} ({r['how']})")
            for m, mods in r["models"].items():
                more = f" (+{len(mods) - max_modules})" if len(mods) > max_modules else ""
                out.append(f"    {m}: {', '.join(mods[:max_modules])}{more}")
        out.append("")
        out += _table([[m] + [self._cell(self.cells[m][b]) for b in self.backends] for m in self.models],
                      ["model"] + self.backends)
        dec = self.decomposed()
        if dec:
            out += ["", "Composite here, a kernel on cuda (runs, slower):"]
            out += [f"  {r['backend']}: {r['op']} ({', '.join(r['models'])})" for r in dec]
        out.append("")
        for b, c in self.sources().items():
            out.append(f"{b}: {c.source}" + (f"; version {c.version}" if c.version else ""))
            out += [f"  {w}" for w in c.warnings]
        out += [f"not in the matrix: {m}: {why}" for m, why in self.refused.items()]
        if self.timings:
            out.append("timings: " + ", ".join(f"{k} {v}" for k, v in self.timings.items()))
        return "\n".join(out)

    def render_markdown(self, max_modules: int = 3) -> str:
        esc = _md_escape
        out = ["### Operator coverage", "",
               "native / composite / fallback (host) / missing ops per model and backend "
               "(+Nk: known gaps, tracked).", "",
               "| model | " + " | ".join(self.backends) + " |", "|---|" + "---|" * len(self.backends)]
        out += [f"| {esc(m)} | " + " | ".join(self._cell(self.cells[m][b]) for b in self.backends) + " |"
                for m in self.models]
        needs = self.needs()
        if needs:
            out += ["", "| backend | op | status | needed by |", "|---|---|---|---|"]
            for r in needs:
                who = "; ".join(f"{m}: " + ", ".join(mods[:max_modules]) + (" ..." if len(mods) > max_modules else "")
                                for m, mods in r["models"].items())
                st = r["status"] + (" (known gap)" if r["status"] == MISSING and r["known_gap"] else "")
                out.append(f"| {esc(r['backend'])} | `{r['op']}` | {st} | {esc(who)} |")
        dec = self.decomposed()
        if dec:
            out += ["", "Composite decomposition where cuda has a kernel (runs, slower): " + "; ".join(
                f"{esc(r['backend'])} `{r['op']}` ({esc(', '.join(r['models']))})" for r in dec)]
        out += ["", "Sources: " + "; ".join(f"{b}: {esc(c.source)}" for b, c in self.sources().items())]
        warns = [w for c in self.sources().values() for w in c.warnings]
        out += [f"> {esc(w)}" for w in warns]
        out += [f"> not in the matrix: {esc(m)}: {esc(why)}" for m, why in self.refused.items()]
        return "\n".join(out) + "\n"

    def missing(self) -> list[str]:
        return [f"{r['backend']}: {r['op']}" for r in self.needs((MISSING,)) if not r["known_gap"]]


def _md_escape(s: str) -> str:
    """Table-safe text: pipes and markup characters escaped, @mentions neutralised."""
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace("@", "@\u200b").replace("\n", " ")


def coverage_matrix(targets: list[Target], backends: list[str], *, dtype: torch.dtype = torch.bfloat16,
                    seq: int = 16, trace: str = "pruned", refused: dict[str, str] | None = None) -> CoverageMatrix:
    """Trace each model once on the meta device (the suite's pruned model by default: same
    architecture, same operators, milliseconds to build) and classify its ops for every backend."""
    t0 = time.perf_counter()
    cells, traces, refused = {}, {}, dict(refused or {})
    for target in targets:
        pruned = trace == "pruned" and target.suite is not None
        try:
            model, _ = meta_model(target, pruned=pruned, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a model transformers cannot build: its own line, the rest go on
            refused[target.name] = f"cannot build it ({type(e).__name__}: {first_line(e, 160)})"
            continue
        inv, notes = trace_target(target, model, pruned, dtype, seq=seq)
        del model
        traces[target.name] = (f"{'pruned' if pruned else 'full'} model on meta, {inv.meta['dtype']}, {len(inv.ops)} ops"
                               if not notes else f"{len(inv.ops)} ops; " + " ".join(notes))
        suite = target.suite if target.suite is not None else None
        cells[target.name] = {b: coverage(inv, b, suite) for b in backends}
    return CoverageMatrix([t.name for t in targets if t.name in cells], list(backends), cells, traces,
                          {"total_s": round(time.perf_counter() - t0, 3)}, refused)
