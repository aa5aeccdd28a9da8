"""Coverage per backend: dispatcher for installed backends, declared op lists otherwise."""

from __future__ import annotations

import argparse

import pytest
import torch

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


# --- shipped lists, versions, the matrix ------------------------------------------------------------
def _declare(tmp_path, monkeypatch, name: str, lines: list[str], header: str = "", module: str | None = None):
    (tmp_path / f"{name}.txt").write_text(header + "\n".join(lines) + "\n")
    mod = f'module = "{module}"\n' if module else ""
    with open(tmp_path / "harness.toml", "a") as f:
        f.write(f'[[backends]]\nname = "{name}"\ndevice_type = "cpu"\n{mod}op_list = "{name}.txt"\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(tmp_path / "harness.toml"))


def test_inspect_names_the_list_and_version_it_used(inventories):
    cov = coverage(inventories["qwen3-8b"], "npu")
    assert cov.source == "declared op list harness/oplists/npu-2.13.0.txt (npu 2.13.0)" or \
        cov.source.endswith("harness/oplists/npu-2.13.0.txt (npu 2.13.0)")
    assert cov.list_version == "2.13.0" and not cov.warnings
    assert any("Ascend/pytorch" in n for n in cov.notes)
    # the CPU trace's SDPA kernel is the backend's own SDPA choice elsewhere, never "missing"
    sdpa = cov.ops["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert sdpa.status in (NATIVE, COMPOSITE) and "SDPA" in sdpa.how


def test_plugin_version_mismatch_warns(inventories, tmp_path, monkeypatch, capsys):
    """A list for torch 2.12.0 used with the installed torch 2.13: inspect says so."""
    from harness.cli import main

    out = tmp_path / "mycuda.txt"
    assert main(["oplist", "update", "--backend", "mycuda", "--dispatch-key", "CUDA", "--from", "torch",
                 "--version", "2.12.0", "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    _declare(tmp_path, monkeypatch, "mycuda", [x for x in lines if not x.startswith("#")],
             header="\n".join(x for x in lines if x.startswith("#")) + "\n", module="torch")
    cov = coverage(inventories["qwen3-8b"], "mycuda")
    assert cov.list_version == "2.12.0" and cov.version.startswith(torch.__version__.split("+")[0])
    (w1, w2) = cov.warnings
    assert "installed plugin is version 2.13" in w1 and "is for version 2.12.0" in w1
    assert "built against torch 2.12.0" in w2
    capsys.readouterr()
    assert main(["inspect", str(REPO_SUITES / "qwen3-8b.toml"), "--trace", "pruned", "-b", "mycuda",
                 "--no-table"]) == 0
    head = capsys.readouterr().out.split("Parameters")[0]
    assert "warning: mycuda: the installed plugin is version 2.13" in head


def test_missing_op_in_a_list_reaches_the_matrix(tmp_path, monkeypatch, capsys):
    """A list without aten.silu: the matrix counts it missing, leads with it and the modules needing it,
    and writes it as JSON and Markdown (also to the job summary)."""
    import json

    from harness.cli import main

    cuda = [x for x in (REPO / "harness" / "oplists" / "cuda-2.13.0.txt").read_text().splitlines()
            if x.split(" ")[0] != "aten.silu.default"]
    _declare(tmp_path, monkeypatch, "nosilu", cuda)
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    rc = main(["inspect", "--backends", "cpu,nosilu,npu", "qwen3-8b", "mixtral-8x7b", "--json",
               str(tmp_path / "m.json"), "--markdown", str(tmp_path / "m.md"), "--fail-on-missing"])
    assert rc == 1
    out = capsys.readouterr().out
    first = out.split("\n\n")[1].splitlines()
    assert first[0].startswith("MISSING on nosilu: aten.silu.default")
    assert "    qwen3-8b: model.layers.*.mlp.act_fn [SiLUActivation]" in first
    assert any("mixtral-8x7b: model.layers.*.mlp.experts.act_fn" in x for x in first)
    row = next(x for x in out.splitlines() if x.startswith("qwen3-8b "))
    assert row.split()[2].endswith("/1")  # native/composite/fallback/missing on nosilu
    d = json.loads((tmp_path / "m.json").read_text())
    assert d["counts"]["qwen3-8b"]["nosilu"]["missing"] == 1
    need = next(r for r in d["needs"] if r["op"] == "aten.silu.default")
    assert need["backend"] == "nosilu" and set(need["models"]) == {"qwen3-8b", "mixtral-8x7b"}
    md = (tmp_path / "m.md").read_text()
    assert "| model | cpu | nosilu | npu |" in md and "| nosilu | `aten.silu.default` | missing |" in md
    assert summary.read_text() == md


def test_versioned_known_gaps(inventories, tmp_path, monkeypatch):
    """{ op, versions } entries excuse an op only for the backend versions they name."""
    from harness.inspect.coverage import known_gap
    from harness.suite.schema import Suite

    s = Suite.model_validate({"model": {"config": "x.json"}, "known_gaps": {"dev": [
        "aten::topk", {"op": "aten::silu", "versions": "<2.6"}, {"op": "aten.mm.default", "versions": ">=2.6"}]}})
    assert known_gap(s, "dev", "aten.topk.default", "9.0")  # unversioned: always
    assert known_gap(s, "dev", "aten.silu.default", "2.5.1") and not known_gap(s, "dev", "aten.silu.default", "2.6.0")
    assert known_gap(s, "dev", "aten.silu.default", "2.5.1+git1234")
    assert not known_gap(s, "dev", "aten.mm.default", "2.5.0") and known_gap(s, "dev", "aten.mm.default", "2.7")
    assert not known_gap(s, "other", "aten.topk.default", "1.0")
    with pytest.raises(ValueError, match="versions '<<2' is not a version specifier"):
        Suite.model_validate({"model": {"config": "x.json"}, "known_gaps": {"dev": [{"op": "a", "versions": "<<2"}]}})
    # through coverage: a list of version 2.6.0 that lacks silu; the gap for "<2.6" no longer excuses it
    lines = [x for x in CPU_LIST.read_text().splitlines() if x.strip() != "aten.silu.default"]
    _declare(tmp_path, monkeypatch, "dev", lines, header="# backend: dev\n# version: 2.6.0\n")
    cov = coverage(inventories["qwen3-8b"], "dev", s)
    assert cov.version == "2.6.0" and not cov.ops["aten.silu.default"].known_gap
    s2 = Suite.model_validate({"model": {"config": "x.json"},
                               "known_gaps": {"dev": [{"op": "aten::silu", "versions": "<=2.6"}]}})
    assert coverage(inventories["qwen3-8b"], "dev", s2).ops["aten.silu.default"].known_gap


@pytest.mark.slow  # one real CPU trace of the pruned qwen3-8b (~3-8 s on 2 busy cores)
def test_ops_item_for_a_missing_op_honours_gap_versions(tmp_path, monkeypatch):
    """The ops check's missing-op item: a gap for versions "<2.6" no longer excuses an op missing from
    the 2.6.0 list (a failure naming op and modules); "<=2.6" still does (expected failure)."""
    from harness.checks import CheckFailure, KnownGap, run_one
    from harness.suite.loader import load_suite

    lines = [x for x in CPU_LIST.read_text().splitlines() if x.strip() != "aten.silu.default"]
    _declare(tmp_path, monkeypatch, "dev", lines, header="# backend: dev\n# version: 2.6.0\n")
    body = (REPO_SUITES / "qwen3-8b.toml").read_text().replace('config = "configs/',
                                                                f'config = "{REPO_SUITES}/configs/')
    body = body.split("\n[checks.ops]")[0].split("\n[known_gaps]")[0]
    body += '\n[checks.ops]\nenabled = true\nexamples = 1\n\n[known_gaps]\ndev = [{ op = "aten::silu", versions = "<2.6" }]\n'
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "q.toml").write_text(body)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    suite = load_suite(tmp_path / "suites" / "q.toml")
    for versions, outcome in (("<2.6", CheckFailure), ("<=2.6", KnownGap)):
        suite.suite.known_gaps["dev"] = [{"op": "aten::silu", "versions": versions}]
        with pytest.raises(outcome) as e:
            run_one(suite, "ops", "dev", "float32", "aten.silu.default")
        assert "aten.silu.default is missing on backend dev" in str(e.value)
        assert "model.layers.*.mlp.act_fn [SiLUActivation]" in str(e.value)
