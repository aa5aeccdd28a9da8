"""The comm check's judging (harness/checks/comm.py calls it): which collectives regressed, and the
failure that names them, leading with the collective that was slowed.

Each collective is judged by its own samples: one decision per ``collective/size`` key of the launch
(harness/perf/comm.py times each key apart, round after round), and a collective regressed when at
least half its sizes did. But on some backends one collective is *measured as* another: gloo has no
``reduce_scatter_tensor``, so reduce_scatter is timed as an all_reduce and a slice (comm.py ``_op``),
and a slower all_reduce makes reduce_scatter slower with it, often by more in relative terms (the
slice is cheap, the all_reduce the same). Named by the worst change, the verdict then blamed
reduce_scatter for an all_reduce slowdown (issue #51: "collective reduce_scatter regressed +888.7 %"
for all_reduce made 50 % slower). So the verdict says what was measured and leads with the collective
that the others are built on when both are slower.
"""

from __future__ import annotations

from harness.perf.decide import HELD, Decision

# backend -> {collective: (the collective it is measured with, how)} (harness/perf/comm.py ``_op``)
MEASURED_AS = {"gloo": {"reduce_scatter": ("all_reduce", "all_reduce + a slice")}}


def label(coll: str, backend: str) -> str:
    """``reduce_scatter (measured on gloo as all_reduce + a slice)``, or the collective's own name."""
    how = MEASURED_AS.get(backend, {}).get(coll)
    return f"{coll} (measured on {backend} as {how[1]})" if how else coll


def regressed(decisions: dict[str, Decision], collectives: list[str]) -> dict[str, dict[str, Decision]]:
    """collective -> its regressed ``collective/size`` decisions, for the collectives slower at at
    least half their sizes (the collective, not one blip)."""
    out = {}
    for coll in collectives:
        mine = {k: d for k, d in decisions.items() if k.startswith(coll + "/")}
        bad = {k: d for k, d in mine.items() if d.verdict == "regression"}
        if mine and len(bad) * 2 >= len(mine):
            out[coll] = bad
    return out


def held(decisions: dict[str, Decision]) -> dict[str, str]:
    """Keys the rule called slower that the baseline cannot back (one launch's samples): noted."""
    return {k: d.why for k, d in decisions.items() if d.verdict in HELD}


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 and not b % (1 << 20) else f"{b >> 10} KiB" if b >= 1024 else f"{b} B"


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB/s"


def _worst(bad: dict[str, Decision]) -> tuple[int, Decision]:
    key, d = max(bad.items(), key=lambda kv: kv[1].change)
    return int(key.split("/")[1]), d


def lead(slow: dict[str, dict[str, Decision]], decisions: dict[str, Decision], backend: str) -> str:
    """The collective to name first: the worst one, unless it is measured as another collective that
    is slower too (at any size): then that one, the root of both."""
    worst = max(slow, key=lambda c: _worst(slow[c])[1].change)
    base = MEASURED_AS.get(backend, {}).get(worst, (None,))[0]
    if base and (base in slow or any(d.verdict == "regression" for k, d in decisions.items()
                                     if k.startswith(base + "/"))):
        return base
    return worst


def collective_failure(slow: dict[str, dict[str, Decision]], decisions: dict[str, Decision], table: dict,
                       n_sizes: int, threshold: float, baseline_why: str, backend: str) -> tuple[str, dict]:
    """The failure's message (leading with :func:`lead`, said how it was measured) and its fields."""
    first = lead(slow, decisions, backend)
    bad_first = slow.get(first) or {k: d for k, d in decisions.items()
                                     if k.startswith(first + "/") and d.verdict == "regression"}
    order = {first: bad_first} | {c: b for c, b in slow.items() if c != first}
    lines = [f"{'collective':<15} {'size':>8} {'busbw now':>12} {'baseline':>12} {'change':>8} {'p':>8}"]
    for coll, bad in order.items():
        for key, d in sorted(bad.items(), key=lambda kv: int(kv[0].split("/")[1])):
            now_bw = table[key]["busbw"]
            base_bw = now_bw * d.ratio if d.ratio else float("nan")
            lines.append(f"{coll:<15} {_size(int(key.split('/')[1])):>8} {_gb(now_bw):>12} {_gb(base_bw):>12} "
                         f"{d.change:>+8.1%} {d.p_value:>8.2g}")
    size, d = _worst(bad_first)
    with_it = [label(c, backend) for c in order if c != first and MEASURED_AS.get(backend, {}).get(c, (None,))[0]
               == first]
    names = ", ".join(f"{label(c, backend)} ({len(b)} of {n_sizes} sizes)" for c, b in order.items())
    msg = (f"collective {label(first, backend)} regressed {d.change:+.1%} at {_size(size)} (p={d.p_value:.2g}) "
           f"against the baseline of this machine class"
           + (f"; {', '.join(with_it)} slower with it" if with_it else "") + f"; slower: {names}")
    return msg, dict(metric=f"comm_{first}_busbw", expected=f"<= {1 + threshold:.2f}x baseline time",
                     observed=f"{d.ratio:.3f}x", tolerance=threshold,
                     details="\n".join(lines + ["", f"baseline: {baseline_why}"]))
