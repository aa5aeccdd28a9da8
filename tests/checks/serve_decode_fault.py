"""A decode-only fault in the serving engine's own process (tests/checks/test_serve.py): run there by the
vLLM runner (``preload``) before vLLM builds the engine.

vLLM's CPU attention runs with its softmax scale 2 % too large whenever every request in the forward
decodes one token (query length 1: the decode step) - the shape of a decode kernel that folds a wrong
1/sqrt(d) into its own path. Prefill (every prompt position, and the first generated token, which the
prefill's last position predicts) is exact; each later step attends a little too sharply, which moves its
log-probabilities without changing which token is greedy. Imports vLLM only: the engine's venv has no
harness."""

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

FACTOR = 1.02

_forward = CPUAttentionBackendImpl.forward


def forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw):
    if attn_metadata is None or attn_metadata.max_query_len != 1:
        return _forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw)
    scale = self.scale
    self.scale = scale * FACTOR
    try:
        return _forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw)
    finally:
        self.scale = scale


CPUAttentionBackendImpl.forward = forward
