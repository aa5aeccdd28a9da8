"""`harness golden generate|diff|verify SUITE...`: make, compare and verify goldens (docs/precision.md)."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("golden", help="generate, diff and verify golden reference outputs")
    gs = p.add_subparsers(dest="golden_command", metavar="ACTION")
    g = gs.add_parser("generate", help="run the reference and write golden/<suite>/")
    g.add_argument("suites", nargs="*", help="suite names or paths; default: every suite")
    g.add_argument("--reference", default=None, metavar="BACKEND:DTYPE",
                   help="reference run (default: the suite's checks.precision.reference, cpu:float64)")
    g.add_argument("--update", action="store_true", help="replace an existing golden")
    g.add_argument("--golden-dir", default=None, help="golden root (default: harness.toml golden_dir)")
    g.set_defaults(func=generate)
    d = gs.add_parser("diff", help="what an update would change: a fresh reference run vs the stored golden")
    d.add_argument("suites", nargs="*")
    d.add_argument("--reference", default=None, metavar="BACKEND:DTYPE")
    d.add_argument("--golden-dir", default=None)
    d.set_defaults(func=diff)
    v = gs.add_parser("verify", help="check sha256, sizes, config hash and input spec of stored goldens")
    v.add_argument("suites", nargs="*")
    v.add_argument("--golden-dir", default=None)
    v.set_defaults(func=verify)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _suites(args):
    from harness.settings import load_settings
    from harness.suite.loader import discover, load_suite, resolve_names

    root = load_settings().suites_dir
    paths = resolve_names(args.suites, root) if args.suites else discover(root)
    return [load_suite(p) for p in paths]


def _guard(fn):
    def run(args) -> int:
        from harness.golden.store import GoldenError
        from harness.precision.generate import ReferenceError
        from harness.suite.loader import SuiteError

        try:
            return fn(args)
        except (GoldenError, SuiteError, ReferenceError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


@_guard
def generate(args) -> int:
    from harness.files import atomic
    from harness.golden import store
    from harness.golden.store import GoldenError
    from harness.precision.generate import generate as gen

    suites = _suites(args)
    try:  # before the first reference is built: a read-only root would cost every suite's run
        atomic.check_writable(store.golden_root(args.golden_dir), "golden directory")
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from harness.models.build import cpu_threads

    bad = 0
    for ls in suites:
        try:
            with cpu_threads(1):  # the pruned models' references: one intra-op thread (HARNESS_CPU_THREADS)
                path = gen(ls, args.golden_dir, args.reference, update=args.update)
        except GoldenError as e:
            print(f"error: {e}", file=sys.stderr)
            bad += 1
            continue
        size = sum(f.stat().st_size for f in store.current_dir(path).iterdir())
        print(f"wrote {path} ({size / 1024:.0f} KiB)")
    return 1 if bad else 0


@_guard
def diff(args) -> int:
    from harness.golden import store
    from harness.precision.generate import build_golden

    changed = 0
    for ls in _suites(args):
        path = store.golden_dir(ls.name, args.golden_dir)
        old = store.load_golden_dir(path)
        same_inputs = old.manifest.get("input_spec") == store.input_spec(ls)
        manifest, files = build_golden(ls, args.reference, old.inputs if same_inputs else None)
        print(f"{ls.name}: {path}")
        _diff_manifest(old.manifest, manifest)
        n_changed = sum(_diff_module(n, old.modules, files["modules"])
                        for n in dict.fromkeys(old.order + manifest["order"]))
        for k, v in files["generation"].items():
            if k in old.generation and not torch_equal(old.generation[k], v):
                print(f"  ~ generation.{k} differs")
                n_changed += 1
        n_changed += _diff_sections(old, manifest, files)
        _print_budgets(old.manifest.get("budgets") or {}, manifest.get("budgets") or {})
        print(f"  {n_changed} tensor(s) would change" if n_changed else "  no change")
        changed += bool(n_changed)
    return 1 if changed else 0


def _diff_manifest(old: dict, new: dict) -> None:
    """The manifest entries that identify a golden, where they differ (the reference without its notes)."""
    for key in ("config_hash", "input_spec", "versions", "reference"):
        a, b = old.get(key), new.get(key)
        if key == "reference":
            a, b = {k: v for k, v in (a or {}).items() if k != "notes"}, {k: v for k, v in b.items() if k != "notes"}
        if a != b:
            print(f"  {key}: {a} -> {b}")


def _diff_module(n: str, old: dict, new: dict) -> int:
    """Print how module output ``n`` would change; 1 where it would, else 0."""
    from harness.precision.compare import tensor_metrics

    if n not in old:
        print(f"  + {n} (new)")
        return 1
    if n not in new:
        print(f"  - {n} (removed)")
        return 1
    if old[n].shape != new[n].shape:
        print(f"  ~ {n}: shape {list(old[n].shape)} -> {list(new[n].shape)}")
        return 1
    if not old[n].is_floating_point():
        eq = (old[n] == new[n]).double().mean().item()
        if eq < 1:
            print(f"  ~ {n}: {1 - eq:.1%} of chosen experts differ")
            return 1
        return 0
    m = tensor_metrics(new[n], old[n])
    if m["max_abs_err"] > 0:
        print(f"  ~ {n}: max_abs {m['max_abs_err']:.3g} max_rel {m['max_rel_err']:.3g} "
              f"cosine {m['cosine']:.9f} rel_rmse {m['rel_rmse']:.3g}")
        return 1
    return 0


def _diff_sections(old, manifest: dict, files: dict) -> int:
    """Per section (training, decode): added or removed, its spec, and each tensor that moves.
    Returns how many tensors (or whole sections) would change."""
    from harness.precision.compare import tensor_metrics

    a, b = old.manifest.get("sections") or {}, manifest.get("sections") or {}
    n = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"  {'+' if name in b else '-'} section {name} ({'new' if name in b else 'removed'})")
            n += 1
            continue
        if a[name].get("spec") != b[name].get("spec"):
            print(f"  section {name}: spec {a[name].get('spec')} -> {b[name].get('spec')}")
        was, now = old.section_tensors.get(name, {}), files.get(name, {})
        for key in list(dict.fromkeys([*was, *now])):
            x, y = was.get(key), now.get(key)
            if x is None or y is None or x.shape != y.shape:
                print(f"  ~ {name}.{key}: {'added' if x is None else 'removed' if y is None else 'shape changed'}")
                n += 1
            elif not torch_equal(x, y):
                n += 1
                if x.is_floating_point():
                    m = tensor_metrics(y, x)
                    print(f"  ~ {name}.{key}: max_abs {m['max_abs_err']:.3g} rel_rmse {m['rel_rmse']:.3g}")
                else:
                    print(f"  ~ {name}.{key}: {(x != y).double().mean().item():.1%} of entries differ")
    return n


def _print_budgets(old: dict, new: dict) -> None:
    """Per dtype and module: the measured clean isolated error (max over draws) and the budget the
    check holds the module to (k x clean + floor, capped by the tolerance), stored -> regenerated.
    Budgets are informative: they do not count as a change unless they move by more than 10%."""
    for dtype in sorted(set(old) | set(new)):
        o, n = (old.get(dtype) or {}), (new.get(dtype) or {})
        om, nm = o.get("modules") or {}, n.get("modules") or {}
        print(f"  budgets[{dtype}] (isolated rel_rmse: clean max over {n.get('draws', o.get('draws'))} draws, "
              f"budget = {n.get('k', o.get('k'))} x clean + {n.get('floor', o.get('floor'))}; "
              f"|scale error| budget after '/'):")
        for mod in list(dict.fromkeys(list(om) + list(nm))):
            a, b = om.get(mod), nm.get(mod)
            if a and b:
                moved = abs(b["budget"] - a["budget"]) / a["budget"] if a["budget"] else 0.0
                mark = f"  (moved {moved:.0%})" if moved > 0.1 else ""
                print(f"    {mod:<44} clean {b['max']:.3g}  budget {a['budget']:.3g} -> {b['budget']:.3g}"
                      f" / {b.get('scale', {}).get('budget', float('nan')):.3g}{mark}")
            else:
                e = b or a
                print(f"    {mod:<44} clean {e['max']:.3g}  budget {e['budget']:.3g}  ({'new' if b else 'removed'})")
        noise = n.get("router_noise") or o.get("router_noise") or {}
        for gate, v in noise.items():
            print(f"    {gate:<44} router-logit noise {v:.3g} (flips within 2k x this are near ties)")
        lg = (n.get("propagated") or {}).get("logits")
        if lg:
            print(f"    {'logits (propagated)':<44} clean {lg['max']:.3g}  budget {lg['budget']:.3g}")
        lf = (n.get("propagated") or {}).get("logits_forced")
        if lf:
            print(f"    {'logits (propagated, routers forced)':<44} clean {lf['max']:.3g}  budget {lf['budget']:.3g}")


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a, b)


@_guard
def verify(args) -> int:
    from harness.golden.store import GoldenError, load_golden

    bad = 0
    for ls in _suites(args):
        try:
            g = load_golden(ls, args.golden_dir)
            _check_section_values(g)
            secs = ", ".join(f"{k}: {len(v)}" for k, v in g.section_tensors.items())
            print(f"ok    {g.path} ({len(g.order)} tensors, torch {g.manifest['versions']['torch']}"
                  + (f"; sections {secs}" if secs else "") + ")")
        except GoldenError as e:
            print(f"error: {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


def _check_section_values(g) -> None:
    """Each section's values against what its check declares (ids in the vocabulary, 0/1 masks): what
    the target's item would find, found here first."""
    from harness.checks import registry
    from harness.golden.store import check_values

    for name in registry().names():
        for sec in registry().get(name).golden_sections:
            if sec.name in g.section_tensors:
                check_values(g, sec.name, g.section_tensors[sec.name], sec.values)
