"""Issue #46 item 4: an architecture the engine lacks is NotApplicable in the engine's own words, never a
list of harness's, and never the model's failure.

The runner asks the engine itself, in the engine's venv, before any model code runs: the plain item is
vLLM's own model code (its ``ModelRegistry``), the ``transformers`` variant its transformers backend (the
class in the engine's own transformers). Both are run here on the real engine with a real published
config.json that vLLM 0.32 has no code for (MiniMax-M3, from the Day-0 corpus, byte for byte): the
runner reads only the config, so no weights are needed, and the refusal comes back in one line.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from harness.files.scratch import OWNER, owner_record
from harness.serve import engine as eng
from harness.serve.launch import ENGINE_TMP, EngineUnsupported, run_engine
from tests_support import REPO

CONFIG = REPO / "tests" / "data" / "day0" / "MiniMax-M3.json"


@pytest.fixture
def vllm_build():
    build = eng.get("vllm")
    if eng.status(build) != "ready":
        if os.environ.get("CI"):
            pytest.fail("the vllm engine environment is missing in CI: .ci/run runs `harness engine setup vllm`")
        pytest.skip("run `harness engine setup vllm`")
    return build


@pytest.mark.slow
@pytest.mark.parametrize("impl, says", [
    ("auto", "has no model code of its own for MiniMaxM3ForCausalLM (none of the "),
    ("transformers", "'MiniMaxM3ForCausalLM' is not a class of transformers 5."),
])
def test_an_architecture_the_engine_lacks_comes_back_in_the_engines_words(vllm_build, tmp_path, impl, says):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copyfile(CONFIG, model / "config.json")  # the published config, not a made-up one
    req = {"model": str(model), "dtype": "float32", "prompts": [[1, 2, 3]], "k": 1, "steps": 1,
           "platform": "cpu", "model_impl": impl}
    with pytest.raises(EngineUnsupported) as e:
        run_engine(vllm_build, req, tmp_path / "run", timeout_s=300)
    # the engine's temporary folder was harness's (launch.engine_env) and is gone with the run: none of this
    # process's is left (other test workers' engines may be running beside it)
    mine = owner_record()
    left = [p for p in Path(tempfile.gettempdir()).glob(f"{ENGINE_TMP}*") if _owner(p) == mine]
    assert not left, left
    msg = str(e.value)
    assert msg.startswith("engine vllm (vllm 0.32.0) does not serve this model: "), msg
    assert says in msg and "\n" not in msg, msg
    assert "Loading" not in (tmp_path / "run" / "engine.log").read_text()  # asked before any model code ran


def _owner(folder: Path) -> str | None:
    try:
        return (folder / OWNER).read_text()
    except OSError:
        return None


def test_the_engines_temporary_folder_is_harness_s(tmp_path):
    """TMPDIR of the engine: a harness scratch folder with a short path (a ZMQ socket's path is limited to
    107 bytes), never the system's temporary folder where vLLM's rendezvous files outlived killed engines."""
    from harness.serve.launch import engine_env

    tmp = tmp_path / f"{ENGINE_TMP}x"
    assert engine_env(tmp_path / "run", None, tmp)["TMPDIR"] == str(tmp)
    assert engine_env(tmp_path / "run").get("TMPDIR") == os.environ.get("TMPDIR")  # none given: the caller's


def test_a_time_limit_names_the_probe_that_had_started_and_not_finished(tmp_path):
    # the runner prints "harness: probe NAME starts" / "... done" around each probe; the engine's own lines
    # after a hang push them out of the log's tail, so the time-limit message reads them from the whole log
    from harness.serve.launch import _during

    log = tmp_path / "engine.log"
    log.write_text("harness: probe batch starts\nharness: probe batch done\nharness: probe preempt starts\n"
                   + "INFO engine line\n" * 50)
    assert _during(log) == " during probe preempt"
    log.write_text("harness: probe preempt starts\nharness: probe preempt done\nINFO exiting\n")
    assert _during(log) == ""  # every probe finished: the hang was elsewhere
    assert _during(tmp_path / "missing.log") == ""


def test_the_model_class_inspection_is_shared_by_the_runs_of_one_engine_environment(tmp_path):
    """vLLM's inspection entries depend on its own model files only (keyed by their hash): two results
    folders link one folder of them; a folder a run already has is left as it is."""
    from harness.serve.launch import share_inspection

    shared = tmp_path / "engine" / "cache" / "modelinfos"
    for results in ("a", "b"):
        share_inspection(tmp_path / results / "runs" / "item", shared)
    (tmp_path / "a" / "runs" / "vllm-cache" / "modelinfos" / "x.json").write_text("{}")
    assert (tmp_path / "b" / "runs" / "vllm-cache" / "modelinfos" / "x.json").read_text() == "{}"
    own = tmp_path / "c" / "runs" / "vllm-cache" / "modelinfos"
    own.mkdir(parents=True)
    share_inspection(tmp_path / "c" / "runs" / "item", shared)
    assert not own.is_symlink() and not any(own.iterdir())


@pytest.mark.slow
def test_a_float32_mla_model_names_the_cpu_mla_backend_where_the_engines_own_choice_takes_no_float32(
        vllm_build, tmp_path):
    """vLLM's CPU platform picks AMX_MLA for an MLA model on a CPU with AMX tiles, and that backend takes no
    float32 weights (the float32 item failed in the engine while loading). The runner, in the engine's own
    venv, names CPU_MLA for float32 there and only there: bfloat16 and a dense model keep the engine's choice;
    on a CPU without AMX every choice is the engine's."""
    import json
    import subprocess

    models = {}
    for name, config in (("mla", "DeepSeek-V3.json"), ("dense", "Llama-3.1-8B.json")):
        models[name] = tmp_path / name
        models[name].mkdir()
        shutil.copyfile(REPO / "suites" / "configs" / config, models[name] / "config.json")  # published configs
    reqs = [{"model": str(models[m]), "dtype": d} for m, d in (("mla", "float32"), ("mla", "bfloat16"),
                                                                ("dense", "float32"))]
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import torch, vllm_runner as r; "
            "print(json.dumps([torch.cpu._is_amx_tile_supported(), [r.attention_backend(q) for q in json.loads(sys.argv[2])]]))")
    out = subprocess.run([str(eng.python(vllm_build)), "-c", code, str(REPO / "harness" / "serve" / "engines"), json.dumps(reqs)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    amx, got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[1] == [None, ""] and got[2] == [None, ""], got
    if amx:
        assert got[0][0] == "CPU_MLA" and "AMX_MLA, takes no float32 weights" in got[0][1], got
    else:
        assert got[0] == [None, ""], got
