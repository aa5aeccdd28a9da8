"""`harness validate [SUITE...]`: load and check suites without running anything."""

from __future__ import annotations

from harness.settings import load_settings


def register(sub) -> None:
    p = sub.add_parser("validate", help="validate suite files (schema, config, model build)")
    p.add_argument("suites", nargs="*", help="suite names or paths; default: every suite")
    p.add_argument("--no-build", action="store_true", help="skip resolving the transformers config")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.models.build import model_config
    from harness.suite.loader import SuiteError, discover, load_suite, resolve_names

    settings = load_settings()
    try:
        paths = resolve_names(args.suites, settings.suites_dir) if args.suites else discover(settings.suites_dir)
    except SuiteError as e:
        print(e)
        return 2
    bad = 0
    for p in paths:
        try:
            ls = load_suite(p)
            notes = [] if args.no_build else model_config(ls).notes
            print(f"ok    {p}" + "".join(f"\n      note: {n}" for n in notes))
        except SuiteError as e:
            bad += 1
            print(e)
        except Exception as e:  # config that transformers rejects, unknown architecture, ...
            bad += 1
            print(f"{p}: model.config: {e}")
    print(f"{len(paths) - bad} valid, {bad} invalid")
    return 1 if bad else 0
