"""Issue #28: the test device's op coverage, three ways that must agree - the dispatcher's answer
(the ``ops`` check's coverage step with the device installed), its shipped op list (what a machine
without the device classifies with) and the CPU fallback's own per-op counts measured while the
checks ran. The fixtures (the built device, declared through its entry point) are in conftest.py."""

from __future__ import annotations

import sys

from testdev_support import TESTDEV, device_env, fallback_totals, harness_cli, run_items

sys.path.insert(0, str(TESTDEV))  # the plugin module (no device import): where its op list is
from harness_testdev_plugin import OP_LIST  # noqa: E402

from harness.inspect.coverage import classify_op, structured_out  # noqa: E402
from harness.oplists.format import COMPOSITE, FALLBACK, NATIVE, canonical, parse_op_list  # noqa: E402


def _body(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


def test_the_shipped_op_list_is_what_the_device_registers(env, tmp_path):
    """Regenerated from the dispatcher with the device loaded, the list equals the shipped one (a
    kernel added to csrc/testdev.cpp without regenerating it fails here)."""
    out = tmp_path / "testdev.txt"
    r = harness_cli(env, "oplist", "update", "--backend", "testdev", "--from", "dispatcher", "-o", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    fresh, shipped = out.read_text(), OP_LIST.read_text()
    assert _body(fresh) == _body(shipped), (
        "stale: harness oplist update --backend testdev --from dispatcher -o " + str(OP_LIST.relative_to(TESTDEV.parent)))
    listed = parse_op_list(OP_LIST)
    assert listed.unlisted == FALLBACK and listed.meta["dispatch_key"] == "PrivateUse1"
    assert listed.get("aten.histc.default") == NATIVE and "aten.mm.out" not in listed  # a native kernel; a fallback op


def test_op_coverage_agrees_with_the_fallback_counters(meta, tmp_path):
    """Every op of the ``ops`` items of an MoE suite on the device: an op classified ``cpu-fallback``
    was counted by the fallback while its item ran (itself, or the out= overload its structured
    kernel reaches); a native or composite one never was; every op the fallback counted (the
    model's and the harness's own) is what the shipped op list calls ``cpu-fallback``; and the
    dispatcher and the shipped list agree on every item."""
    log = tmp_path / "fallbacks.jsonl"
    env = device_env(meta, TESTDEV_FALLBACK_LOG=str(log))
    items = run_items(env, tmp_path / "results", "qwen3-30b-a3b", "--backend", "testdev", "--check", "ops",
                      "--dtype", "float32")
    ops = {v: i for (b, c, v), i in items.items() if b == "testdev" and c == "ops"}
    assert len(ops) > 40, sorted(items)
    # the fallback names ops as the dispatcher does (aten::mm.out; aten::cos for the default overload)
    counts = {canonical(op if "." in op.split("::", 1)[1] else op + ".default"): n for op, n in fallback_totals(log).items()}
    assert counts, "the fallback counted nothing"
    listed = parse_op_list(OP_LIST)
    seen = {NATIVE: 0, COMPOSITE: 0, FALLBACK: 0}
    for op, it in sorted(ops.items()):
        assert it["outcome"] == "passed", (op, it["message"])
        p = it["props"]
        status = p["harness.detail.coverage"].split(" (", 1)[0]
        seen[status] = seen.get(status, 0) + 1
        assert p["harness.detail.coverage_op_list"].split(" (", 1)[0] == status, (op, p)
        out = structured_out(op)
        ran = [x for x in (op, out) if x and x in counts]
        if status == FALLBACK:
            assert ran, f"{op} reported {p['harness.detail.coverage']} but the fallback never counted it"
        else:
            assert not ran, f"{op} reported {status} but the fallback counted {ran}"
    assert seen[NATIVE] and seen[COMPOSITE] and seen[FALLBACK], seen
    wrong = sorted(op for op in counts if classify_op(op, op_list=listed)[0] != FALLBACK)
    assert not wrong, f"counted by the fallback, yet not cpu-fallback by the shipped op list: {wrong}"


def test_a_stale_op_list_is_named_by_the_ops_check(meta, tmp_path):
    """An op list that claims a kernel the device does not have (``aten.mm.default`` native): the ops
    item of ``mm`` says the dispatcher disagrees and how to regenerate the list."""
    stale = tmp_path / "stale" / "harness_testdev" / "oplists"
    stale.mkdir(parents=True)
    text = OP_LIST.read_text().replace("aten.histc.default\n", "aten.histc.default\naten.mm.default\n")
    (stale / OP_LIST.name).write_text(text)
    plugin = (TESTDEV / "harness_testdev_plugin.py").read_text()
    (stale.parent.parent / "harness_testdev_plugin.py").write_text(plugin)  # OP_LIST resolves beside it
    env = device_env(meta)
    env["PYTHONPATH"] = f"{stale.parent.parent}:{env['PYTHONPATH']}"  # this plugin module first; the device as before
    items = run_items(env, tmp_path / "results", "qwen3-30b-a3b", "--backend", "testdev", "--check", "ops",
                      "--dtype", "float32", "-k", "aten.mm.default")
    (it,) = [i for (b, c, v), i in items.items() if c == "ops"]
    p = it["props"]
    assert p["harness.detail.coverage"].startswith(FALLBACK), p
    assert p["harness.detail.coverage_op_list"].startswith(NATIVE), p
    assert "regenerate it (harness oplist update --backend testdev --from dispatcher)" in p["harness.detail.notes"]

