"""Golden files: atomic writes, no silent overwrite, sha256 verification, clear errors, sampling."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from precision.helpers import GOLDEN, REPO, SUITES, cli, copy_golden, run_check, suite

from harness.checks import CouldNotRun
from harness.golden import store
from harness.precision import tolerance
from harness.precision.generate import build_golden, generate


@pytest.mark.parametrize("name", SUITES)
def test_committed_goldens_verify(name):
    ls = suite(name)
    g = store.load_golden(ls, GOLDEN)
    mf = g.manifest
    assert mf["reference"]["backend"] == "cpu" and mf["reference"]["dtype"] == "float64"
    assert {"torch", "transformers"} <= set(mf["versions"])
    assert g.inputs.dtype == torch.int64 and list(g.inputs.shape) == [2, 16]
    assert g.order[-1] == "logits" and g.order[0] == "model.embed_tokens"
    assert any(n.endswith("self_attn") for n in g.order) and "model.norm" in g.order
    if "moe" in name.lower() or name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2"):
        assert any(n.endswith(".gate") for n in g.order) and any(n.endswith("chosen_experts") for n in g.order)
    assert g.generation["tokens"].shape == (2, 4)
    for f, meta in mf["files"].items():
        assert len((store.current_dir(g.path) / f).read_bytes()) == meta["bytes"]
    # the repo stays small: forward 212-325 KiB, with the training (sign-test rows included) and decode
    # sections 0.72-1.07 MB
    assert sum(m["bytes"] for m in mf["files"].values()) < 1_200_000
    # format 2: every captured module's inputs are recorded (isolated comparison) ...
    assert mf["format"] == store.FORMAT == 3 and {n for n in g.order if not n.endswith("chosen_experts")} <= set(g.structures)
    # ... budgets measured per low-precision dtype the suite lists, over several draws ...
    for dtype in ("bfloat16", "float32"):
        b = mf["budgets"][dtype]
        assert b["draws"] == 4 and set(b["modules"]) == {n for n in g.order if not n.endswith("chosen_experts")}
        assert all(0 < e["budget"] <= tolerance.DEFAULTS[dtype]["rel_rmse"] for e in b["modules"].values())
    # ... and realistic numerics: attention well below uniform entropy, residual RMS growing per layer
    st = mf["numerics"]["stats"]
    assert all(v["entropy_ratio"] > 0.95 or name in ("qwen3-8b", "qwen3-30b-a3b")
               for v in st["init"]["attention"].values())
    assert all(v["entropy_ratio"] < 0.55 for v in st["realistic"]["attention"].values())
    rms = st["realistic"]["rms"]
    chain = [rms["in"]] + [rms[k] for k in sorted((k for k in rms if k != "in"), key=int)]
    assert all(b > 1.2 * a for a, b in zip(chain, chain[1:], strict=False))


def test_sample_indices_fixed_and_unique():
    a = store.sample_indices(10_000, 512)
    assert torch.equal(a, store.sample_indices(10_000, 512))
    assert len(set(a.tolist())) == 512 and a.max() < 10_000
    assert torch.equal(store.sample_indices(10, 512), torch.arange(10))


@pytest.fixture
def one_golden(tmp_path):
    ls = suite("qwen3-8b")
    root = tmp_path / "golden"
    copy_golden(ls.name, root / ls.name)
    return ls, root


def test_no_overwrite_without_update(one_golden):
    ls, root = one_golden
    before = (root / ls.name / "manifest.json").read_bytes()
    with pytest.raises(store.GoldenError, match="already exists; pass --update"):
        generate(ls, root)
    assert (root / ls.name / "manifest.json").read_bytes() == before


def test_update_is_atomic_and_keeps_inputs(one_golden):
    ls, root = one_golden
    old = store.load_golden(ls, root)
    generate(ls, root, update=True)
    new = store.load_golden(ls, root)
    assert torch.equal(old.inputs, new.inputs)
    assert torch.equal(old.modules["logits"], new.modules["logits"])  # deterministic reference
    assert sorted(p.name for p in root.iterdir()) == [ls.name]  # no temp or .old leftovers


@pytest.mark.parametrize("damage,message", [
    ("flip", "corrupt golden file (sha256"),
    ("truncate", "truncated or corrupt golden file"),
    ("delete", "cannot read golden file"),
    ("manifest", "corrupt manifest"),
])
def test_damaged_golden_reported_clearly(one_golden, damage, message, tmp_path):
    ls, root = one_golden
    f = root / ls.name / "modules.safetensors"
    data = f.read_bytes()
    if damage == "flip":
        f.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        f.unlink()
    else:
        (root / ls.name / "manifest.json").write_text("{not json")
    with pytest.raises(store.GoldenError, match=message.replace("(", r"\(")) as e:
        store.load_golden(ls, root)
    assert "\n" not in str(e.value)
    shown = "manifest.json" if damage == "manifest" else "modules.safetensors"
    assert shown in str(e.value)
    # the check says it could not run (an error, blamed on the golden, not the target), in one line
    ctx, failure = run_check(ls, "float32", tmp_path, golden_root=root)
    assert isinstance(failure, CouldNotRun) and failure.step == "golden"
    assert message.split(" (")[0] in failure.message and "\n" not in failure.message


def test_missing_golden(tmp_path):
    ls = suite("qwen3-8b")
    with pytest.raises(store.GoldenError, match="no golden for this suite; create it with `harness golden generate"):
        store.load_golden(ls, tmp_path)
    ctx, failure = run_check(ls, "bfloat16", tmp_path, golden_root=tmp_path)
    assert isinstance(failure, CouldNotRun) and "no golden" in failure.message
    assert not (tmp_path / "qwen3-8b").exists()  # the check never writes a golden


def test_golden_from_another_config(tmp_path, one_golden):
    ls, root = one_golden
    # Another suite's golden under this suite's name: the manifest's config hash differs.
    shutil.rmtree(root / ls.name)
    copy_golden("llama-3.1-8b", root / ls.name)
    with pytest.raises(store.GoldenError, match="made by another config"):
        store.load_golden(ls, root)
    ctx, failure = run_check(ls, "float32", tmp_path, golden_root=root)
    assert isinstance(failure, CouldNotRun) and "another config" in failure.message


def test_changed_prune_is_another_config(write_suite, tmp_path):
    body = (REPO / "suites" / "qwen3-8b.toml").read_text()
    a = suite("qwen3-8b")
    from harness.suite.loader import load_suite

    b = load_suite(write_suite("qwen3-8b", body.replace("intermediate_size = 128", "intermediate_size = 96")))
    assert store.config_hash(a) != store.config_hash(b)
    ctx, failure = run_check(b, "float32", tmp_path)
    assert isinstance(failure, CouldNotRun) and "another config" in failure.message


def test_cli_errors_are_one_line(one_golden, capsys):
    ls, root = one_golden
    (root / ls.name / "inputs.safetensors").write_bytes(b"garbage")
    assert cli(["golden", "verify", "qwen3-8b", "--golden-dir", str(root)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "inputs.safetensors" in err and "truncated or corrupt" in err
    assert cli(["golden", "generate", "qwen3-8b", "--golden-dir", str(root)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists" in err
    assert (root / ls.name / "inputs.safetensors").read_bytes() == b"garbage"  # not overwritten


def test_cli_generate_and_diff(tmp_path, capsys):
    root = tmp_path / "g"
    assert cli(["golden", "generate", "qwen3-8b", "--golden-dir", str(root)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli(["golden", "diff", "qwen3-8b", "--golden-dir", str(root)]) == 0
    assert "no change" in capsys.readouterr().out
    # a golden made in float32 differs from the float64 reference: diff shows metrics per tensor
    assert cli(["golden", "generate", "qwen3-8b", "--golden-dir", str(root), "--update",
                     "--reference", "cpu:float32"]) == 0
    capsys.readouterr()
    assert cli(["golden", "diff", "qwen3-8b", "--golden-dir", str(root)]) == 1
    out = capsys.readouterr().out
    assert "reference:" in out and "~ logits: max_abs" in out and "rel_rmse" in out
    assert cli(["golden", "generate", "qwen3-8b", "--reference", "cpu:float99", "--golden-dir",
                     str(root), "--update"]) == 2


def test_sampled_mode(write_suite, tmp_path):
    body = (REPO / "suites" / "llama-3.1-8b.toml").read_text()
    body = body.replace("[prune]", "[checks.precision]\ngolden_mode = \"sampled\"\nsample_size = 256\n\n[prune]")
    from harness.suite.loader import load_suite

    ls = load_suite(write_suite("llama-3.1-8b", body))
    root = tmp_path / "g"
    path = generate(ls, root)
    # the forward files (the sections - training, decode - hold the pruned model's gradients and decode
    # steps whatever the mode)
    forward = ("inputs.safetensors", "modules.safetensors", "generation.safetensors")
    full = sum((store.current_dir(GOLDEN / "llama-3.1-8b") / f).stat().st_size for f in forward)
    assert sum((store.current_dir(path) / f).stat().st_size for f in forward) < full / 3
    g = store.load_golden(ls, root)
    assert g.sampled and g.modules["logits"].numel() == 256 and "logits" in g.indices
    st = g.manifest["tensors"]["logits"]
    assert st["sampled"] == 256 and st["shape"] == [2, 16, 512] and {"mean", "std", "absmax", "l2"} <= set(st["stats"])
    ctx, failure = run_check(ls, "float32", tmp_path, golden_root=root)
    assert failure is None
    from precision import faults

    ctx, failure = run_check(ls, "float32", tmp_path, golden_root=root, transform=faults.rmsnorm_eps(1))
    assert failure is not None and "model.layers.1.input_layernorm" in failure.message


def test_manifest_records_shapes_dtypes_hashes():
    mf = json.loads((store.current_dir(GOLDEN / "mixtral-8x7b") / "manifest.json").read_text())
    t = mf["tensors"]["model.layers.1.mlp.gate.chosen_experts"]
    assert t["dtype"] == "int64" and t["shape"] == [32, 2]
    assert mf["tensors"]["logits"]["dtype"] == "float64"
    sections = {f"{name}.safetensors" for name in mf.get("sections", {})}
    assert set(mf["files"]) == {"inputs.safetensors", "modules.safetensors", "generation.safetensors"} | sections
    assert len(mf["config_hash"]) == 64 and mf["input_spec"]["seq_len"] == 16


def test_build_golden_is_deterministic():
    ls = suite("qwen3-8b")
    m1, f1 = build_golden(ls)
    g = store.load_golden(ls, GOLDEN)
    assert torch.equal(f1["inputs"]["input_ids"], g.inputs)
    assert torch.equal(f1["modules"]["logits"], g.modules["logits"])
    # budgets are reproducible: regenerating gives the committed golden's budgets within 10%
    for dtype, b in g.manifest["budgets"].items():
        new = m1["budgets"][dtype]["modules"]
        assert set(new) == set(b["modules"])
        for mod, e in b["modules"].items():
            assert abs(new[mod]["budget"] - e["budget"]) <= 0.1 * e["budget"], (dtype, mod)
    assert m1["numerics"]["attention_gain"] == g.manifest["numerics"]["attention_gain"]


# --- goldens validated as data (issue #9, item 5) ------------------------------------------------------


def test_golden_name_must_be_plain_identifier(write_suite, tmp_path, capsys):
    """A suite whose model.name is ``../victim`` must not make `golden generate --update` replace (and
    delete) a directory outside the golden root."""
    from harness.suite.loader import load_suite

    body = (REPO / "suites" / "qwen3-8b.toml").read_text().replace("[model]\n", "[model]\nname = \"../victim\"\n", 1)
    from harness.suite.loader import SuiteError

    path = write_suite("victim-suite", body)
    with pytest.raises(SuiteError, match="model.name: '../victim' is not a plain name"):
        load_suite(path)  # refused at load now (harness.files.paths), before any golden code runs
    root = tmp_path / "golden"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    assert cli(["golden", "generate", str(path), "--update", "--golden-dir", str(root)]) != 0
    out = capsys.readouterr()
    err = out.err + out.out
    assert "not a plain name" in err and err.strip().count("\n") == 0
    assert (victim / "keep.txt").read_text() == "precious" and list(root.iterdir()) == []
    for bad in ("a/b", "..", ".hidden", "x/../../y", ""):
        with pytest.raises(store.GoldenError):
            store.golden_dir(bad, root)
    with pytest.raises(store.GoldenError):  # the low-level writer refuses too
        store.write_golden(root / ".." / "victim", {}, {}, update=True)
    assert (victim / "keep.txt").read_text() == "precious"


def _rewrite(root, name: str, fname: str, edit) -> None:
    """Rewrite one golden file with ``edit(tensors)`` and fix its sha256/size in the manifest, so that
    only the content check can catch what was changed."""
    from safetensors.torch import load, save

    d = root / name
    f = d / fname
    tensors = load(f.read_bytes())
    edit(tensors)
    data = save(tensors, metadata={"format": "pt"})
    f.write_bytes(data)
    mf = json.loads((d / "manifest.json").read_text())
    mf["files"][fname] = {"sha256": store.sha256_bytes(data), "bytes": len(data)}
    (d / "manifest.json").write_text(json.dumps(mf))


@pytest.mark.parametrize("damage,message", [
    ("nan", "non-finite value"),
    ("shape", "has shape [2, 16, 63]"),
    ("dtype", "stored as float16"),
    ("input_nan", "NaN value"),
])
def test_golden_tensor_disagreeing_with_manifest_is_the_goldens_fault(one_golden, damage, message, tmp_path, capsys):
    ls, root = one_golden
    name = "model.layers.0.self_attn"

    def edit(t):
        if damage == "nan":
            t[name][0, 3, 5] = float("nan")
        elif damage == "shape":
            t[name] = t[name][..., :63].contiguous()
        elif damage == "dtype":
            t[name] = t[name].half()
        else:
            key = next(k for k in t if k.endswith(store.IN) and t[k].is_floating_point())
            t[key].view(-1)[0] = float("nan")
    _rewrite(root, ls.name, "modules.safetensors", edit)
    with pytest.raises(store.GoldenError, match=message.replace("[", r"\[")) as e:
        store.load_golden(ls, root)
    assert "the golden is bad, not the target" in str(e.value) and "\n" not in str(e.value)
    assert cli(["golden", "verify", "qwen3-8b", "--golden-dir", str(root)]) == 1
    assert message in capsys.readouterr().err
    ctx, failure = run_check(ls, "bfloat16", tmp_path, golden_root=root)
    assert isinstance(failure, CouldNotRun) and failure.step == "golden" and message in failure.message


def test_golden_generation_nan_or_missing_entry(one_golden, tmp_path):
    ls, root = one_golden

    def nan_logprobs(t):
        t["logprobs"] = torch.full_like(t["logprobs"], float("nan"))
    _rewrite(root, ls.name, "generation.safetensors", nan_logprobs)
    with pytest.raises(store.GoldenError, match="logprobs has .* non-finite"):
        store.load_golden(ls, root)
    # a manifest without the generation entry must not silently skip generation
    mf = json.loads((root / ls.name / "manifest.json").read_text())
    del mf["files"]["generation.safetensors"]
    (root / ls.name / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(store.GoldenError, match="lists no generation.safetensors but the input spec asks for 4"):
        store.load_golden(ls, root)
    ctx, failure = run_check(ls, "float32", tmp_path, golden_root=root)
    assert isinstance(failure, CouldNotRun) and "generation" in failure.message


def test_nan_target_generation_logprobs_fail():
    """max(x, nan) keeps x: all-NaN logprobs of agreeing greedy tokens used to pass."""
    from harness.precision.compare import Comparison, compare_generation
    from harness.precision.tolerance import DEFAULTS

    g = store.load_golden(suite("qwen3-8b"), GOLDEN)
    gen = {"tokens": g.generation["tokens"].clone(),
           "logprobs": torch.full_like(g.generation["logprobs"], float("nan"))}
    res = Comparison()
    compare_generation(g, gen, DEFAULTS["bfloat16"], res)
    assert res.generation_failure is not None and "non-finite" in res.generation_failure
    ok = Comparison()
    compare_generation(g, {"tokens": gen["tokens"], "logprobs": g.generation["logprobs"].clone()},
                       DEFAULTS["bfloat16"], ok)
    assert ok.generation_failure is None


def _with_section(one_golden, tensors: dict, spec: dict) -> tuple:
    """The qwen3-8b golden rewritten (format 3) with a section ``extra`` holding ``tensors``."""
    ls, root = one_golden
    g = store.load_golden_dir(root / ls.name)
    files = {"inputs": {"input_ids": g.inputs}, "generation": g.generation,
             "modules": {**g.modules, **{k + store.IN: v for k, v in g.module_inputs.items()}}}
    packed, meta = store.pack_section(tensors)
    manifest = dict(g.manifest, sections={"extra": {"spec": store.jsonable(spec), "tensors": meta, "order": ["a"]}})
    files["extra"] = packed
    store.write_golden(root / ls.name, manifest, files, update=True)
    return ls, root


def test_sections_round_trip_and_refuse_other_knobs(one_golden):
    """A section's tensors come back as stored (floats as float32); a section made with other knobs,
    or one the golden lacks, is refused in one line naming the fix."""
    spec = {"steps": 3, "lr": 0.01, "caches": ("dynamic", "static")}
    ls, root = _with_section(one_golden, {"a": torch.arange(6, dtype=torch.float64).reshape(2, 3),
                                          "a::idx": torch.tensor([0, 5])}, spec)
    g = store.load_golden(ls, root)
    sec = g.section("extra", spec)
    assert sec.entry["order"] == ["a"] and sec.tensors["a"].dtype == torch.float32
    assert torch.equal(sec.tensors["a::idx"], torch.tensor([0, 5]))
    with pytest.raises(store.GoldenError, match=r"extra section was made with .*'steps': 3.*asks for .*'steps': 4"):
        g.section("extra", {**spec, "steps": 4})
    with pytest.raises(store.GoldenError, match=r"no training section .*golden generate qwen3-8b --update"):
        g.section("training", {})
    ctx, failure = run_check(ls, "float32", ls.path.parent, golden_root=root)  # the forward check is unaffected
    assert failure is None


@pytest.mark.parametrize("damage,message", [
    ("nan", "a has 1 non-finite value"),
    ("shape", "a has shape"),
    ("extra", r"holds 1 tensor\(s\) the manifest does not list, e.g. b"),
])
def test_damaged_section_is_the_goldens_fault(one_golden, damage, message):
    from safetensors.torch import load, save

    ls, root = _with_section(one_golden, {"a": torch.ones(2, 3)}, {})
    d = store.current_dir(root / ls.name)
    t = load((d / "extra.safetensors").read_bytes())
    if damage == "nan":
        t["a"][0, 0] = float("nan")
    elif damage == "shape":
        t["a"] = torch.ones(3, 2)
    else:
        t["b"] = torch.ones(1)
    data = save(t)
    (d / "extra.safetensors").write_bytes(data)
    mf = json.loads((d / "manifest.json").read_text())
    mf["files"]["extra.safetensors"] = {"sha256": store.sha256_bytes(data), "bytes": len(data)}  # re-hashed
    (d / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(store.GoldenError, match=message):
        store.load_golden(ls, root)


def test_format_2_golden_refused_in_one_line(one_golden):
    ls, root = one_golden
    mf = json.loads((root / ls.name / "manifest.json").read_text())
    (root / ls.name / "manifest.json").write_text(json.dumps(dict(mf, format=2)))
    with pytest.raises(store.GoldenError) as e:
        store.load_golden(ls, root)
    assert "golden format 2, this harness reads format 3" in str(e.value) and "--update" in str(e.value)
    assert "\n" not in str(e.value)
