"""A file that is not safetensors is named as such (never "truncated shard ... re-download it"),
through `harness weights manifest` as a user runs it. The pickle bytes are written, never loaded."""

from __future__ import annotations

import pickle

import torch
from safetensors.torch import save_file

from harness.cli import main as harness_main


def test_a_pickle_renamed_to_safetensors_is_not_a_safetensors_file(tmp_path, capsys):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(pickle.dumps({"w": list(range(100))}, protocol=4))
    assert harness_main(["weights", "manifest", str(d)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: not a safetensors file (it starts like a pickle)" in err
    assert "truncated" not in err and "re-download" not in err


def test_a_symlink_to_a_text_file_is_not_a_safetensors_file(tmp_path, capsys):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "notes.txt").write_text("these are not weights, just a text file that is long enough\n" * 4)
    (d / "model.safetensors").symlink_to("notes.txt")
    assert harness_main(["weights", "manifest", str(d)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: not a safetensors file" in err and "truncated" not in err


def test_a_truly_truncated_shard_is_still_called_truncated(tmp_path, capsys):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(d / "model.safetensors"))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert harness_main(["weights", "manifest", str(d)]) == 2
    assert "truncated shard" in capsys.readouterr().err
