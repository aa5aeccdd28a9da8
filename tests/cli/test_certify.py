"""`harness certify` on the CPU backend (dispatch key CPU): known faults caught at their module, a
fault the chosen check cannot see reported as missed with exit 1, the catalogue, usage errors. The
faults are registered only in subprocesses (a kernel registered here would stay for every later test
in this process); the full table on the test device is tests/testdev/test_certify_on_device.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def harness(*args, timeout=600, **extra):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "COLUMNS": "250"} | extra
    return subprocess.run([str(Path(sys.executable).with_name("harness")), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_fault_is_caught_at_its_module_and_one_the_check_cannot_see_is_missed(tmp_path):
    """activation-slope under precision: caught at the MLP; wrong-backward under precision (forward
    only): missed, its kernel never ran, the exit status says so and the row says how to reproduce."""
    r = harness("certify", "--backend", "cpu", "--fault", "activation-slope", "--fault", "wrong-backward",
                "--check", "precision", "--json", "--results", str(tmp_path / "runs"))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["backend"] == "cpu" and rep["dispatch_key"] == "CPU" and rep["green"], rep
    assert [i["check"] for i in rep["baseline"]] == ["precision"] and rep["baseline"][0]["outcome"] == "passed"
    rows = {f["fault"]: f for f in rep["faults"]}
    act = rows["activation-slope"]
    assert act["verdict"] == "caught" and act["outcome"] == "failed", act
    assert act["module"] == "model.layers.0.mlp" and act["ran"] == ["aten::silu"], act
    assert act["message"].startswith("model.layers.0.mlp diverges from the golden"), act
    back = rows["wrong-backward"]
    assert back["verdict"] == "missed" and back["outcome"] == "passed" and back["ran"] == [], back
    assert "never ran" in back["message"] and back["module"] == "", back
    assert back["reproduce"] == ("HARNESS_CERTIFY_FAULT=wrong-backward HARNESS_CERTIFY_BACKEND=cpu harness run "
                                 "suites/llama-3.1-8b.toml --backend cpu --check precision --dtype float32"), back
    assert rep["counts"] == {"caught": 1, "missed": 1, "error": 0}
    # the runs' results are kept, and the faulty one says which fault produced it
    item = json.loads((tmp_path / "runs" / "activation-slope" / "summary.json").read_text())["items"][0]
    assert item["props"]["harness.detail.certify_fault"] == "activation-slope"
    assert "harness.detail.certify_fault" not in json.loads(
        (tmp_path / "runs" / "baseline" / "summary.json").read_text())["items"][0]["props"]
    assert "certify: activation-slope: caught by precision at model.layers.0.mlp" in r.stderr


KERNELS = """
    import json, torch
    from harness.backends import faults
    F = torch.nn.functional
    x = torch.randn(4, 6, 8, 16, generator=torch.Generator().manual_seed(0))
    d = x.double()
    m = x[0, 0]

    def float64_ops():
        g = d.clone().requires_grad_()
        F.silu(g).sum().backward()
        return [F.silu(d), F.gelu(d), torch.softmax(d, -1), F.scaled_dot_product_attention(d, d, d, is_causal=True),
                torch.rsqrt(d.abs() + 1), d[0, 0] @ d[0, 0].T, torch.addmm(d[0, 0, :, :6], d[0, 0], d[0, 0, :6].T), g.grad]

    before = float64_ops()
    out = {"installed": {n: faults.install(f, "CPU") for n, f in faults.CATALOGUE.items()}}
    out["again"] = faults.install(faults.get("matmul-bf16"), "CPU")  # once per process
    out["float64_unchanged"] = [bool(torch.equal(a, b)) for a, b in zip(before, float64_ops())]
    r = lambda a, b: (a.double() - b).abs().max().item()
    out["silu"] = r(F.silu(x), 1.05 * d * torch.sigmoid(d))
    out["gelu"] = r(F.gelu(x), 1.05 * F.gelu(d))
    out["softmax"] = r(torch.softmax(x, -1), torch.softmax(1.05 * d, -1))
    out["sdpa"] = r(F.scaled_dot_product_attention(x, x, x, is_causal=True),
                    F.scaled_dot_product_attention(d, d, d, is_causal=True, scale=1.05 / 4))
    y = torch.rsqrt(x.abs() + 1)
    out["nan"] = [bool(y.view(-1)[0].isnan()), int(y.isnan().sum())]
    out["mm"] = r(m @ m.T, m.bfloat16().double() @ m.bfloat16().double().T)
    out["mm_off"] = r(m @ m.T, m.double() @ m.double().T)
    out["addmm"] = r(torch.addmm(m[:, :6], m, m[:6].T, beta=0.5), 0.5 * m[:, :6].double() + m.double() @ m[:6].double().T)
    g = x.clone().requires_grad_()
    F.silu(g).sum().backward()
    s = torch.sigmoid(d)
    out["silu_backward"] = r(g.grad, 1.05 * s * (1 + d * (1 - s)))
    print(json.dumps(out))
