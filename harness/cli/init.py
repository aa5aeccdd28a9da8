"""``harness init CONFIG.json [--name N]``: write a working suite for a model the project has never
seen, or refuse in one line saying why.

1. refuse remote-code-only configs and architectures nobody can build (naming what was tried and the
   knob that fixes it: ``model.architecture``, ``model.adapter``);
2. prune from the config itself (harness/models/prune.py); a multimodal wrapper is tested through its
   language decoder when transformers has a causal LM for its ``text_config``, else end to end with a
   tiny vision tower;
3. size guard: the pruned model is built on the meta device; over ``--max-params`` (5M) nothing is
   written and the keys that were not reduced are named;
4. one backward on the pruned model finds parameters that get no gradient by design (a sparse-attention
   indexer trained apart from the LM loss); they are declared in ``[checks.smoke] no_grad_ok``;
5. a multimodal wrapper also gets the smoke check's ``wrapper`` variant (``[checks.smoke] wrapper =
   true``): the wrapper end to end with a tiny vision tower and a synthetic image; one backward of it
   finds its own no-gradient parameters (``wrapper_no_grad_ok``), and a wrapper the installed
   transformers cannot run is noted in a comment (its item then skips with that one line);
6. the compile check's code generation is put in the nightly scope (``[checks.compile] codegen_scope``):
   commit runs compile through the compiler's front end only, a new config's first run stays short;
   its serve items are put in the commit scope (``[checks.serve] scope``): a new model's Day-0 path is the
   serving engine a vendor ships (harness/checks/serve.py);
7. the suite's smoke check runs once on the CPU in float32 (and its wrapper variant). Exit 0 when it passes.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
from pathlib import Path

from harness.files import atomic
from harness.numbers import count

DEFAULT_MAX_PARAMS = 5_000_000
# A new config's compiled code generation runs nightly: cold, it is most of the first run (DeepSeek-V4-Flash
# on 2 cores: 230 s, of which inductor's C++ code generation 85 %; warm 52 s). Commit runs get the
# compile check's front-end item (docs/compile.md); the suite's owner moves code generation to every
# commit by deleting the line, once its compiled kernels are cached (ci.yml keeps inductor's cache).
NEW_CONFIG_COMPILE = ({"codegen_scope": "nightly"}, [
    "code generation nightly: cold, it is minutes of a new config's first run on a CPU; commit runs check the",
    "compiler's front end (compile[...-frontend]: graph breaks, recompiles, forward and backward numerics of the",
    "graphs it is handed). Delete this line to generate code on every commit too (docs/compile.md)."])

# A new config is served by the engine on every commit (issue #46 item 6: a Day-0 suite at commit scope beside
# the bundled dense and MoE suites): the engine's path is the one a vendor announces on Day 0, and an engine
# that lacks the architecture says so in one line (NotApplicable, ~20 s: its start stops before the weights).
NEW_CONFIG_SERVE = ({"scope": "commit"}, [
    "served by the engine on every commit: a new model's Day-0 path is the engine a vendor ships (one engine start,",
    "25-100 s on a CPU; not applicable, in the engine's words, where it has no code for this architecture). Set",
    '"nightly" (or "auto") to serve it nightly only (docs/serving.md).'])


class InitRefused(Exception):
    """init will not write a suite; ``str()`` is the one-line reason."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write and validate a suite for a new model's config.json",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the model's published config.json")
    p.add_argument("--name", help="suite name (file stem); default: the config's file name, lower-cased")
    p.add_argument("--suites-dir", help="where to write the suite (default: suites_dir of harness.toml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing suite file")
    p.add_argument("--no-validate", action="store_true", help="write the suite without running its smoke check")
    p.add_argument("--max-params", type=count(1, 10**13), default=DEFAULT_MAX_PARAMS,
                   help=f"refuse a pruned model larger than this (default {DEFAULT_MAX_PARAMS:,})")
    p.set_defaults(func=run)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "model"


# Integer keys that are not sizes: a large value here costs no parameters.
_NOT_SIZE = re.compile(r"token|_id$|ids?$|position|theta|eps|window|max_|seed|factor|scale|chunk|bias|"
                       r"rope|dtype|version|topk|top_k|step|freq|interval|_index", re.I)


