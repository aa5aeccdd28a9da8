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


def layer_table(res: Comparison, tol: dict) -> list[dict]:
    """The comparator's format: one dict per module with exactly these keys."""
    return [{"module": r.module, "max_abs_err": r.metrics["max_abs_err"], "max_rel_err": r.metrics["max_rel_err"],
             "cosine": r.metrics["cosine"], "rel_rmse": r.metrics["rel_rmse"], "tolerance": tol["rel_rmse"],
             "ok": r.ok} for r in res.rows]


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
    lines = [f"{'module':<48} {'max_abs':>10} {'max_rel':>10} {'cosine':>12} {'rel_rmse':>10}  ok",
             "-" * 100]
    for r in res.rows:
        m = r.metrics
        mark = "ok" if r.ok else ("FAIL <- first divergent" if r is first else "FAIL")
        lines.append(f"{r.module:<48} {m['max_abs_err']:>10.3g} {m['max_rel_err']:>10.3g} "
                     f"{m['cosine']:>12.9f} {m['rel_rmse']:>10.3g}  {mark}")
    for name, share in res.expert_agreement.items():
        lines.append(f"{name:<48} chosen experts equal to the reference: {share:.1%}")
    amp = amplification(res)
    if amp:
        lines.append("")
        lines.append("error along the residual stream (growth = rel_rmse / previous):")
        lines.append("  " + " -> ".join(
            f"{a['module'].replace('model.', '')} {a['rel_rmse']:.2g}" + (f" (x{a['growth']:.2g})" if a["growth"] else "")
            for a in amp))
    lines.append(f"tolerance: rel_rmse <= {tol['rel_rmse']:.3g}, cosine >= {tol['min_cosine']:.10g}")
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
    names = [r.module for r in res.rows]
    errs = [max(r.metrics["rel_rmse"], 1e-12) if r.metrics["rel_rmse"] == r.metrics["rel_rmse"] else 1e3
            for r in res.rows]
    colors = ["tab:red" if not r.ok else ("tab:blue" if STREAM_RX.fullmatch(r.module) else "tab:gray")
              for r in res.rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * len(names)), 4.5))
    ax.bar(range(len(names)), errs, color=colors)
    ax.axhline(tol["rel_rmse"], color="tab:red", linestyle="--", label=f"tolerance {tol['rel_rmse']:.2g}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [n.replace("model.", "") for n in names], rotation=75, ha="right",
                  fontsize=7)
    ax.set_ylabel("relative RMSE vs golden")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def details(res: Comparison, tol: dict) -> dict[str, str]:
    """The two details the comparator reads, plus the amplification."""
    first = res.first_divergent
    return {"first_divergent_module": first.module if first else "",
            "layer_table": json.dumps(layer_table(res, tol)),
            "layer_amplification": json.dumps(amplification(res))}
