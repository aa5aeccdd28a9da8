"""Layer-by-layer alignment: the table of every captured module with its metrics, the first
module whose error exceeds its tolerance (where the error is born), how the error grows from
decoder layer to decoder layer (amplification), and a plot of error per module."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.precision.compare import Comparison

LAYER_RX = re.compile(r"model\.layers\.(\d+)")
STREAM_RX = re.compile(r"model\.embed_tokens|model\.layers\.\d+|model\.norm|logits")


def _rows(res: Comparison):
    """The verdict rows: isolated where the golden has them (they localize), else propagated."""
    iso = {r.module for r in res.isolated}
    return list(res.isolated) + [r for r in res.rows if r.module not in iso]


def layer_table(res: Comparison, tol: dict) -> list[dict]:
    """The comparator's format: one dict per module with exactly these keys (isolated metrics and
    budget where the module has an isolated comparison, else propagated ones and the tolerance)."""
    order = {r.module: i for i, r in enumerate(res.rows)}
    rows = sorted(_rows(res), key=lambda r: order.get(r.module, len(order)))
    return [{"module": r.module, "max_abs_err": r.metrics["max_abs_err"], "max_rel_err": r.metrics["max_rel_err"],
             "cosine": r.metrics["cosine"], "rel_rmse": r.metrics["rel_rmse"],
             "tolerance": r.budget if r.budget is not None else tol["rel_rmse"], "ok": r.ok} for r in rows]


def propagated_table(res: Comparison) -> list[dict]:
    return [{"module": r.module, "rel_rmse": r.metrics["rel_rmse"], "cosine": r.metrics["cosine"],
             "enforced": r.enforced, "ok": r.ok} for r in res.rows]


def amplification(res: Comparison) -> list[dict]:
    """rel_rmse along the residual stream (embeddings, each decoder layer, final norm, logits) and
    its growth factor from one point to the next."""
    out, prev = [], None
    for r in res.rows:
        if not STREAM_RX.fullmatch(r.module):
            continue
        e = r.metrics["rel_rmse"]
        growth = (e / prev) if prev not in (None, 0.0) else None
        out.append({"module": r.module, "rel_rmse": e, "growth": growth})
        prev = e
    return out


def render(res: Comparison, tol: dict) -> str:
    first = res.first_divergent
    iso = {r.module: r for r in res.isolated}
    lines = [f"{'module':<44} {'isolated':>10} {'budget':>9} {'propagated':>10} {'max_abs':>9} {'cosine':>12}  ok",
             "-" * 104]
    for r in res.rows:
        i = iso.get(r.module)
        v = i or r
        m = v.metrics
        mark = "ok" if v.ok else ("FAIL <- first divergent" if v is first else "FAIL")
        if i is None and not r.enforced:
            mark = "(reported)"
        b = v.budget if v.budget is not None else tol["rel_rmse"]
        flips = f"  [{i.excluded_tokens} near-tie flipped token(s) left out]" if i is not None and i.excluded_tokens else ""
        iso_err = f"{i.metrics['rel_rmse']:.3g}" if i else "-"
        lines.append(f"{r.module:<44} {iso_err:>10} {b:>9.3g} "
                     f"{r.metrics['rel_rmse']:>10.3g} {m['max_abs_err']:>9.3g} {m['cosine']:>12.9f}  {mark}{flips}")
    for name, share in res.expert_agreement.items():
        lines.append(f"{name:<44} chosen experts equal to the reference (propagated): {share:.1%}")
    for w in res.wide_flips:
        lines.append(f"routing: {w}")
    amp = amplification(res)
    if amp:
        lines.append("")
        lines.append("propagated error along the residual stream (growth = rel_rmse / previous):")
        lines.append("  " + " -> ".join(
            f"{a['module'].replace('model.', '')} {a['rel_rmse']:.2g}" + (f" (x{a['growth']:.2g})" if a["growth"] else "")
            for a in amp))
    lines.append("isolated: each module run on the golden's inputs (localizes); budget = k x measured clean error "
                 f"+ floor, ceiling rel_rmse {tol['rel_rmse']:.3g}; propagated rows decide only where no isolated "
                 "row exists, and for the logits")
    return "\n".join(lines)


def plot(res: Comparison, tol: dict, path: Path, title: str) -> Path | None:
    """rel_rmse per module (log scale) with the tolerance line; decoder-layer outputs highlighted."""
    if not res.rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = _rows(res)
    order = {r.module: i for i, r in enumerate(res.rows)}
    rows.sort(key=lambda r: order.get(r.module, len(order)))
    names = [r.module for r in rows]
    errs = [max(r.metrics["rel_rmse"], 1e-12) if r.metrics["rel_rmse"] == r.metrics["rel_rmse"] else 1e3
            for r in rows]
    colors = ["tab:red" if not r.ok else ("tab:blue" if STREAM_RX.fullmatch(r.module) else "tab:gray")
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * len(names)), 4.5))
    ax.bar(range(len(names)), errs, color=colors)
    ax.axhline(tol["rel_rmse"], color="tab:red", linestyle="--", label=f"ceiling {tol['rel_rmse']:.2g}")
    buds = [r.budget for r in rows]
    if any(b is not None for b in buds):
        ax.scatter(range(len(names)), [b if b is not None else tol["rel_rmse"] for b in buds], marker="_",
                   s=120, color="black", label="budget", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [n.replace("model.", "") for n in names], rotation=75, ha="right",
                  fontsize=7)
    ax.set_ylabel("relative RMSE vs golden")
    ax.set_title(title, fontsize=9, parse_math=False)  # module names are text, never mathtext
    ax.legend(fontsize=8)
    fig.tight_layout()
    import io

    from harness.files import atomic

    buf = io.BytesIO()
    fig.savefig(buf, dpi=80, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    atomic.write_bytes(path, buf.getvalue())
    return path


def details(res: Comparison, tol: dict) -> dict[str, str]:
    """The two details the comparator reads, plus the amplification."""
    first = res.first_divergent
    return {"first_divergent_module": first.module if first else "",
            "layer_table": json.dumps(layer_table(res, tol)),
            "layer_amplification": json.dumps(amplification(res)),
            "propagated_table": json.dumps(propagated_table(res)),
            "routing": json.dumps({"near_tie_flips_left_out": res.routing_flips, "wide_flips": res.wide_flips})}