def unreduced_keys(raw: dict, text: dict, flat: dict, prefix: str = "") -> list[str]:
    """Size-like integer keys (>= 256) that pruning left at their published value."""
    out = []
    for k, v in text.items():
        key = prefix + k
        if isinstance(v, dict) and k != "quantization_config":
            out += unreduced_keys(raw, v, flat, key + ".")
        elif (isinstance(v, int) and not isinstance(v, bool) and v >= 256 and key not in flat
              and k not in flat and not _NOT_SIZE.search(k)):
            out.append(f"{key}={v}")
    return out


def _plan(raw: dict, config: str):
    """(Plan, resolved class name) or InitRefused: the decision ``harness inspect`` shares
    (harness.models.prune.plan_for)."""
    from harness.models.prune import PlanRefused, plan_for

    try:
        return plan_for(raw, config)
    except PlanRefused as e:
        raise InitRefused(str(e)) from None


def _no_grad_globs(model) -> list[str]:
    """Globs covering exactly the parameters that get no gradient, at the shallowest module whose
    parameters all get none (``*.indexer.*`` rather than one line per layer)."""
    names = {n: p.grad is None for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n, none in names.items() if none]
    globs: list[str] = []
    for n in missing:
        if any(fnmatch.fnmatchcase(n, g) for g in globs):
            continue
        parts = n.split(".")
        chosen = None
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i]) + "."
            if all(names[x] for x in names if x.startswith(prefix)):
                chosen = parts[i - 1]
                generic = re.sub(r"\.\d+\.", ".*.", ".".join(parts[:i]) + ".")
                if not chosen.isdigit():
                    g = f"*.{chosen}.*"
                    if not any(fnmatch.fnmatchcase(x, g) for x in names if not names[x]):
                        globs.append(g)
                        break
                globs.append(generic + "*")
                break
        else:
            globs.append(re.sub(r"\.\d+\.", ".*.", n))
    return globs


