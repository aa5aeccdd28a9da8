"""Defects of harness's device path that the test device exposed (issue #28), each pinned here
without the device itself (no compiler needed): a vendor module that registers ``torch.<type>``."""

from __future__ import annotations

import sys

import torch

from harness.backends import Backend

VENDOR = '''
import types, torch
torch.fakedev28 = types.SimpleNamespace(device_count=lambda: 3, is_available=lambda: True,
                                        synchronize=lambda device=None: None)
'''


def test_device_probes_import_the_vendor_module_first(tmp_path, monkeypatch):
    """An isolated item's worker asks the backend for its device without having run the
    availability probe: before the fix the vendor module was never imported there, so
    ``torch.device("hdev")`` failed ("Expected one of cpu, cuda, ... device type") and every
    check on a PrivateUse1 backend errored in its build step."""
    (tmp_path / "fake_vendor28.py").write_text(VENDOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        b = Backend("fake28", "fakedev28", "gloo", module="fake_vendor28", dispatch_key="PrivateUse1")
        assert b.device_count() == 3  # no availability() call first
        assert b._mod() is torch.fakedev28  # synchronize and the memory probes read it
        assert Backend("fake28b", "fakedev28", "gloo", module="fake_vendor28").device_count() == 3
        broken = Backend("broken28", "nodev28", "gloo", module="no_such_vendor_module_28")
        assert broken.device_count() == 1 and broken._mod() is None  # unavailable: no crash
        assert not broken.available()
    finally:
        sys.modules.pop("fake_vendor28", None)
        if hasattr(torch, "fakedev28"):
            del torch.fakedev28
