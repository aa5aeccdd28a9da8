"""A stale KV page after a prefix-cache hit, in the serving engine's own process
(tests/checks/test_serve.py): run there by the vLLM runner (``preload``) before vLLM builds the engine.

When vLLM's KV cache manager serves a request's prefix from cached pages (a hit), the last 8 slots of
each hit page are made stale in every layer before the request's forward reads them: their keys and
values replaced by those of the page's first 8 slots - what the page would hold had another sequence
written it while it was still indexed as this prefix's. The request that filled the page (the miss) ran
before and is exact; every request that does not read the prefix cache never sees it. Imports vLLM and
torch only: the engine's venv has no harness."""

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.core.kv_cache_manager import KVCacheManager

STALE = 8  # slots at the end of each hit page
_hits: list[int] = []  # page ids of the latest hit (scheduler and model run in this one process)
_done: set[tuple[int, int]] = set()  # (kv cache tensor, page) made stale already: once per layer per page

_lookup = KVCacheManager.get_computed_blocks


def get_computed_blocks(self, request):
    blocks, n, boundary = _lookup(self, request)
    if n > 0:
        _hits[:] = [b for group in blocks.get_block_ids() for b in group]
    return blocks, n, boundary


_forward = CPUAttentionBackendImpl.forward


def forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw):
    if attn_metadata is not None and _hits:
        nb, heads, bs, _ = kv_cache.shape
        kv = kv_cache.view(nb, heads, 2 * bs, -1)  # keys in rows [0, bs), values in [bs, 2 bs) (cpu_attn.py)
        with torch.no_grad():
            for page in _hits:
                if (kv_cache.data_ptr(), page) not in _done:
                    _done.add((kv_cache.data_ptr(), page))
                    for base in (0, bs):
                        kv[page, :, base + bs - STALE:base + bs] = kv[page, :, base:base + STALE].clone()
    return _forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw)


KVCacheManager.get_computed_blocks = get_computed_blocks
CPUAttentionBackendImpl.forward = forward
