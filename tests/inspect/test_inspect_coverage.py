"""Coverage per backend: dispatcher for installed backends, declared op lists otherwise."""

from __future__ import annotations

import argparse

import pytest

from harness.inspect.coverage import (
    COMPOSITE,
    MISSING,
    NATIVE,
    UNKNOWN,
    canonical,
    classify_op,
    coverage,
    dispatcher_name,
    parse_op_list,
)
from harness.inspect.params import load_target, meta_model
from harness.inspect.trace import trace_model
from tests_support import REPO, REPO_SUITES

CPU_LIST = REPO / "harness" / "oplists" / "cpu.txt"


@pytest.fixture(scope="module")
def inventories():
    out = {}
    for name in ("deepseek-v3", "mixtral-8x7b", "qwen3-8b"):
        target = load_target(REPO_SUITES / f"{name}.toml")
        model, mc = meta_model(target, pruned=True)
        out[name] = trace_model(model, mc.config.vocab_size)
    return out


def test_cpu_is_native_or_composite(inventories):
    for name, inv in inventories.items():
        cov = coverage(inv, "cpu")
        assert cov.source.startswith("dispatcher (CPU")
        assert {o.status for o in cov.ops.values()} <= {NATIVE, COMPOSITE}, (name, cov.counts())
        assert cov.ops["aten.mm.default"].status == NATIVE
        assert cov.ops["aten.detach.default"].status == COMPOSITE


def test_declared_cpu_list_agrees_with_dispatcher(inventories):
    declared = parse_op_list(CPU_LIST)
    for inv in inventories.values():
        for op in inv.ops:
            assert classify_op(op, op_list=declared)[0] == classify_op(op, dispatch_key="CPU")[0], op


def test_op_list_spellings(tmp_path):
    assert dispatcher_name("aten.mm.default") == "aten::mm"
    assert dispatcher_name("aten.add.Tensor") == "aten::add.Tensor"
    p = tmp_path / "l.txt"
    p.write_text("# comment\naten.mm.default\naten::bmm\nadd.Tensor fallback\n"
                 "- func: silu(Tensor self) -> Tensor\n  dispatch:\n")
    got = parse_op_list(p)
    assert got == {"aten.mm.default": NATIVE, "aten.bmm.*": NATIVE, "aten.add.Tensor": "cpu-fallback",
                   "aten.silu.default": NATIVE}
    assert classify_op("aten.bmm.default", op_list=got)[0] == NATIVE
    assert classify_op("aten.add.Tensor", op_list=got)[0] == "cpu-fallback"
    assert classify_op("aten.topk.default", op_list=got)[0] == MISSING
    assert classify_op("aten.detach.default", op_list=got)[0] == COMPOSITE
    assert canonical("aten::_grouped_mm") == "aten._grouped_mm.*"


def _testdev(tmp_path, monkeypatch, drop: str) -> None:
    """A backend whose declared list is the CPU's minus ``drop``."""
    lines = [x for x in CPU_LIST.read_text().splitlines() if x.strip() != drop]
    (tmp_path / "testdev.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "harness.toml").write_text(
        '[[backends]]\nname = "testdev"\ndevice_type = "cpu"\nop_list = "testdev.txt"\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(tmp_path / "harness.toml"))


def test_missing_op_reported_with_modules(inventories, tmp_path, monkeypatch):
    _testdev(tmp_path, monkeypatch, "aten.histc.default")
    cov = coverage(inventories["mixtral-8x7b"], "testdev")
    assert cov.source.startswith("declared op list")
    (miss,) = cov.missing()
    assert miss.op == "aten.histc.default"
    assert miss.modules == ["model.layers.*.mlp.experts [MixtralExperts]"]
    # known gaps are tracked, not silent
    cov2 = coverage(inventories["mixtral-8x7b"], "testdev", ["aten::histc", "aten.cholesky.default"])
    assert cov2.missing()[0].known_gap and not cov2.missing(include_known=False)
    assert any("does not use" in n for n in cov2.notes)


def test_inspect_cli_leads_with_missing(tmp_path, monkeypatch, capsys):
    from harness.cli import inspect as cli

    _testdev(tmp_path, monkeypatch, "aten.silu.default")
    p = argparse.ArgumentParser()
    cli.register(p.add_subparsers())
    args = p.parse_args(["inspect", str(REPO_SUITES / "qwen3-30b-a3b.toml"), "--trace", "pruned", "-b", "testdev,cpu",
                         "--fail-on-missing", "--inventory-json", str(tmp_path / "inv.json"),
                         "--json", str(tmp_path / "rep.json")])
    assert args.func(args) == 1
    out = capsys.readouterr().out
    head = out.split("Parameters")[0]
    assert "MISSING (1)" in head and "aten.silu.default" in head
    assert "model.layers.*.mlp.experts.act_fn [SiLUActivation]" in head  # who needs it
    assert "total                        30.532B" in out or "30.5" in out
    assert (tmp_path / "inv.json").stat().st_size > 1000


def test_uninstalled_backend_without_list_is_unknown(inventories):
    cov = coverage(inventories["qwen3-8b"], "mps")  # no bundled list for Apple's backend
    assert cov.source.startswith("none")
    assert cov.by_status(UNKNOWN) and not cov.by_status(MISSING)
