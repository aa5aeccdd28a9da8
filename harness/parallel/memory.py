"""Peak live tensor memory of a pipeline stage, where MemTracker cannot measure.

``torch.distributed._tools.mem_tracker.MemTracker`` attributes memory to modules through a module
tracker whose multi-grad hooks do not survive the pipeline schedule's partial backward calls
(``stage_backward`` runs ``torch.autograd.backward`` on the stage's outputs with input values from
another process). ``StoragePeak`` keeps MemTracker's accounting and drops the per-module part: a
dispatch mode that records every storage an op's outputs live in (weakly; a storage's bytes leave
the count when it is freed), the storages of the module's parameters, buffers and gradients when
entered, and storage resizes (``UntypedStorage.resize_`` is not an op the dispatcher sees; FSDP2
allocates and frees its unsharded parameters with it, as MemTracker also patches). The peak is the
largest sum of live tracked bytes - MemTracker's "Total" without its per-module breakdown.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class StoragePeak(TorchDispatchMode):
    """``with StoragePeak(module) as m: ...``; ``m.peak`` in bytes."""

    def __init__(self, module: torch.nn.Module | None = None):
        super().__init__()
        self._module = module
        self._bytes = WeakIdKeyDictionary()  # storage -> bytes counted for it
        self._refs: list = []
        self.live = 0
        self.peak = 0
        self._orig_resize = None

    def _track(self, t: torch.Tensor) -> None:
        for st in get_untyped_storages(t):
            n = st.nbytes()
            rec = self._bytes.get(st)
            if rec is None:
                # [bytes counted]: shared with the finalizer, which takes them off when the storage
                # is freed (after a resize too). Neither holds the storage.
                self._bytes[st] = rec = [n]
                self._refs.append(weakref.ref(st, lambda _r, rec=rec, me=weakref.ref(self): me() and me()._free(rec)))
                self.live += n
            elif rec[0] != n:
                self.live += n - rec[0]
                rec[0] = n
        self.peak = max(self.peak, self.live)

    def _free(self, rec: list[int]) -> None:
        self.live -= rec[0]

    def __enter__(self):
        if self._module is not None:
            for t in [*self._module.parameters(), *self._module.buffers()]:
                self._track(t)
                if t.grad is not None:
                    self._track(t.grad)
        self._orig_resize = orig = torch.UntypedStorage.resize_
        me = weakref.ref(self)

        def resize_(st, size):
            orig(st, size)
            mode = me()
            rec = mode._bytes.get(st) if mode is not None else None
            if rec is not None:
                mode.live += st.nbytes() - rec[0]
                rec[0] = st.nbytes()
                mode.peak = max(mode.peak, mode.live)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
