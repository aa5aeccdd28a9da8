"""`harness export SUITE DIR` (issue #46): the suite's pruned, seeded model as a checkpoint a serving
engine loads, keeping the published head_dim, realistic numerics baked into the weights: transformers
reloads it and computes what harness's own build computes."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cli import main
from harness.models import numerics
from harness.models.build import build_model, seeded_tokens
from harness.serve.export import cached_export, read_info, serving_config
from harness.suite.loader import load_suite
from tests_support import REPO


def _with_head_dim(write_suite, suite: str, head_dim: int):
    """The bundled suite with its ``[prune]`` head_dim set otherwise (a suite that says so)."""
    lines = (REPO / "suites" / f"{suite}.toml").read_text().splitlines()
    return write_suite(suite, "\n".join(f"head_dim = {head_dim}" if ln.startswith("head_dim =") else ln
                                        for ln in lines) + "\n")


# the bundled suites keep the published head_dim (#47 item 4): nothing to widen; a suite that prunes it (as
# they did before) is exported at the published one (vLLM's CPU attention refuses 16)
@pytest.mark.parametrize("suite, pruned_hd, kept", [
    ("llama-3.1-8b", None, "head_dim 128 (the pruned model's is already the published one)"),
    ("qwen3-8b", 16, "head_dim 128 (published; the pruned model's is 16)")])
def test_export_keeps_head_dim_and_reloads_to_the_same_model(tmp_path, write_suite, suite, pruned_hd, kept):
    out = tmp_path / suite
    path = REPO / "suites" / f"{suite}.toml" if pruned_hd is None else _with_head_dim(write_suite, suite, pruned_hd)
    assert main(["export", str(path), str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    ls = load_suite(path)
    assert cfg["head_dim"] == 128 and cfg["hidden_size"] == ls.suite.prune.hidden_size
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 512
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    assert kept in (out / "README.txt").read_text()
    # the same model as harness builds it (seed, realistic numerics' gains applied as a temperature)
    p = ls.suite.checks.precision
    mc, _ = serving_config(ls)
    ref, _ = build_model(ls, "float64", "cpu", seed=p.seed, mc=mc)
    ids = seeded_tokens(512, p.batch_size, p.seq_len, p.seed)
    with torch.no_grad():
        numerics.calibrate(ref.eval(), ids, p.attention_logit_std, p.residual_growth)
        want = ref(ids).logits
    from transformers import AutoModelForCausalLM

    got_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    with torch.no_grad():
        got = got_model(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel  # float32 weights against float64 ones


def test_cached_export_is_reused_and_remade_when_stale(tmp_path):
    ls = load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    d, info, made = cached_export(ls, tmp_path, "bfloat16")
    assert made and info["dtype"] == "bfloat16" and read_info(d) == info
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    assert cached_export(ls, tmp_path, "bfloat16")[2] is False
    text = (d / "README.txt").read_text()
    (d / "README.txt").write_text(text.replace(info["fingerprint"], "0" * 16))
    assert cached_export(ls, tmp_path, "bfloat16")[2] is True


def test_unknown_suite_is_one_line(tmp_path, capsys):
    assert main(["export", "nosuch", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harness: error:") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("config, shrink, kept", [
    # its DSA indexer splits index_head_dim by qk_rope_head_dim: kept at the published 128 beside the MLA widths
    # (init keeps them all; a suite that pruned them, as init did before, is widened back: the pruned 32 - 64
    # failed the export, "split_sizes=[64, -32]")
    ("DeepSeek-V3.2", {}, "index_head_dim 128 (the pruned model's are already the published ones)"),
    ("DeepSeek-V3.2", {"kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                       "index_head_dim": 32}, "index_head_dim 128 (published; the pruned model's 16, 8, 16, 16, 32)"),
    # init keeps the published head sizes (#47 item 4): the export has nothing to widen
    ("gemma-4-26B-A4B", {}, "head sizes vary by layer in this config; the pruned model already has the published ones"),
    ("MiMo-V2-Flash", {}, "head_dim 192 (the pruned model's is already the published one)"),
    # a suite that says otherwise (its head sizes pruned, as init did before): head_dim varies by layer and
    # transformers refuses a global one (the export raised AmbiguousGlobalPerLayerAttributeError); each layer
    # kind's published head size is set back (the pruned 16 was refused by vLLM's CPU attention:
    # "Unsupported CPU attention configuration: head_dim=16")
    ("gemma-4-26B-A4B", {"head_dim": 16, "global_head_dim": 32},
     "per-layer head sizes head_dim 256, global_head_dim 512 (published; pruned 16, 32)"),
    # swa_head_dim published equal to head_dim (192): vLLM builds the sliding layers from it, transformers
    # from head_dim; kept equal with it (left at the pruned 48, the engine built another model)
    ("MiMo-V2-Flash", {"head_dim": 48, "swa_head_dim": 48, "v_head_dim": 32, "swa_v_head_dim": 32},
     "swa_head_dim 192 (published equal to head_dim, kept equal)"),
])
def test_day0_configs_export_and_say_what_they_kept(tmp_path, config, shrink, kept):
    import tomlkit

    from harness.cli.init import init_suite

    path = init_suite(REPO / "tests" / "data" / "day0" / f"{config}.json", name="d0", suites_dir=tmp_path / "s")
    doc = tomlkit.parse(path.read_text())
    for k, v in shrink.items():
        (doc["prune"] if k in doc["prune"] else doc["prune"]["overrides"])[k] = v
    path.write_text(tomlkit.dumps(doc))
    out = tmp_path / "out"
    assert main(["export", str(path), str(out)]) == 0
    assert kept in (out / "README.txt").read_text()
    assert (out / "model.safetensors").is_file()


def test_a_config_whose_head_size_varies_by_layer_exports_each_layers_published_one(tmp_path):
    """Gemma-4: sliding layers 256-wide heads, full layers 512 (``global_head_dim``); the checkpoint reloads
    with those per layer, every other width pruned."""
    from transformers import AutoConfig

    from harness.cli.init import init_suite

    path = init_suite(REPO / "tests" / "data" / "day0" / "gemma-4-26B-A4B.json", name="g4", suites_dir=tmp_path / "s")
    assert main(["export", str(path), str(tmp_path / "out")]) == 0
    cfg = AutoConfig.from_pretrained(tmp_path / "out")
    heads = {cfg.layer_types[i]: cfg.per_layer_config[i].head_dim for i in range(cfg.num_hidden_layers)}
    assert heads == {"sliding_attention": 256, "full_attention": 512}, heads
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 6


def test_the_speculative_draft_is_the_export_perturbed_reproducibly_and_remade_when_its_inputs_change(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from harness.serve.export import cached_draft

    src = tmp_path / "m-float32"
    src.mkdir()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    w = {"model.layers.0.mlp.up_proj.weight": torch.randn(64, 32), "model.norm.weight": torch.ones(32),
         "lm_head.weight": torch.randn(100, 32)}
    save_file(w, src / "model.safetensors")
    d = cached_draft(src, noise=0.05, seed=3)
    assert d == tmp_path / "m-float32-draft" and (d / "config.json").read_text() == (src / "config.json").read_text()
    got = load_file(d / "model.safetensors")
    assert set(got) == set(w)
    assert torch.equal(got["model.norm.weight"], w["model.norm.weight"])  # vectors (norms) kept
    for k in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        rel = (got[k] / w[k] - 1).std().item()
        assert 0.03 < rel < 0.07, (k, rel)  # each entry times 1 + 0.05 N(0, 1)
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert cached_draft(src, noise=0.05, seed=3) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert torch.equal(load_file(cached_draft(src, noise=0.05, seed=4) / "model.safetensors")["lm_head.weight"],
                       got["lm_head.weight"]) is False  # another seed: remade, another draft


def test_mtp_weights_follow_the_deepseek_layout_and_are_remade_when_the_export_changes(tmp_path):
    """The ``mtp`` variant serves ``<export>-mtp``: the export's own tensors unchanged, and for each MTP layer
    (DeepSeek-V3: one, ``num_nextn_predict_layers``) at index num_hidden_layers the tensors vLLM's DeepSeek
    MTP loads - a copy of the model's last decoder layer, enorm/hnorm, eh_proj [H, 2H] whose embedding half is
    the identity, shared_head from the final norm and lm_head, its embed_tokens. A model without MTP layers
    has none to make."""
    from safetensors.torch import load_file

    from harness.serve.export import cached_mtp, mtp_layers

    ls = load_suite(REPO / "suites" / "deepseek-v3.toml")
    d, _, _ = cached_export(ls, tmp_path, "float32")
    assert mtp_layers(json.loads((d / "config.json").read_text())) == 1
    m = cached_mtp(d)
    base, mtp = load_file(d / "model.safetensors"), load_file(m / "mtp.safetensors")
    assert load_file(m / "model.safetensors").keys() == base.keys()
    last = {k[len("model.layers.1."):] for k in base if k.startswith("model.layers.1.")}
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight"}
    assert {k[len("model.layers.2."):] for k in mtp} == last | own
    assert torch.equal(mtp["model.layers.2.self_attn.kv_b_proj.weight"], base["model.layers.1.self_attn.kv_b_proj.weight"])
    assert torch.equal(mtp["model.layers.2.shared_head.head.weight"], base["lm_head.weight"])
    h = base["model.norm.weight"].shape[0]
    assert mtp["model.layers.2.eh_proj.weight"].shape == (h, 2 * h)
    assert torch.equal(mtp["model.layers.2.eh_proj.weight"][:, :h], torch.eye(h))
    made = (m / "mtp.safetensors").stat().st_mtime_ns
    assert cached_mtp(d) == m and (m / "mtp.safetensors").stat().st_mtime_ns == made  # reused
    stamp = (m / "harness-mtp.json").read_text()
    (m / "harness-mtp.json").write_text(stamp.replace('"seed": 0', '"seed": 7'))
    cached_mtp(d)  # a stamp that is not the export's: made again
    assert (m / "harness-mtp.json").read_text() == stamp
    # a sharded export: vLLM loads the files its index names, so the index names the MTP tensors' file too
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(base, "model.safetensors")}))
    idx = json.loads((cached_mtp(d, seed=1) / "model.safetensors.index.json").read_text())["weight_map"]
    assert idx["model.layers.2.eh_proj.weight"] == "mtp.safetensors" and idx["lm_head.weight"] == "model.safetensors"
    llama = load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    assert mtp_layers(json.loads((cached_export(llama, tmp_path, "float32")[0] / "config.json").read_text())) == 0
