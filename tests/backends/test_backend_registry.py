"""Backend registry: built-ins, absent vendor backends, custom backends from harness.toml, probes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from harness.backends import registry
from harness.backends.base import Backend, Registry


def test_builtins_are_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    assert any(ep.value == "harness.backends.builtin:register" for ep in entry_points(group="harness.backends"))
    names = registry().names()
    assert names[:7] == ["cpu", "cuda", "xpu", "mps", "npu", "musa", "mlu"]
    assert registry().get("npu").dispatch_key == "PrivateUse1"
    assert registry().get("npu").collective == "hccl"


def test_cpu_is_available_and_probes_dtypes():
    cpu = registry().get("cpu")
    assert cpu.availability() == (True, "cpu is always available")
    assert cpu.supports("float32") == (True, "ok")
    assert set(cpu.supported_dtypes) == {"float64", "float32", "bfloat16", "float16"}
    assert cpu.device() == torch.device("cpu")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_uninstalled_vendor_backend_says_why():
    ok, why = registry().get("npu").availability()
    assert not ok
    assert "module 'torch_npu' not importable" in why and "No module named 'torch_npu'" in why
    assert registry().get("npu").supports("float32")[0] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_absent_device_says_why():
    ok, why = registry().get("cuda").availability()
    assert not ok and "torch.cuda.is_available() is False" in why


def test_custom_backend_from_harness_toml(tmp_path, monkeypatch):
    (tmp_path / "harness_testdev.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "harness.toml"
    cfg.write_text("""
[[backends]]
name = "testdev"
module = "harness_testdev"
device_type = "cpu"
collective = "gloo"
dispatch_key = "CPU"
description = "a vendor backend declared in configuration"

[[backends]]
name = "ghost"
module = "torch_ghost_vendor"
device_type = "ghost"
collective = "gccl"
dispatch_key = "PrivateUse1"
""")
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    reg = registry()
    dev = reg.get("testdev")
    assert dev.source == "harness.toml" and dev.collective == "gloo"
    assert dev.availability()[0] is True
    import harness_testdev

    assert harness_testdev.LOADED
    ok, why = reg.get("ghost").availability()
    assert not ok and "torch_ghost_vendor" in why
    assert "cpu" in reg  # built-ins stay


def test_bad_settings_file_is_a_clear_error(tmp_path, monkeypatch):
    from harness.settings import SettingsError

    cfg = tmp_path / "harness.toml"
    cfg.write_text("[[backends]]\nname = 'x'\n")
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    with pytest.raises(SettingsError, match=r"harness.toml: backends.0.device_type: Field required"):
        registry()


def test_registry_refuses_duplicates():
    reg = Registry()
    reg.add(Backend("a", "cpu", "gloo"))
    with pytest.raises(ValueError, match="registered twice"):
        reg.add(Backend("a", "cpu", "gloo"))
    with pytest.raises(KeyError, match="unknown backend 'b' \\(registered: a\\)"):
        reg.get("b")


def test_device_module_missing_in_torch():
    ok, why = Backend("weird", "notadevice", "gloo").availability()
    assert not ok and "torch has no 'notadevice' device module" in why


def test_cpu_peak_memory_tracks_allocations():
    cpu = Backend("cpu", "cpu", "gloo")
    cpu.reset_peak_memory()
    before = cpu.peak_memory()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    x += 1
    after = cpu.peak_memory()
    assert after - before >= 48 * 2**20, (before, after)
