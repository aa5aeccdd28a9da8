"""`harness validate [SUITE...]`: load and check suites without running anything."""

from __future__ import annotations

from harness.settings import load_settings


def register(sub) -> None:
    p = sub.add_parser("validate", help="validate suite files (schema, config, model build)")
    p.add_argument("suites", nargs="*", help="suite names or paths; default: every suite")
    p.add_argument("--no-build", action="store_true", help="skip resolving the transformers config")
    p.add_argument("--schema", action="store_true",
                   help="print every suite key, then every HARNESS_* environment variable, with type, default "
                   "and description (markdown) and exit")
    p.set_defaults(func=main)


def schema_markdown() -> str:
    """Every suite key, from the pydantic schema itself, so the reference cannot drift."""
    from typing import get_args, get_origin

    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from harness.suite.schema import suite_model

    rows = ["| key | type | default | description |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}{name}"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                rows.append(f"| `[{key}]` | table | | {f.description or ''} |")
                walk(ann, key + ".")
                continue
            item = get_args(ann)[0] if get_origin(ann) is list and get_args(ann) else None
            if isinstance(item, type) and issubclass(item, BaseModel):
                # an array of tables ([[checks.parallel.configs]]): its entries' own keys, as key[].field
                rows.append(f"| `[[{key}]]` | array of tables | | {(f.description or '').replace('|', '/')} |")
                walk(item, key + "[].")
                continue
            if f.default is not PydanticUndefined:
                default = f"`{f.default!r}`"
            elif f.default_factory is not None:
                default = f"`{f.default_factory()!r}`"
            else:
                default = "required"
            typ = (getattr(ann, "__name__", None) or str(ann).replace("typing.", "")).replace(" | ", " or ")
            rows.append(f"| `{key}` | `{typ}` | {default} | {(f.description or '').replace('|', '/')} |")

    walk(suite_model(), "")  # [checks.<name>] tables come from the registered checks
    from harness.settings import env_markdown

    # the HARNESS_* environment variables are settings too: declared in harness.settings.ENV
    return "\n".join(rows) + "\n\n## Environment variables\n\n" + env_markdown()


def main(args) -> int:
    from harness.models.build import model_config
    from harness.suite.loader import SuiteError, discover, load_suite, resolve_names

    if args.schema:
        print(schema_markdown())
        return 0
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
            from harness.checks import collection

            bad_items = collection.problems(ls)  # what `harness run` would refuse at collection
            if bad_items:
                raise SuiteError(ls.path, bad_items)
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
