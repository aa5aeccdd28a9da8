"""Run the reference (default CPU float64) on the suite's stored inputs and build a golden."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.anatomy.capture import capture_forward, greedy
from harness.golden import store
from harness.golden.sections import GoldenSection
from harness.messages import display
from harness.suite.loader import LoadedSuite
from harness.weights import weights_provenance


class ReferenceError(Exception):
    pass


class DegenerateReference(store.GoldenError):
    """The reference says nothing (harness.precision.degenerate): refused, nothing written. A
    GoldenError, so `golden generate` says it for this suite in one line and goes on to the next."""


def refuse_degenerate(ls: LoadedSuite, info: dict, outputs: dict, generation: dict | None = None) -> None:
    from harness.precision.degenerate import why_degenerate

    why = why_degenerate(outputs, generation)
    if why:
        raise DegenerateReference(
            f"{ls.name}: refused, its {info['backend']}:{info['dtype']} reference says nothing: {why}; no golden "
            "written (every check compared with it would pass at an error of 0: is the model pruned, see the "
            "suite's [prune], and its initialisation in range?)")


def parse_reference(spec: str) -> tuple[str, str]:
    backend, sep, dtype = spec.partition(":")
    from harness.models.build import DTYPES

    if not sep or not backend or dtype not in DTYPES:
        raise ReferenceError(f"reference {spec!r}: expected BACKEND:DTYPE with DTYPE one of {', '.join(DTYPES)}")
    return backend, dtype


def reference_model(ls: LoadedSuite, reference: str | None = None, transform=None):
    """(model, ModelConfig, reference info) of the reference run, before any numerics gains."""
    from harness.backends import get
    from harness.models.build import build_model

    p = ls.suite.checks.precision
    bname, dtype = parse_reference(reference or p.reference)
    be = get(bname)
    ok, why = be.availability()
    if not ok:
        raise ReferenceError(f"reference backend {bname}: {why}")
    dev = be.device()
    model, mc = build_model(ls, dtype, dev, seed=p.seed)
    if transform is not None:
        model = transform(model)
    model.eval()
    info = {"backend": bname, "dtype": dtype, "device": be.device_name(), "notes": mc.notes,
            "architecture": mc.architecture}
    return model, dev, info


def reference_outputs(ls: LoadedSuite, ids: torch.Tensor, reference: str | None = None, transform=None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(module outputs incl. logits, generation, reference info) of the reference run."""
    model, dev, info = reference_model(ls, reference, transform)
    p = ls.suite.checks.precision
    outs = capture_forward(model, ids.to(dev), p.capture)
    gen = greedy(model, ids.to(dev), p.generate_tokens)
    return outs, gen, info


def budget_draws(ls: LoadedSuite, ids: torch.Tensor) -> list[torch.Tensor]:
    """Input draws for budget measurement: the golden's own ids, then seeded draws of the same shape."""
    from harness.models.build import model_config, seeded_tokens

    p = ls.suite.checks.precision
    vocab = model_config(ls).config.vocab_size
    return [ids] + [seeded_tokens(vocab, p.batch_size, p.seq_len, p.seed + 1 + 1000 * d)
                    for d in range(1, p.budget_draws)]


@dataclass
class ReferenceRun:
    """What a section producer gets: the float64 reference and what the forward golden already made
    with it. ``model`` is shared: a producer that trains must train a copy."""

    ls: LoadedSuite
    model: torch.nn.Module  # the reference, eval(), realistic-numerics gains applied
    device: object
    ids: torch.Tensor  # [B, S] the golden's input ids (CPU, int64)
    draws: list[torch.Tensor]  # input draws of the budget measurement; draws[0] is ids
    dtypes: list[str]  # low-precision dtypes of the suite to measure budgets for
    numerics: dict | None  # the manifest's numerics entry (harness.models.numerics.apply)
    generation: dict[str, torch.Tensor]  # the reference's greedy generation (uncached)
    outputs: dict[str, torch.Tensor]  # the forward golden's module outputs (incl. logits)
    capture: object = None  # the forward Capture (recorded module inputs), full mode only
    notes: list[str] = field(default_factory=list)


def registered_sections() -> dict[str, GoldenSection]:
    """name -> section, of the golden's sections beyond the forward pass (harness.golden.store, format
    3): those the registered checks declare (``Check.golden_sections``), in the checks' order. Asked
    through the entry-point registry, not an import: the checks sit above this layer, and a vendor's
    check brings its own section without an edit here (docs/adding-a-check.md)."""
    from harness.registry import of_group

    return {sec.name: sec for check in of_group("harness.checks") for sec in check.golden_sections}


def section_modules(ls: LoadedSuite) -> dict[str, tuple[GoldenSection, dict]]:
    """name -> (section, the suite's spec of it) of the sections this suite wants (a spec of None:
    the suite does not want it, e.g. its check is disabled)."""
    out = {}
    for name, sec in registered_sections().items():
        spec = sec.spec(ls)
        if spec is not None:
            out[name] = (sec, spec)
    return out


def build_sections(ref: ReferenceRun) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """({name: manifest entry}, {name: tensors to store}) of every section the suite wants."""
    entries, files = {}, {}
    for name, (sec, spec) in section_modules(ref.ls).items():
        t = time.perf_counter()
        entry, tensors = sec.build(ref)
        packed, meta = store.pack_section(tensors)
        entries[name] = {**entry, "spec": store.jsonable(spec), "tensors": meta,
                         "seconds": round(time.perf_counter() - t, 3)}
        files[name] = packed
    return entries, files


