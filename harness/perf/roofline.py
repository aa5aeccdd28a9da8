"""The roofline as the yardstick: how far a measured time is from the physical limit.

Work per phase comes from ``harness.inspect``'s formulas (parameters counted on the meta device,
``compute_flops``), applied to the model the perf check actually runs:

* **prefill** of ``B x S`` tokens: ``B x S x prefill_flops_per_token(S)`` (matmuls + causal attention);
* **decode**, one step of ``B`` tokens at context ``L``: ``B x decode_flops_per_token(L)`` FLOPs
  (MLA as transformers runs it, re-expanding the cache), and bytes = the weights the step touches
  (activated parameters; for MoE ``min(E, B x top_k)`` experts per layer) + the KV cache read
  (``B x L x`` cached bytes per token);
* **train step**: forward + backward = ``3 x`` the prefill FLOPs (the usual 6N per token).

MFU = FLOPs / time / peak FLOP/s, MBU = bytes / time / peak bytes/s. The peaks are the declared
ones (``[checks.perf] peak_flops`` / ``peak_bandwidth``) or the calibration kernels' achieved rates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.inspect.flops import compute_flops
from harness.inspect.params import Target, count_parameters, meta_model

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Work:
    batch: int
    seq: int
    decode_context: float
    prefill_flops: float  # whole prefill of B x S tokens
    decode_flops_per_step: float  # one decode step of B tokens
    decode_bytes_per_step: float
    train_flops: float  # one forward + backward of B x S tokens
    weight_bytes: float  # weights one decode step touches
    kv_bytes_per_step: float

    def to_dict(self) -> dict:
        return asdict(self)


def work_for(cfg, params, batch: int, seq: int, decode_tokens: int, dtype: str) -> Work:
    """FLOPs and bytes for the perf check's phases (hand-checkable: tests/perf/test_roofline.py)."""
    nbytes = DTYPE_BYTES[dtype]
    # Decode steps run at contexts S .. S+T-1: their mean is the context of the average step.
    ctx = seq + (decode_tokens - 1) / 2 if decode_tokens else float(seq)
    fl = compute_flops(cfg, params, prefill_len=seq, decode_context=1, kv_dtype_bytes=nbytes)
    attn = fl.attention_flops_per_context_token
    decode_per_token = fl.matmul_flops_per_token + attn * ctx
    if fl.decode_flops_per_token_hf is not None:  # MLA: re-expansion of the cache, per context token
        extra_per_ctx = fl.decode_flops_per_token_hf - fl.decode_flops_per_token
        decode_per_token += extra_per_ctx * ctx
    act = params.activated_by_kind
    weights = float(sum(act.get(k, 0) for k in act if k != "embedding"))
    routed = act.get("routed_experts", 0)
    if routed and params.experts_per_token and params.num_experts:
        touched = min(params.num_experts, batch * params.experts_per_token)
        weights += routed * (touched / params.experts_per_token - 1)
    kv_per_token = next(iter(fl.kv_cache_bytes_per_token.values()), 0)
    kv = batch * ctx * kv_per_token
    weight_bytes = weights * nbytes
    prefill = batch * seq * fl.prefill_flops_per_token
    return Work(batch, seq, ctx, prefill, batch * decode_per_token, weight_bytes + kv, 3.0 * prefill,
                weight_bytes, kv)


def work_for_model(ls, mc, batch: int, seq: int, decode_tokens: int, dtype: str) -> Work:
    """The same, counting the parameters of ``mc`` (the perf-sized config) on the meta device."""
    model, _ = meta_model(Target(ls.name, ls.raw_config, ls, ls.path), pruned=True, mc=mc)
    params = count_parameters(model, mc)
    return work_for(mc.config, params, batch, seq, decode_tokens, dtype)


def fraction(amount: float, seconds: float, peak_per_s: float | None) -> float | None:
    """Achieved rate / peak rate; None when there is no peak or no time."""
    if not peak_per_s or not seconds or seconds <= 0:
        return None
    return amount / seconds / peak_per_s
