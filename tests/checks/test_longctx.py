"""The longctx check: the bundled suites' pruned models at 4096 positions (one-pass prefill, chunked
prefill through the KV cache, cached decode) against float64, clean in float32 and bfloat16; an
attention kernel wrong only past 2048 keys - invisible at the 16-token goldens - caught with the
phase and position 2048 named; a decode-only position fault caught at decode step 0."""

from __future__ import annotations

import json

import pytest
import torch

from harness.checks import CheckContext, CheckFailure, registry, run_one
from harness.suite.loader import load_suite
from tests_support import REPO_SUITES

PAST = 2048  # the fault's sequence length: a kernel path taken only for longer key ranges


@pytest.fixture(scope="module")
def llama():
    return load_suite(REPO_SUITES / "llama-3.1-8b.toml")


def _props(ctx) -> dict:
    return dict(ctx.properties)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_suite_passes_at_4096_positions(llama, dtype):
    props = _props(run_one(llama, "longctx", "cpu", dtype))
    assert props["harness.detail.longctx_layout"].startswith("4096 positions, chunk 512, 8 decode steps")
    assert "llama3 rope original_max_position_embeddings 8192" in props["harness.detail.longctx_layout"]
    assert float(props["metric.longctx_positions"]) == 4104
    assert 0 < float(props["metric.longctx_worst_budget_use"]) <= 1  # measured, and under budget
    for ph in ("prefill", "chunked", "decode"):
        assert float(props[f"metric.longctx_{ph}_max_diff"]) > 0  # compared, not skipped
    buckets = json.loads(props["harness.detail.longctx_buckets"])
    assert [s for s, *_ in buckets["prefill"]] == list(range(0, 4096, 256))  # error against position
    assert [s for s, *_ in buckets["decode"]] == list(range(4096, 4104))


@pytest.fixture
def long_attention_fault(monkeypatch):
    """Installs SDPA ``amp`` x high at query positions >= 2048, only when the key range is longer than
    2048 (a split or block count chosen by length); float64 (the reference's dtype) passes through.
    Returns the clean function."""
    clean = torch.nn.functional.scaled_dot_product_attention

    def install(amp: float):
        def sdpa(q, k, v, *args, **kwargs):
            out = clean(q, k, v, *args, **kwargs)
            n_q, n_k = q.shape[-2], k.shape[-2]
            if q.dtype == torch.float64 or n_k <= PAST:
                return out
            pos = torch.arange(n_k - n_q, n_k, device=q.device)  # the queries' absolute positions (causal)
            return torch.where((pos >= PAST)[:, None], out * amp, out)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        return clean
    return install


# float32: 1 % is ~250x its budget at every faulty position; bfloat16's own rounding hides 3 % at any
# single position, its bucket means (stable to a few % clean) show it (docs/precision.md "Long context")
@pytest.mark.parametrize("dtype,amp", [("float32", 1.01), ("bfloat16", 1.03)])
def test_attention_wrong_past_a_length_is_caught_at_that_position(llama, long_attention_fault, dtype, amp):
    long_attention_fault(amp)
    with pytest.raises(CheckFailure) as e:
        run_one(llama, "longctx", "cpu", dtype)
    msg = str(e.value)
    assert msg.startswith("long context, one-pass prefill: position 2048 (bucket 2048-2303) over budget"), msg
    assert "error starts there" in msg and "budget" in msg
    assert "also over budget: chunked from position 2048" in msg, msg  # the same in the cache path
    if dtype == "float32":  # the decode steps: 8 positions, judged one by one
        assert msg.endswith("chunked from position 2048, decode from position 4096"), msg
    else:  # below single-position noise: the bucket means name it
        assert "the bucket's mean hidden rel error" in msg, msg
    assert "2048-2303" in e.value.details and "over" in e.value.details


def test_the_same_fault_is_invisible_at_the_16_token_golden(llama, long_attention_fault):
    """The precision check's 16-token forward is the same to the bit with the fault installed."""
    from harness.models.build import build_model, seeded_tokens

    model, mc = build_model(llama, "float32", seed=llama.suite.checks.precision.seed)
    ids = seeded_tokens(mc.config.vocab_size, 2, llama.suite.checks.precision.seq_len, 1)
    clean_sdpa = long_attention_fault(1.01)
    with torch.no_grad():
        faulty = model(ids).logits
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.nn.functional, "scaled_dot_product_attention", clean_sdpa)
            clean = model(ids).logits
    assert torch.equal(faulty, clean)


def _decode_position_fault(past: int):
    """Cached decode only: a one-token call at position >= past gets the rotary angles of the next
    position (prefill chunks never take this path)."""
    def transform(model):
        rot = model.model.rotary_emb
        forward = rot.forward

        def wrong(x, position_ids, *args, **kwargs):
            if position_ids.shape[-1] == 1 and int(position_ids.max()) >= past:
                position_ids = position_ids + 1
            return forward(x, position_ids, *args, **kwargs)
        rot.forward = wrong
        return model
    return transform


def test_decode_only_fault_fails_the_decode_phase_at_step_0(llama):
    from harness.backends import get

    ctx = CheckContext(llama, get("cpu"), "float32", check="longctx")
    with pytest.raises(CheckFailure) as e:
        registry().get("longctx").run(ctx, transform=_decode_position_fault(4096))
    msg = str(e.value)
    assert msg.startswith("long context, cached decode: step 0 (position 4096) over budget"), msg
    assert "after a 4096-position prefix in chunks of 512" in msg and "also over budget" not in msg


def test_config_errors_name_the_key(tmp_path):
    from harness.suite.loader import SuiteError

    body = (REPO_SUITES / "llama-3.1-8b.toml").read_text().replace(
        'config = "configs/', f'config = "{REPO_SUITES}/configs/')
    for bad, key in (("positions = 8", "checks.longctx.positions"), ("chunk = 0", "checks.longctx.chunk"),
                     ("scope = \"weekly\"", "checks.longctx.scope")):
        p = tmp_path / "bad.toml"
        p.write_text(body + f"\n[checks.longctx]\n{bad}\n")
        with pytest.raises(SuiteError, match=key):
            load_suite(p)


# last: it replaces the process's cached llama reference
def test_mla_with_yarn_past_its_original_length_passes():
    """DeepSeek-V3: MLA attention, yarn rope whose original length (4096) the decode steps pass."""
    props = _props(run_one(load_suite(REPO_SUITES / "deepseek-v3.toml"), "longctx", "cpu", "bfloat16"))
    assert "yarn rope original_max_position_embeddings 4096" in props["harness.detail.longctx_layout"]
    assert 0 < float(props["metric.longctx_worst_budget_use"]) <= 1


def test_max_position_embeddings_bounds_the_prefix(tmp_path):
    """A config shorter than positions + steps: the prefix is cut to fit, and said so."""
    body = (REPO_SUITES / "llama-3.1-8b.toml").read_text().replace(
        'config = "configs/', f'config = "{REPO_SUITES}/configs/').replace(
        "vocab_size = 512\n", "vocab_size = 512\nmax_position_embeddings = 600\n", 1)
    p = tmp_path / "short.toml"
    p.write_text(body + "\n[checks.longctx]\nchunk = 128\nbucket = 64\n")
    ctx = run_one(load_suite(p), "longctx", "cpu", "float32")
    assert "positions cut to 592: max_position_embeddings 600" in ctx.notes
    assert float(_props(ctx)["metric.longctx_positions"]) == 600
