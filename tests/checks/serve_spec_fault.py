"""A fault in speculative decoding's verification forward, in the serving engine's own process (tests/
checks/test_serve.py's speculative item): run there by the vLLM runner (``preload``) before vLLM builds
the engine.

On a step that verifies draft tokens (the scheduler handed the model runner some), vLLM's CPU attention
runs with its softmax scale 2 % too large for the forwards where a request brings more than one new
token on top of its cached context: the last token and its drafts, the query shape that accelerator
backends give a kernel path of its own for verification. Steps without drafts are exact, whatever their
shape: the plain item and its probes (a chunked prefill's short last chunk included) pass, and only
the speculative variant reaches the fault. Imports vLLM only: the engine's venv has no harness."""

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

FACTOR = 1.02

_forward, _execute = CPUAttentionBackendImpl.forward, GPUModelRunner.execute_model
_step = {"drafts": False}


def execute_model(self, scheduler_output, *a, **kw):
    _step["drafts"] = bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None))
    try:
        return _execute(self, scheduler_output, *a, **kw)
    finally:
        _step["drafts"] = False


def _verifying(m) -> bool:
    if not _step["drafts"] or m is None or m.max_query_len <= 1:
        return False
    q = (m.query_start_loc[1:] - m.query_start_loc[:-1])[: m.seq_lens.shape[0]]
    return bool(((q > 1) & (m.seq_lens > q)).any())


def forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw):
    if not _verifying(attn_metadata):
        return _forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw)
    scale = self.scale
    self.scale = scale * FACTOR
    try:
        return _forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw)
    finally:
        self.scale = scale


GPUModelRunner.execute_model = execute_model
CPUAttentionBackendImpl.forward = forward
