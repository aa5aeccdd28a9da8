"""What collection refuses in a suite, shared by ``harness run`` (the pytest plugin) and
``harness validate``: so a suite that validates is a suite that collects.

Each function returns one problem line (``field: what``) or None; callers wrap it in a SuiteError
naming the file.
"""

from __future__ import annotations


def unknown_backends(ls) -> str | None:
    from harness.backends import registry as backend_registry

    breg = backend_registry()
    unknown = [b for b in ls.suite.backends if b != "*" and b not in breg]
    if unknown:
        return f"backends: unknown backend {', '.join(map(repr, unknown))} (registered: {', '.join(breg.names())})"
    return None


def backend_names(ls) -> list[str]:
    from harness.backends import registry as backend_registry

    return backend_registry().names() if "*" in ls.suite.backends else list(ls.suite.backends)


def unknown_variants(check, wanted: list, variants: list) -> str | None:
    unknown = sorted(set(wanted) - set(variants))
    if wanted and variants != [None] and unknown:
        return (f"checks.{check.name}.variants: unknown variant {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(str(v) for v in variants)})")
    return None


def problems(ls) -> list[str]:
    """Everything collection would refuse in this suite (the variants only where the suite names
    some, on the backends available here, as collection does)."""
    from harness import checks
    from harness.backends import registry as backend_registry

    bad = unknown_backends(ls)
    if bad:
        return [bad]
    out = []
    breg = backend_registry()
    for check in checks.registry():
        if not check.enabled(ls):
            continue
        wanted = list(check.config(ls).variants)
        if not wanted:
            continue
        for bname in backend_names(ls):
            backend = breg.get(bname)
            if backend.available():
                why = unknown_variants(check, wanted, check.variants(ls, backend))
                if why:
                    out.append(why)
                    break
    return out
