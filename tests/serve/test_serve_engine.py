"""Issue #46 items 4-5: an engine build is declared the way a backend is - the ``harness.engines`` entry
point (harness's own vLLM CPU build is one) or ``[[engines]]`` in harness.toml - and ``--engine vllm
--backend npu`` resolves to the build of vLLM declared for npu. A build names its platform plugin
(imported once at setup: a missing plugin is setup's one-line error) and the platform the engine must
report: a build whose plugin did not activate runs on vLLM's CPU platform without a word, so the
runner refuses before the model loads, and the item is an error of the engine's, never the model's."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest
from vendor_plugin import harness, vendor_site

from harness.backends import get
from harness.checks import CheckContext, CouldNotRun, NotApplicable
from harness.checks.serve import ServeCheck
from harness.serve import engine as eng
from harness.settings import SettingsError
from harness.suite.loader import load_suite
from tests_support import REPO

ASCEND = """
[[engines]]
name = "vllm-ascend"
engine = "vllm"
backends = ["npu"]
pins = "ascend.txt"
plugin = "vllm_ascend"
platform = "npu"
architectures = ["LlamaForCausalLM", "Qwen3ForCausalLM"]
env = {VLLM_ASCEND_ENABLE_NZ = "0"}
variants = ["transformers", "eager"]
"""


def test_the_builtin_build_is_registered_through_the_entry_point_a_vendor_uses():
    assert any(ep.value == "harness.serve.engine:register" for ep in entry_points(group="harness.engines"))
    v = eng.registry().get("vllm")
    assert (v.serves, sorted(v.backends), v.platform, v.variants) == ("vllm", ["cpu"], "cpu", ("transformers", "eager", "server", "speculative", "mtp"))
    assert eng.resolve("vllm", "cpu") is v and eng.get("vllm") is v
    assert v.pins_path == eng.DATA / "vllm-cpu.txt" and v.runner_path.is_file()
    assert dict(v.env)["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the CPU build's own settings, not every engine's


def test_a_build_declared_in_harness_toml_is_resolved_by_engine_and_backend(tmp_path, monkeypatch):
    (tmp_path / "ascend.txt").write_text("vllm==0.32.0\nvllm-ascend==0.32.0\n")
    cfg = tmp_path / "harness.toml"
    cfg.write_text(ASCEND)
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    b = eng.resolve("vllm", "npu")
    assert (b.name, b.source, b.plugin, b.platform) == ("vllm-ascend", "harness.toml", "vllm_ascend", "npu")
    assert b.pins_path == tmp_path.resolve() / "ascend.txt"  # beside the harness.toml that declared it
    assert b.runner_path == eng.DATA / "vllm_runner.py"  # a bare name not beside it: harness's own runner
    assert dict(b.env) == {"VLLM_ASCEND_ENABLE_NZ": "0"}
    assert eng.resolve("vllm", "cpu").name == "vllm"  # the built-in stays, for its backend
    with pytest.raises(eng.NoBuild) as e:
        eng.resolve("vllm", "cuda")
    assert str(e.value).startswith("no build of engine vllm is declared for backend cuda (declared: vllm for cpu; "
                                   "vllm-ascend for npu)"), e.value
    with pytest.raises(eng.EngineError, match="unknown engine 'sglang' \\(known: vllm\\)"):
        eng.resolve("sglang", "cpu")
    assert eng.get("vllm-ascend") is b  # a build by its own name (harness engine setup vllm-ascend)


@pytest.mark.parametrize("bad, says", [
    ('name = "../x"', "engines.0.name: String should match pattern"),
    ('plugin = "os; import sys"', "engines.0.plugin: String should match pattern"),
    ('variants = ["graph"]', "engines.0.variants.0: Input should be 'transformers', 'eager', 'server' or 'speculative'"),
])
def test_a_bad_declaration_is_a_settings_error_naming_the_field(tmp_path, monkeypatch, bad, says):
    key = bad.split(" = ")[0]
    text = "\n".join(line for line in ASCEND.splitlines() if not line.startswith(f"{key} ="))
    cfg = tmp_path / "harness.toml"
    cfg.write_text(text.replace('engine = "vllm"', f'engine = "vllm"\n{bad}'))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    with pytest.raises(SettingsError, match=says.replace("(", "\\(").replace(".", "\\.")):
        eng.registry()


def test_the_serve_item_of_a_backend_without_a_build_skips_naming_what_is_declared(tmp_path):
    ctx = CheckContext(load_suite(REPO / "suites" / "llama-3.1-8b.toml"), get("cuda"), "float32", None, check="serve")
    with pytest.raises(NotApplicable) as e:
        ServeCheck().run(ctx, engines_root=tmp_path, results_dir=tmp_path)
    assert str(e.value).startswith("no build of engine vllm is declared for backend cuda (declared: vllm for cpu)")
    assert "harness.toml [[engines]] or the harness.engines entry point" in str(e.value)


def test_a_vendor_build_from_its_entry_point_and_its_missing_plugin_at_setup(tmp_path):
    site = vendor_site(tmp_path)
    root = tmp_path / "engines"
    show = harness("engine", "show", "--root", str(root), cwd=tmp_path, site=site)
    assert show.returncode == 0, show.stderr
    row = next(line for line in show.stdout.splitlines() if line.startswith("vllm-mydev"))
    assert row.split()[:4] == ["vllm-mydev", "vllm", "mydev", "missing"], row
    assert "plugin vllm_mydev" in row and row.endswith("from harness-mydev (harness_mydev:register_engines)"), row
    # --engine vllm --backend mydev: the vendor's build; its pins install, its plugin does not import
    setup = harness("engine", "setup", "vllm", "--backend", "mydev", "--root", str(root), cwd=tmp_path, site=site)
    assert setup.returncode == 2, (setup.stdout, setup.stderr)
    err = setup.stderr.strip().splitlines()[-1]
    assert err.startswith("harness: error: import vllm_mydev (the platform plugin) failed (exit 1; log "), err
    assert "ModuleNotFoundError: No module named 'vllm_mydev'" in err, err
    assert not (root / "vllm-mydev" / eng.STAMP).exists()  # half-built: not "ready", the next setup rebuilds
    other = harness("engine", "setup", "vllm", "--backend", "cuda", "--root", str(root), cwd=tmp_path, site=site)
    assert other.returncode == 2 and "no build of engine vllm is declared for backend cuda (declared: vllm for " \
        "cpu; vllm-mydev for mydev)" in other.stderr, other.stderr


def test_an_unknown_engine_is_the_runs_usage_error(tmp_path):
    r = harness("run", "llama-3.1-8b", "--check", "serve", "--engine", "sglang", "--results", str(tmp_path / "r"),
                cwd=REPO, timeout=300)
    assert r.returncode == 4, (r.returncode, r.stdout[-800:], r.stderr[-800:])
    assert "--engine: unknown engine 'sglang' (declared: vllm; harness engine show)" in r.stdout + r.stderr


def test_an_existing_environment_is_declared_by_its_python_and_never_installed_into(tmp_path, monkeypatch):
    """A vendor's build that pip cannot make (a container's environment, a build from its own tarball) is
    declared by its interpreter: exactly one of pins and python; one that does not exist is setup's
    one-line error, and the item skips naming it until setup has checked it."""
    cfg = tmp_path / "harness.toml"
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    head = '[[engines]]\nname = "vllm-box"\nengine = "vllm"\nbackends = ["cpu"]\nplatform = "cpu"\n'
    cfg.write_text(head + 'pins = "x.txt"\npython = "/opt/box/bin/python"\n')
    with pytest.raises(SettingsError, match="give pins .* or python .*, not both and not neither"):
        eng.registry()
    cfg.write_text(head + 'python = "box/bin/python"\n')  # relative: beside the harness.toml
    b = eng.get("vllm-box")
    assert eng.python(b) == tmp_path.resolve() / "box" / "bin" / "python" and b.made_by.startswith("python /")
    assert eng.status(b, tmp_path / "engines") == "missing"
    with pytest.raises(eng.EngineError, match="engine vllm-box: its python .*/box/bin/python does not exist"):
        eng.setup(b, tmp_path / "engines", say=lambda _: None)
    assert not (tmp_path / "engines" / "vllm-box" / eng.STAMP).exists()


@pytest.mark.slow
def test_a_build_whose_platform_plugin_did_not_activate_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    # A build declared for platform npu, on an existing environment: the vLLM CPU build's own interpreter,
    # checked by setup (vllm imports there) and never installed into. No plugin activates, vLLM picks its
    # CPU platform, and the runner refuses before loading the model.
    real = eng.get("vllm")
    if eng.status(real) != "ready":
        if os.environ.get("CI"):
            pytest.fail("the vllm engine environment is missing in CI: .ci/run runs `harness engine setup vllm`")
        pytest.skip("run `harness engine setup vllm`")
    cfg = tmp_path / "harness.toml"
    cfg.write_text(f'[[engines]]\nname = "vllm-npu-here"\nengine = "vllm"\nbackends = ["cpu"]\n'
                   f'python = "{os.path.abspath(eng.python(real))}"\nplatform = "npu"\narchitectures = ["LlamaForCausalLM"]\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    monkeypatch.setenv("HARNESS_ENGINE", "vllm-npu-here")
    b, root = eng.get("vllm-npu-here"), tmp_path / "engines"
    before = {p.name for p in eng.env_dir(real).iterdir()}
    said = []
    assert eng.setup(b, root, say=said.append) and eng.status(b, root) == "ready", said
    assert said[0].startswith("harness engine setup vllm-npu-here: checking the existing environment of "), said
    assert not eng.setup(b, root, say=said.append)  # checked once: the next setup does nothing
    assert {p.name for p in eng.env_dir(real).iterdir()} == before and sorted(p.name for p in (root / b.name).iterdir()) \
        == [eng.STAMP]  # nothing made in the environment; the stamp is harness's
    ctx = CheckContext(load_suite(REPO / "suites" / "llama-3.1-8b.toml"), get("cpu"), "float32", None, check="serve")
    with pytest.raises(CouldNotRun) as e:
        ServeCheck().run(ctx, engines_root=root, results_dir=tmp_path)
    msg = str(e.value)
    assert msg.startswith("engine vllm-npu-here refused to run: vLLM runs on its cpu platform, not npu: the build's "
                          "platform plugin did not activate (vllm.platform_plugins entry points here: "), msg
    assert "\n" not in msg
    log = (tmp_path / "serve" / "runs" / "llama-3.1-8b-cpu-float32" / "engine.log").read_text()
    assert "Loading" not in log and "model weights" not in log  # refused before the model loaded
