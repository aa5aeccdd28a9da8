"""The serve item's failure, the root cause first (issue #51 item 4): a route the engine chose that the
float64 reference did not (what moved the log-probabilities after it), then the plain run's first
position over budget, then speculative decoding that proposed nothing (the ``speculative`` variant
probed nothing), then the first failing probe. Each with the probes failing beside it.

Returns the arguments of the check's CheckFailure (this layer does not import harness.checks) and the
first divergent position where there is one.
"""

from __future__ import annotations

from harness.serve.judge import describe, table
from harness.serve.probes import first_failure


def failure(engine: str, verdict, routes, route_margin: float, outcomes: list, speculated) -> dict | None:
    """CheckFailure's keyword arguments plus ``message`` and ``position`` (None: the item passes).
    ``routes``: harness.serve.routes' verdict or None (a dense model); ``speculated``: (what the
    engine's speculative decoding did, why that is not speculation or None) or None (not speculating)."""
    failed = [o.name for o in outcomes if not o.ok]
    also = f" (probes failing: {', '.join(failed)})" if failed else ""
    if routes is not None and routes.flips:  # the root cause first: where a route went wrong
        from harness.serve import routes as routes_mod

        then = f"; log-probabilities: {len(verdict.bad)} position(s) over budget" if verdict.bad else ""
        return {"message": routes_mod.failure_text(routes, route_margin, engine) + then + also,
                "metric": f"serve.route.layer{routes.flips[0].layer}", "details": routes_mod.table(routes)}
    bad, where, metric = verdict.bad, f"engine {engine} differs from float64", "serve."
    if not bad:  # the plain run passed: speculation that did not run, else the first failing probe
        if speculated is not None and speculated[1] is not None:
            return {"message": f"speculative decoding did not run: {speculated[1]} ({speculated[0]}){also}",
                    "metric": "serve.speculative"}
        hit = first_failure(outcomes)
        if hit is None:
            return None
        o, row = hit
        if row is None:
            return {"message": f"probe {o.name} did not exercise its feature: {o.problem} ({o.did}){also}",
                    "metric": f"serve.{o.name}"}
        bad, where, metric = o.verdict.bad, f"{where} in probe {o.name} ({o.did})", f"serve.{o.name}."
    elif speculated is not None:  # the plain run decoded speculatively: say how, beside where it differs
        where = f"{where} (speculative decoding: {speculated[0]})"
    first = bad[0]
    return {"message": f"{where}: {describe(first)}; first of {len(bad)} position(s) over budget{also}",
            "metric": f"{metric}{first.kind}{first.index}", "expected": f"<= {first.budget:.3g}",
            "observed": "missing" if first.err is None else f"{first.err:.4g}", "tolerance": first.budget,
            "details": table(bad), "position": first.position}
