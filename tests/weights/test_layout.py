"""Checkpoint discovery, header checks, pickle refusal, manifests and the `harness weights` command."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from harness.cli import main
from harness.weights.layout import WeightsError, open_checkpoint
from harness.weights.manifest import MANIFEST_NAME, read_manifest, verify, write_manifest


def test_sharded_checkpoint_is_indexed_from_headers(kimi_ckpt):
    root, _, full = kimi_ckpt
    ck = open_checkpoint(root)
    assert len(ck.shards) > 5 and ck.index is not None
    info = ck.tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    assert info.shape == (64, 32) and info.dtype == "float32" and info.shard == ck.index[info.name]


def test_truncated_shard_is_named_with_its_sizes(kimi_ckpt, tmp_path):
    root, _, _ = kimi_ckpt
    bad = tmp_path / "ckpt"
    shutil.copytree(root, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[2]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(WeightsError, match=rf"{shard.name}: truncated shard: its header needs {size} bytes, "
                                           rf"the file has {size - 100}"):
        open_checkpoint(bad)


def test_pickle_only_checkpoint_is_refused_unless_allowed(tmp_path):
    sd = {"model.embed_tokens.weight": torch.ones(4, 2)}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"only pickle weights \(pytorch_model\.bin\); harness reads safetensors only.*"
                                           r"model\.weights_allow_pickle = true"):
        open_checkpoint(tmp_path)
    ck = open_checkpoint(tmp_path, allow_pickle=True)
    assert ck.pickle and ck.tensors["model.embed_tokens.weight"].shape == (4, 2)

    class Evil:  # an arbitrary object: weights_only=True refuses to unpickle it
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"x": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"torch\.load\(weights_only=True\) refused it"):
        open_checkpoint(tmp_path, allow_pickle=True)


def test_a_single_pickle_file_suite_loads_only_when_allowed(kimi_ckpt, tmp_path):
    """model.weights naming one pickle file: the suite is refused in one line naming the opt-in, and
    with model.weights_allow_pickle the file is read with torch.load(weights_only=True)."""
    from safetensors.torch import load_file

    from harness.models.build import build_model
    from harness.suite.loader import SuiteError, load_suite
    from tests.weights.conftest import write_suite

    root, raw, full = kimi_ckpt
    sd = {}
    for f in sorted(root.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    torch.save(sd, tmp_path / "model.bin")
    with pytest.raises(SuiteError, match=r"only safetensors weights are loaded \(never pickles\), got model\.bin; "
                                         r"set model\.weights_allow_pickle = true"):
        load_suite(write_suite(tmp_path / "a", "k", raw, f'weights = "{tmp_path / "model.bin"}"\n'))
    ls = load_suite(write_suite(tmp_path / "b", "k", raw,
                                f'weights = "{tmp_path / "model.bin"}"\nweights_allow_pickle = true\n'))
    model, mc = build_model(ls)
    assert any("torch.load(weights_only=True)" in n for n in mc.notes)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], full.state_dict()["model.embed_tokens.weight"])


def test_manifest_catches_a_changed_byte_and_a_missing_shard(kimi_ckpt, tmp_path):
    root, _, _ = kimi_ckpt
    ck_dir = tmp_path / "ckpt"
    shutil.copytree(root, ck_dir)
    path = write_manifest(ck_dir)
    assert path == ck_dir / MANIFEST_NAME
    m = read_manifest(path)
    assert verify(open_checkpoint(ck_dir), m) == []
    shard = sorted(ck_dir.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # same size, one bit in the last tensor's data
    shard.write_bytes(bytes(data))
    problems = verify(open_checkpoint(ck_dir), m)
    assert problems == [f"{shard.name}: checksum mismatch (sha256 {m['files'][shard.name]['sha256'][:12]}... "
                        "recorded); re-download it"]


def test_cli_manifest_and_verify(kimi_ckpt, tmp_path, capsys):
    root, _, _ = kimi_ckpt
    d = tmp_path / "ckpt"
    shutil.copytree(root, d)
    assert main(["weights", "manifest", str(d)]) == 0
    assert f"wrote {d / MANIFEST_NAME}" in capsys.readouterr().out
    assert main(["weights", "verify", str(d)]) == 0
    assert "all match the manifest" in capsys.readouterr().out
    extra = d / "model-99999-of-99999.safetensors"
    save_file({"x": torch.zeros(1)}, str(extra))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["x"] = extra.name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["weights", "verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"{extra.name}: in the checkpoint, not in the manifest" in out
    assert "model.safetensors.index.json: " in out  # the index changed too
    assert main(["weights", "manifest", str(tmp_path / "nowhere")]) == 2
    assert "error: checkpoint not found" in capsys.readouterr().err


def _meta(raw):
    from harness.models.build import architecture_class
    from harness.models.config import build_config

    mc = build_config(raw)
    with torch.device("meta"):
        return architecture_class(mc.architecture)(mc.config)


def test_layout_of_plain_fp8_and_int4_checkpoints_matches_the_meta_model(kimi_ckpt, kimi_fp8, kimi_int4):
    from harness.weights.expected import compare

    root, raw, _ = kimi_ckpt
    meta = _meta(raw)
    for d in (root, kimi_fp8, kimi_int4):
        rep = compare(meta, open_checkpoint(d))
        assert rep.ok and rep.expected == 129, (d, rep.summary(), rep.mismatched[:2], rep.unexpected[:2])


def test_layout_reports_a_wrong_scale_tiling_and_an_unexpected_tensor(kimi_ckpt, kimi_fp8, tmp_path):
    from safetensors.torch import load_file

    from harness.weights.expected import compare

    _, raw, _ = kimi_ckpt
    bad = tmp_path / "ckpt"
    shutil.copytree(kimi_fp8, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.2.self_attn.o_proj.weight_scale_inv"
    shard = index["weight_map"][name]
    sd = load_file(str(bad / shard))
    sd[name] = torch.ones(1, 1)  # a 64x64 weight in 32x32 blocks needs [2, 2]
    sd["model.layers.2.self_attn.rogue.weight"] = torch.zeros(2)
    index["weight_map"]["model.layers.2.self_attn.rogue.weight"] = shard
    save_file(sd, str(bad / shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    rep = compare(_meta(raw), open_checkpoint(bad))
    assert rep.mismatched == [f"{name} ({shard}): shape [1, 1], 32x32 blocks of [64, 64] need [2, 2]"]
    assert rep.unexpected == [f"model.layers.2.self_attn.rogue.weight ({shard})"] and not rep.missing
