"""A batch-dependent reduction in the serving engine's own process (tests/checks/test_serve.py): run
there by the vLLM runner (``preload``) before vLLM builds the engine.

vLLM's CPU attention, whenever one forward holds more than one request, adds a tenth of the mean of its
output over all the forward's token rows - a reduction whose extent is the whole batch instead of one
request's rows, the shape of a batched kernel path summing across requests. A request served alone
(one request per forward, prefill or decode) is exact. Imports vLLM and torch only: the engine's venv
has no harness."""

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

_forward = CPUAttentionBackendImpl.forward


def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
    out = _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
    if attn_metadata is not None and int((attn_metadata.seq_lens > 0).sum()) > 1:
        n = attn_metadata.num_actual_tokens
        with torch.no_grad():
            out[:n] += 0.1 * out[:n].mean(0, keepdim=True)
    return out


CPUAttentionBackendImpl.forward = forward