def probe(path: Path, max_params: int, raw: dict, plan) -> tuple[int, list[str]]:
    """Size guard on the meta device, then one float32 backward on CPU; returns (params, no-grad globs)."""
    import torch

    from harness.inspect.params import Target, meta_model
    from harness.models.build import build_model, seeded_tokens
    from harness.suite.loader import load_suite

    ls = load_suite(path)
    model, mc = meta_model(Target(ls.name, ls.raw_config, ls, ls.path), pruned=True, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    if n > max_params:
        text = raw[plan.part] if plan.part else raw
        flat = {**{k: 1 for k in plan.prune}, **(plan.prune.get("overrides") or {})}
        keys = unreduced_keys(raw, text, flat)
        raise InitRefused(f"{path.name}: the pruned model has {n:,} parameters, over the {max_params:,} budget; "
                          f"keys not reduced: {', '.join(keys) or 'none found'}; set them in [prune.overrides] "
                          "(or raise --max-params)")
    del model
    model, mc = build_model(ls, "float32", "cpu", seed=0)
    ids = seeded_tokens(mc.config.vocab_size, 2, 16, 1)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    return n, _no_grad_globs(model)


def wrapper_probe(path: Path) -> tuple[list[str], str | None]:
    """One forward + backward of the suite's wrapper variant on CPU float32: (no-grad globs, None), or
    ([], one line) when the variant is not applicable or fails."""
    from harness.backends import get
    from harness.checks import CheckContext, registry
    from harness.checks.outcomes import CheckOutcome
    from harness.checks.smoke import WRAPPER
    from harness.suite.loader import load_suite

    ls = load_suite(path)
    ctx = CheckContext(ls, get("cpu"), "float32", WRAPPER, check="smoke")
    check = registry().get("smoke")
    st = check.new_state(ctx)
    try:
        for step in ("build", "forward"):
            with ctx.step(step):
                getattr(check, step)(ctx, st)
        st.out.loss.backward()
    except CheckOutcome as e:
        return [], f"{type(e).__name__}: {' '.join(str(e).split())}"
    except Exception as e:  # noqa: BLE001 - reported in the suite's comment; the item will say it again
        return [], f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return _no_grad_globs(st.model), None


def init_suite(config: str | Path, *, name: str | None = None, suites_dir: str | Path | None = None,
               force: bool = False, max_params: int = DEFAULT_MAX_PARAMS) -> Path:
    """Write the suite file; raises InitRefused / FileExistsError with a one-line message."""
    cfg = Path(config).resolve()
    raw = _read_config(cfg, config)
    plan, _arch = _plan(raw, str(config))
    name = slug(name or cfg.stem)
    out = _suite_path(name, suites_dir, force)
    write = _suite_writer(out, cfg, raw, plan, name)
    write()
    n, globs = _probe_or_remove(out, max_params, raw, plan, config)
    plan.why.append(f"pruned model: {n:,} parameters")
    smoke: dict = {}
    comment: list[str] = []
    if globs and not _declare_no_grad(out, write, smoke, comment, globs):
        return out
    from harness.models.wrapper import is_wrapper

    if is_wrapper(raw):
        _declare_wrapper(out, write, smoke, comment)
    write(smoke or None, comment or None)
    return out


def _read_config(cfg: Path, config: str | Path) -> dict:
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise InitRefused(f"{config}: cannot read config.json: {e}") from None
    if not isinstance(raw, dict) or not (raw.get("architectures") or raw.get("model_type")):
        raise InitRefused(f"{config}: not a config.json with 'architectures' or 'model_type'")
    return raw


def _suite_path(name: str, suites_dir: str | Path | None, force: bool) -> Path:
    """Where the suite goes (its folder made); FileExistsError where one is there and not ``force``."""
    from harness.settings import load_settings

    out_dir = Path(suites_dir or load_settings().suites_dir).resolve()
    out = out_dir / f"{name}.toml"
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (use --force to overwrite)")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out


def _suite_writer(out: Path, cfg: Path, raw: dict, plan, name: str):
    """(smoke keys, their comment lines) -> the suite file written again (``plan.why`` as it is then)."""
    from harness.models.prune import suite_toml

    rel = os.path.relpath(cfg, out.parent).replace(os.sep, "/")
    notes = list(plan.notes)
    if raw.get("quantization_config") or (raw.get(plan.part or "", {}) or {}).get("quantization_config"):
        notes.append("quantization_config is dropped for the random-weight build (see the smoke item notes)")

    def write(smoke=None, comments=None):
        atomic.write_text(out, suite_toml(rel, raw, plan.prune, plan.why, title=name, notes=notes,
                                          architecture=plan.architecture, smoke=smoke, smoke_comments=comments,
                                          checks={"compile": NEW_CONFIG_COMPILE, "serve": NEW_CONFIG_SERVE}))

    return write


def _probe_or_remove(out: Path, max_params: int, raw: dict, plan, config) -> tuple[int, list[str]]:
    """``probe``; where it refuses or the pruned model does not build, the suite file stays, its first
    lines saying why, so that the keys the refusal names can be set in it (issue #50: a refusal that
    said "set them in [prune.overrides]" had left no suite to set them in)."""
    from harness.models.config import ModelBuildError

    try:
        return probe(out, max_params, raw, plan)
    except InitRefused as e:
        raise InitRefused(_keep_refused(out, str(e))) from None
    except (ModelBuildError, Exception) as e:  # a config transformers rejects: one line
        msg = " ".join(str(e).split())
        why = f"{config}: the pruned model does not build or run: {type(e).__name__}: {msg[:400]}"
        raise InitRefused(_keep_refused(out, why)) from None


def _keep_refused(out: Path, why: str) -> str:
    """The refused suite kept for editing, the refusal at its top; the message, naming the file."""
    head = (f"# REFUSED by `harness init`: {why}\n# Set what it names below, then `harness validate {out.name}` "
            "(and delete these two lines).\n")
    atomic.write_text(out, head + out.read_text())
    return f"{why}; the suite is written to {out} to edit"


def _declare_no_grad(out: Path, write, smoke: dict, comment: list[str], globs: list[str]) -> bool:
    """``no_grad_ok`` for the parameters without a gradient by design; False where the installed smoke
    check has no such knob (then the suite keeps it as a comment, final)."""
    from harness.suite.loader import SuiteError, load_suite

    comment.append(f"by design these parameters get no gradient from the LM loss (found by one backward at init): "
                   f"{', '.join(globs)}; anything else without a gradient still fails")
    smoke["no_grad_ok"] = globs
    write(smoke, comment)
    try:
        load_suite(out)
    except SuiteError:  # a harness whose smoke check has no no_grad_ok knob: keep it as a comment
        write(None, comment + [f"no_grad_ok = {globs!r}  (needs the smoke check's no_grad_ok knob)"])
        return False
    return True


def _declare_wrapper(out: Path, write, smoke: dict, comment: list[str]) -> None:
    """The smoke check's wrapper variant, with what one backward of the wrapper finds."""
    smoke["wrapper"] = True
    comment.append("wrapper = true: variant smoke[...-wrapper] runs the multimodal wrapper end to end (tiny "
                   "vision tower, synthetic image; harness/models/wrapper.py)")
    write(smoke, comment)
    wglobs, why = wrapper_probe(out)
    if why:
        comment.append(f"the wrapper variant at init: {why}")
    elif wglobs:
        smoke["wrapper_no_grad_ok"] = wglobs
        comment.append(f"with an image, these wrapper parameters get no gradient by design: {', '.join(wglobs)}")


def record_suites_dir(out_dir: Path) -> None:
    """Remember a --suites-dir outside harness.toml's suites_dir, so that `harness golden generate NAME`
    and `harness run NAME` find the suite (harness/suite/loader.py resolve_names reads this file)."""
    from harness.settings import load_settings
    from harness.suite.loader import SUITE_DIRS_FILE

    out_dir = out_dir.resolve()
    if out_dir == Path(load_settings().suites_dir).resolve():
        return
    f = Path(SUITE_DIRS_FILE)
    known = f.read_text().splitlines() if f.exists() else []
    if str(out_dir) not in known:
        f.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(f, "\n".join([*known, str(out_dir)]) + "\n")


def validate(path: Path) -> tuple[bool, str]:
    from harness.checks import CheckFailure, run_one
    from harness.suite.loader import SuiteError, load_suite

    try:
        ls = load_suite(path)
        ctx = run_one(ls, "smoke", "cpu", "float32")
    except (CheckFailure, SuiteError) as e:
        return False, " ".join(str(e).split())
    except Exception as e:  # a model that does not even build: say so, do not traceback
        return False, f"{type(e).__name__}: {' '.join(str(e).split())}"
    props = dict(ctx.properties)
    msg = (f"smoke[cpu-float32] passed: loss {props.get('metric.loss_initial', '?')} -> "
           f"{props.get('metric.loss_final', '?')}, {props.get('metric.parameters', '?')} parameters")
    if not ls.suite.checks.smoke.wrapper:
        return True, msg
    from harness.checks import NotApplicable

    try:
        w = dict(run_one(ls, "smoke", "cpu", "float32", "wrapper").properties)
    except NotApplicable as e:
        return True, msg + f"; smoke[cpu-float32-wrapper] not applicable: {' '.join(str(e).split())}"
    except Exception as e:  # a failing wrapper variant: say which check said no, in one line
        return False, msg + f"; smoke[cpu-float32-wrapper] FAILED: {type(e).__name__}: {' '.join(str(e).split())}"
    return True, msg + (f"; smoke[cpu-float32-wrapper] passed: loss {w.get('metric.loss_initial', '?')} -> "
                        f"{w.get('metric.loss_final', '?')}, parts text/vision/projector "
                        f"{w.get('metric.parameters_text', '?')}/{w.get('metric.parameters_vision', '?')}/"
                        f"{w.get('metric.parameters_projector', '?')}, {w.get('metric.image_tokens', '?')} image tokens")


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        path = init_suite(args.config, name=args.name, suites_dir=args.suites_dir, force=args.force,
                          max_params=args.max_params)
    except (InitRefused, FileExistsError) as e:
        print(f"harness init: {e}", file=sys.stderr)
        return 2
    if args.suites_dir:
        record_suites_dir(Path(args.suites_dir))
    print(f"wrote {path}")
    from harness.models.prune import ratio_changes_of

    for line in ratio_changes_of(path.read_text()):  # a published ratio not kept: said here too
        print(f"note: {line}")
    if args.no_validate:
        return 0
    ok, msg = validate(path)
    print(("ok: " if ok else "FAILED: ") + msg)
    if ok:
        name = path.stem
        # The items spread over the cores (xdist): measured on 2 cores, DeepSeek-V4-Flash's run (float32 +
        # bfloat16, inductor cache warm) 86 s in one worker, 52 s in two; its longest items (compile,
        # one per dtype) bound it beyond a few workers, so at most 4 are suggested.
        n = min(os.cpu_count() or 1, 4)
        run = f"harness run {name}" + (f" -n {n}" if n > 1 else "")
        print(f"next: `harness golden generate {name}` writes its precision reference (the precision check "
              f"fails until it exists), then `{run}` or `tox -e model-{name}`; `--scope nightly` adds the "
              f"compiled code generation (minutes on its first run)")
    return 0 if ok else 1