"""


def test_each_fault_is_what_it_says_and_leaves_float64_exact():
    """Every kernel of the catalogue, on the CPU key in a fresh process: wrong by what its summary
    says in float32 (against float64 math of the same fault), computed through the kernel it replaced
    (no recursion), and float64 untouched (the checks' own reference arithmetic)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(KERNELS)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    inst = out["installed"]
    assert inst["activation-slope"] == ["aten::silu", "aten::gelu"]
    # the CUDA-only attention kernels have no CPU kernel to replace; CPU's own flash kernel is covered
    assert inst["softmax-scale"][:2] == ["aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert "aten::_scaled_dot_product_flash_attention" not in inst["softmax-scale"]
    assert out["again"] == inst["matmul-bf16"] == ["aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"]
    assert out["float64_unchanged"] == [True] * 8, out  # bit for bit what the replaced kernels gave
    for k in ("silu", "gelu", "softmax", "sdpa", "silu_backward"):
        assert out[k] < 1e-5, (k, out[k])  # float32 of the faulty formula
    # bfloat16 inputs and result: near the bfloat16 product, far (for float32) from the exact one
    assert out["mm"] < 0.1 and out["mm_off"] > 1e-3 and out["addmm"] > 1e-3, out
    assert out["nan"] == [True, 1], out


def test_the_catalogue_names_op_and_check(capsys):
    from harness.cli import main

    assert main(["certify", "--list", "--json"]) == 0
    rows = {r["fault"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"softmax-scale", "activation-slope", "matmul-bf16", "nan-one-element", "wrong-backward"}
    assert {n: r["check"] for n, r in rows.items()} == {
        "softmax-scale": "precision", "activation-slope": "precision", "matmul-bf16": "precision",
        "nan-one-element": "precision", "wrong-backward": "training"}
    assert "aten::silu_backward" in rows["wrong-backward"]["ops"] and "aten::mm" in rows["matmul-bf16"]["ops"]
    assert all(r["what"] and r["why"] for r in rows.values())


@pytest.mark.parametrize("args, says", [
    ([], "--backend is required"),
    (["--backend", "nope"], "unknown backend nope (registered: cpu"),
    (["--backend", "cpu", "--fault", "nope"], "unknown fault(s) nope (known: softmax-scale"),
    (["--backend", "cpu", "--check", "nope"], "unknown check nope"),
    (["--backend", "cpu", "--suite", "no-such-suite"], "no-such-suite"),
    (["--backend", "cpu", "--suite", "pyproject.toml"], "--suite: "),  # a file, but no suite: not the backend's
    (["--backend", "npu"], "backend npu is not available here"),
])
def test_usage_errors_exit_2_naming_the_problem(args, says, capsys, monkeypatch):
    from harness.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["certify", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_judging_a_row():
    from harness.run.certify import Item, judge

    failed = Item("precision", "failed", "model.layers.0.mlp diverges", "model.layers.0.mlp")
    assert judge(failed, ["aten::silu"], [], "") == ("caught", "model.layers.0.mlp diverges")
    # a failure the fault did not cause, or its own code raising, is not a catch
    assert judge(failed, [], [], "")[0] == "error"
    assert judge(failed, ["aten::silu"], ["aten::silu: TypeError: x"], "")[0] == "error"
    assert judge(Item("precision", "passed"), ["aten::silu"], [], "") == ("missed", "passed with the wrong kernel")
    assert judge(Item("precision", "xfailed", "known gap"), ["aten::silu"], [], "") == ("missed", "known gap")
    assert judge(Item("precision", "error", "could not run"), ["aten::silu"], [], "")[0] == "error"
    assert judge(None, [], [], "Traceback\nboom")[0] == "error"
    # issue #49: a device lost under the fault made the item fail by raising; no check judged it
    lost = Item("precision", "failed", "RuntimeError: device lost (in step forward)", "", 1.0, "RuntimeError")
    verdict, why = judge(lost, ["aten::silu"], [], "")
    assert verdict == "error" and why.startswith("the run raised RuntimeError under the fault, no check judged it"), why


def test_an_item_that_raised_says_so_and_a_judgment_does_not():
    """The property certify reads: an exception out of a model step fails the item with
    harness.detail.raised; a CheckFailure (a judgment) fails it without."""
    from harness.backends import get
    from harness.checks import Check, CheckContext, CheckFailure
    from harness.run.execute import _attach_context, _run_check
    from harness.suite.loader import load_suite
    from tests_support import REPO

    class Forward(Check):
        name = "forward_probe"
        steps = ("forward",)

        def __init__(self, exc):
            self.exc = exc

        def forward(self, ctx, st):
            raise self.exc

    ls = load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    out = {}
    for key, exc in (("lost", RuntimeError("NPU error: device lost")), ("judged", CheckFailure("logits differ"))):
        ctx = CheckContext(ls, get("cpu"), "float32", None, check="smoke")
        r = _run_check(Forward(exc), ctx, ("llama-3.1-8b", "smoke", "cpu", "float32"))
        _attach_context(r, ctx)
        out[key] = (r.outcome, dict(r.properties).get("harness.detail.raised"))
    assert out == {"lost": ("failed", "RuntimeError"), "judged": ("failed", None)}, out
