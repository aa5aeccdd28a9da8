"""`harness inspect` on model code that cannot run on meta (issue #29, item 1): the totals, FLOPs and
memory figures always come out; the trace falls back to the pruned model on the CPU, else keeps the
ops recorded before the failure, and one line says what was not traced and why; a config init
refuses is refused with init's line (item 5). Real published configs from tests/data/day0 (SOURCES.md
there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.inspect.trace import TraceError, trace_model

REPO = Path(__file__).resolve().parents[2]
DAY0 = REPO / "tests" / "data" / "day0"


def _inspect(config: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    r = subprocess.run([str(Path(sys.executable).with_name("harness")), "inspect", str(DAY0 / config), "--no-table",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"HF_HUB_OFFLINE": "1"})
    return r, (json.loads(out.read_text()) if out.exists() else {})


def test_a_value_branch_on_meta_falls_back_to_the_pruned_model_on_cpu(tmp_path):
    """Gemma-4's mask code calls .item(): the meta trace stops in `model` (it crashed the command
    with a traceback, exit 1, and lost the totals)."""
    r, rep = _inspect("gemma-4-26B-A4B.json", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "25.806B" in r.stdout  # the total, which needs no trace
    note = next(n for n in rep["notes"] if n.startswith("trace:"))
    assert "stopped in model during its forward (RuntimeError: Tensor.item() cannot be called on meta tensors)" in note
    assert "traced on cpu with seeded weights" in note
    inv = rep["inventory"]
    assert inv["meta"]["device"] == "cpu" and inv["meta"]["pruned"] and "fallback" in inv["meta"]
    assert "aten.mm.default" in inv["ops"] and len(inv["ops"]) > 40


def test_inspect_refuses_what_init_refuses_with_the_same_line(tmp_path):
    """One decision for both (issue #29, item 5): Step-3.7-Flash's flat remote-code config was
    refused by init while inspect counted a wrapper built with defaults for the keys it ignores
    (then crashed on meta). Now both say init's line and exit 2."""
    from harness.models.prune import PlanRefused, plan_for

    raw = json.loads((DAY0 / "Step-3.7-Flash.json").read_text())
    with pytest.raises(PlanRefused) as e:
        plan_for(raw, "Step-3.7-Flash.json")
    r, rep = _inspect("Step-3.7-Flash.json", tmp_path)
    assert r.returncode == 2 and not rep and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"harness inspect: {e.value} (harness init refuses it for the same reason)"
    assert "does not read this flat, remote-code format config" in r.stderr


def test_when_the_fallback_cannot_run_the_ops_before_the_stop_are_kept_and_marked(monkeypatch):
    """The pruned model on the CPU cannot run either (here: too large to build on the host): the
    inventory is what traced before the stop, marked incomplete, and the note says both reasons."""
    from harness.inspect import report
    from harness.inspect.params import Target

    def too_big(target, dtype):
        raise ValueError("its pruned model still has 1960M parameters (over 100M: not run on the host)")

    monkeypatch.setattr(report, "_cpu_pruned_model", too_big)
    with torch.device("meta"):
        model = _Tiny()
    inv, notes = report.trace_target(Target("tiny", {}), model, False, torch.float32)
    assert inv.meta["incomplete"] and inv.meta["device"] == "meta"
    assert "aten.embedding.default" in inv.ops
    (note,) = notes
    assert note.startswith("trace: the full model's trace on meta stopped in inner during its forward (RuntimeError:")
    assert "the pruned model on cpu failed too (ValueError: its pruned model still has 1960M" in note
    assert "the op inventory is incomplete" in note


class _ValueBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 0:  # data-dependent: impossible on meta
            y = y * 2
        return self.b(y)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 8})()
        self.emb, self.inner, self.head = torch.nn.Embedding(8, 4), _ValueBranch(), torch.nn.Linear(4, 8)

    def forward(self, input_ids, labels):
        logits = self.head(self.inner(self.emb(input_ids)))
        return type("O", (), {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())})()


def test_trace_error_names_the_module_and_keeps_the_ops_before_it():
    with torch.device("meta"):
        model = _Tiny()
    with pytest.raises(TraceError) as e:
        trace_model(model, 8)
    assert e.value.module == "inner" and e.value.phase == "forward"
    assert "Tensor.item() cannot be called on meta tensors" in str(e.value)
    ops = e.value.partial.ops
    assert "aten.embedding.default" in ops and "aten.addmm.default" in ops  # emb and inner.a ran
    assert not any("inner.b" in m or "head" in m for r in ops.values() for m in r.modules)
    # the same model with values traces whole
    inv = trace_model(_Tiny(), 8)
    assert inv.ops["aten.addmm.default"].forward == 3


def test_the_coverage_matrix_keeps_every_other_models_row(tmp_path):
    """One config init refuses among others: it was the whole matrix's exit 2 with nothing printed;
    now its own line, the other rows, and exit 2 still (the run is not all there)."""
    md = tmp_path / "m.md"
    r = subprocess.run([str(Path(sys.executable).with_name("harness")), "inspect", "--backends", "cpu",
                        str(DAY0 / "gpt-oss-20b.json"), str(DAY0 / "MiniMax-M3.json"), "llama-3.1-8b",
                        "--markdown", str(md)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stdout + r.stderr
    rows = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    assert {"gpt-oss-20b", "llama-3.1-8b"} <= rows
    assert "not in the matrix:" in r.stdout and "MiniMax-M3.json: transformers" in r.stdout
    assert r.stderr.count("harness inspect: ") == 1 and "Traceback" not in r.stderr
    text = md.read_text()
    assert "| gpt-oss-20b |" in text and "not in the matrix:" in text