def build_golden(ls: LoadedSuite, reference: str | None = None, ids: torch.Tensor | None = None,
                 transform=None, budgets: bool = True) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(manifest without files, {file stem: tensors}) for the suite: reference outputs, each captured
    module's inputs, realistic-numerics gains and measured per-module budgets."""
    import safetensors
    import transformers

    from harness.anatomy.capture import capture_with_inputs
    from harness.models import numerics
    from harness.models.build import model_config, seeded_tokens
    from harness.precision import budgets as bud

    p = ls.suite.checks.precision
    if ids is None:
        vocab = model_config(ls).config.vocab_size
        ids = seeded_tokens(vocab, p.batch_size, p.seq_len, p.seed + 1)
    t = time.perf_counter()
    model, dev, info = reference_model(ls, reference, transform)
    num = None
    if p.numerics == "realistic" and ls.weights_path is None:  # real weights are used as they are
        num = numerics.calibrate(model, ids.to(dev), p.attention_logit_std, p.residual_growth)
    record = p.golden_mode == "full"
    outs, cap = capture_with_inputs(model, ids.to(dev), p.capture, inputs=record,
                                    convert=lambda x: x.detach().to("cpu"))
    refuse_degenerate(ls, info, outs)  # before generation and budgets spend minutes on it
    gen = greedy(model, ids.to(dev), p.generate_tokens)
    refuse_degenerate(ls, info, outs, gen)
    packed, meta = store.pack(outs, p.golden_mode, p.sample_size, cap.input_tensors if record else None)
    manifest = {
        "format": store.FORMAT, "suite": ls.name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "python": platform.python_version()},
        "reference": info, "config_hash": store.config_hash(ls), "input_spec": store.input_spec(ls),
        "order": list(outs), "tensors": meta,
    }
    manifest["weights"] = weights_provenance(ls)
    if record:
        manifest["module_inputs"] = {n: st for n, st in cap.inputs.items() if n in outs}
        if cap.not_replayable:
            manifest["not_replayable"] = cap.not_replayable
    if num is not None:
        manifest["numerics"] = {k: num[k] for k in ("attention_logit_std", "residual_growth", "attention_gain",
                                                       "residual_gain")}
        manifest["numerics"]["stats"] = {"init": num["before"], "realistic": num["after"]}
    dtypes = [d for d in ls.suite.dtypes if d in bud.MEASURED_DTYPES and d != info["dtype"]]
    draws, runs = None, [(outs, cap)]
    if budgets and record and dtypes and info["dtype"] == "float64":
        draws = budget_draws(ls, ids)
        manifest["budgets"] = bud.measure(ls, draws, model, dtypes, runs, manifest.get("numerics"))
    if budgets and info["dtype"] == "float64":
        manifest.update(_quantization(ls, model, dev, ids, draws, runs, manifest.get("numerics")))
    files = {"inputs": {"input_ids": ids.cpu().to(torch.int64).contiguous()}, "modules": packed,
             "generation": {k: v.contiguous() for k, v in gen.items()}}
    if budgets and info["dtype"] == "float64" and section_modules(ls):
        ref = ReferenceRun(ls, model, dev, ids.cpu(), draws or budget_draws(ls, ids.cpu()), dtypes,
                           manifest.get("numerics"), gen, outs, cap if record else None)
        manifest["sections"], more = build_sections(ref)
        files.update(more)
    manifest["reference_seconds"] = round(time.perf_counter() - t, 3)
    return manifest, files


def _quantization(ls: LoadedSuite, model, dev, ids, draws, runs, numerics_entry) -> dict:
    """``{"quantization": ...}``: the quantized model's own error per activation dtype, for suites
    with a quantization scheme (the quantization check's budgets); ``{}`` otherwise."""
    from harness.anatomy.capture import forward_logits
    from harness.precision.quantization import SIMULATED, formats, measure

    if not set(formats(ls)) & set(SIMULATED) or not ls.suite.checks.quantization.enabled:
        return {}
    draws = draws or budget_draws(ls, ids)
    if len(runs) == len(draws):
        ref = [o["logits"] for o, _ in runs]
    else:
        with torch.no_grad():
            ref = [forward_logits(model, d.to(dev)).cpu() for d in draws]
    q = ls.suite.checks.quantization
    acts = [q.compute_dtype] if q.compute_dtype else [d for d in ls.suite.dtypes if d in ("float32", "bfloat16", "float16")]
    return {"quantization": measure(ls, draws, ref, acts, numerics_entry)}


def check_writable(path: Path) -> None:
    """Before the reference is built (minutes for a large suite): the folder the golden goes into
    takes files, else one line now instead of a traceback at the end."""
    from harness.files import atomic

    target = path if path.is_dir() else path.parent
    try:
        atomic.check_writable(target, "golden directory")
    except OSError as e:
        raise store.GoldenError(str(e)) from None


def generate(ls: LoadedSuite, root: str | Path | None = None, reference: str | None = None,
             update: bool = False, transform=None) -> Path:
    path = store.golden_dir(ls.name, root)
    if store.exists(path) and not update:  # refuse before spending time on the reference
        raise store.GoldenError(f"{display(path)}: a golden already exists; pass --update to replace it "
                                "(see `harness golden diff` for what would change)")
    check_writable(path)
    ids = None
    if update and store.exists(path):
        try:  # keep the stored inputs when they still fit the spec
            old = store.load_golden_dir(path)
            if old.manifest.get("input_spec") == store.input_spec(ls):
                ids = old.inputs
        except store.GoldenError:
            pass
    manifest, files = build_golden(ls, reference, ids, transform)
    return store.write_golden(path, manifest, files, update=update)
