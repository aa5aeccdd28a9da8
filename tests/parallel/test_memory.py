"""StoragePeak (pipeline stages' peak memory) against MemTracker where both work."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from harness.parallel.memory import StoragePeak


def _step(m: torch.nn.Module, x: torch.Tensor) -> None:
    m.zero_grad(set_to_none=True)
    m(x).square().mean().backward()


def test_storage_peak_equals_memtracker_and_follows_frees_and_resizes():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(32, 64)
    mt = MemTracker()
    mt.track_external(m)
    with mt:
        _step(m, x)
    want = sum(v.get("Total", 0) for v in mt.get_tracker_snapshot("peak").values())
    m.zero_grad(set_to_none=True)
    with StoragePeak(m) as sp:
        _step(m, x)
    assert sp.peak == want > 0
    with StoragePeak() as sp:
        a = torch.empty(1000, dtype=torch.float32)
        assert sp.live == 4000
        a.untyped_storage().resize_(0)  # FSDP2 frees unsharded parameters this way
        assert sp.live == 0
        a.untyped_storage().resize_(400)
        del a
        assert sp.live == 0 and sp.peak == 4000
