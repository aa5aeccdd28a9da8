"""A suite's pruned model as a checkpoint a serving engine loads.

The model is the one the checks build (``harness.models.build.build_model``, the precision golden's
seed), with two changes an engine needs and ``README.txt`` beside the files says:

* **the published head_dim is kept.** An engine's attention kernel is chosen by head size (vLLM's CPU
  attention refuses 16 - "Unsupported CPU attention configuration" - and its kernels are specialised
  for 64, 128, ...). The pruned widths (hidden, heads, MLP, vocab, layers) stay, so the model stays
  small, but the attention runs the real model's kernel path: config ``head_dim`` is the published
  one (its ``head_dim``, else hidden_size / num_attention_heads of the real config).
* **realistic numerics are baked into the weights.** The checks rescale seeded weights so attention is
  peaky and the residual stream grows (harness.models.numerics); the attention gain is a temperature
  (``scaling``) an engine does not read, so it is folded into the query projection (or the query norm's
  weight, where a norm follows the projection). Without it attention is near uniform and a positional
  fault (a wrong rotary position) barely moves the output.

Written with ``save_pretrained``: safetensors, config.json, generation_config.json, in the dtype the
engine will run (so engine and reference read the same rounded weights). trust_remote_code stays off.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.files import atomic, paths

README = "README.txt"
VERSION = 5  # of what export writes: a cached export made by another version is remade
# MLA (DeepSeek-V3, Kimi-K2): the widths an engine's MLA kernel dispatches on, kept at the published values
MLA_DIMS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def published_head_dim(cfg) -> int | None:
    """The attention's head size, or None where it varies by layer (Gemma-4's per-layer configs: transformers
    refuses a global ``head_dim`` there)."""
    try:
        hd = getattr(cfg, "head_dim", None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, and kin
        return None
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def serving_config(ls):
    """(ModelConfig of the pruned model with the published head_dim, notes on what was kept)."""
    from harness.models.build import model_config

    mc = model_config(ls)
    pub = model_config(ls, pruned=False).config
    kept = []
    if getattr(mc.config, "kv_lora_rank", None):
        # MLA: the engine's kernel sees the latent (kv_lora_rank + qk_rope_head_dim: vLLM's CPU MLA decode
        # takes 512 + 64 only) and the per-head q/k/v widths; head_dim is the rotary width there (transformers)
        # a DSA indexer (DeepSeek-V3.2, GLM-5) splits its index_head_dim by qk_rope_head_dim: kept with it
        dims = MLA_DIMS + (("index_head_dim",) if getattr(pub, "index_head_dim", None) else ())
        was = {k: getattr(mc.config, k) for k in dims}
        for k in dims:
            setattr(mc.config, k, getattr(pub, k))
        mc.config.qk_head_dim = pub.qk_nope_head_dim + pub.qk_rope_head_dim
        mc.config.head_dim = pub.qk_rope_head_dim
        widths = "MLA widths " + ", ".join(f"{k} {getattr(pub, k)}" for k in dims)
        if all(was[k] == getattr(pub, k) for k in dims):
            kept.append(widths + " (the pruned model's are already the published ones)")
        else:
            kept.append(widths + " (published; the pruned model's " + ", ".join(map(str, was.values())) + "): "
                        "engines choose their MLA kernel by the latent and head widths")
        return mc, kept
    real = published_head_dim(pub)
    pruned = published_head_dim(mc.config)
    if real is None or pruned is None:
        return _per_layer_head_dims(ls, mc)
    if pruned != real:
        mc.config.head_dim = real
        kept.append(f"head_dim {real} (published; the pruned model's is {pruned}): engines choose their "
                    f"attention kernel by head size")
        kept.extend(_tie_head_dims(pub, mc.config, real))
    else:
        kept.append(f"head_dim {real} (the pruned model's is already the published one)")
    return mc, kept


def _per_layer_head_dims(ls, mc):
    """A config whose head size varies by layer (Gemma-4: ``head_dim`` 256 on sliding layers,
    ``global_head_dim`` 512 on full ones; transformers derives ``per_layer_config`` from them and
    refuses a global ``head_dim``): every head size the suite prunes set back to the published one and
    the config rebuilt, so each layer's attention runs the kernel the release's does (vLLM's CPU
    attention refused the pruned 16; it takes 256 and 512). Widths, heads and layers stay pruned."""
    from harness.models.config import build_config, text_config_dict

    prune, m = ls.suite.prune, ls.suite.model
    fields = type(prune).model_fields
    published = text_config_dict(ls.raw_config, m.architecture)
    pruned = {k: getattr(prune, k) if k in fields else prune.overrides[k] for k in [*fields, *prune.overrides]
              if k.endswith("head_dim") and k not in MLA_DIMS and isinstance(published.get(k), int)}
    changed = {k: published[k] for k, v in pruned.items() if v not in (None, published[k])}
    if not changed:
        return mc, ["head sizes vary by layer in this config; the pruned model already has the published ones"]
    kept = prune.model_copy(update={**{k: v for k, v in changed.items() if k in fields},
                                    "overrides": {**prune.overrides, **{k: v for k, v in changed.items() if k not in fields}}})
    mc = build_config(ls.raw_config, kept, architecture=m.architecture, trust_remote_code=m.trust_remote_code)
    return mc, [f"per-layer head sizes {', '.join(f'{k} {v}' for k, v in changed.items())} (published; pruned "
                + ", ".join(str(pruned[k]) for k in changed) + "): engines choose each layer's attention kernel by "
                "its head size"]


def _tie_head_dims(pub, cfg, real: int) -> list[str]:
    """Another attention flavour's head size the release publishes equal to ``head_dim`` (MiMo-V2-Flash's
    ``swa_head_dim`` 192) set to the published one with it. transformers builds every layer from
    ``head_dim`` there, vLLM its sliding layers from ``swa_head_dim``: left pruned (48 against 192), the
    engine built another model than the reference."""
    out = []
    for k, v in pub.to_dict().items():
        if k != "head_dim" and k.endswith("_head_dim") and k not in MLA_DIMS and v == real \
                and k[: -len("head_dim")] + "num_attention_heads" in pub.to_dict():
            setattr(cfg, k, real)
            out.append(f"{k} {real} (published equal to head_dim, kept equal)")
    return out


def fingerprint(ls, dtype: str) -> str:
    """What an export depends on: a cached one with another fingerprint is remade."""
    p = ls.suite.checks.precision
    text = json.dumps({"v": VERSION, "config": ls.raw_config, "prune": ls.suite.prune.model_dump(mode="json"),
                       "seed": p.seed, "numerics": p.numerics, "std": p.attention_logit_std,
                       "growth": p.residual_growth, "dtype": dtype}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _bake_attention_gain(model, gains: dict) -> None:
    """Fold each layer's attention temperature gain into its weights: attention logits are q.k x
    scaling, and q is linear in q_proj's weight (RoPE rotates it, linearly) - or in the q norm's
    weight where one follows q_proj (Qwen3), or MLA's q_b_proj - so scaling those by g scales the logits by g exactly."""
    import torch

    from harness.anatomy.layers import attention, indexed_layers

    for idx, _name, layer in indexed_layers(model):
        a = attention(layer)
        g = gains.get(str(idx))
        if a is None or g is None:
            continue
        # the last linear map of q: the q norm (Qwen3), q_proj, or MLA's q_b_proj (q_lora_rank set)
        target = next(m for m in (getattr(a, n, None) for n in ("q_norm", "q_proj", "q_b_proj")) if m is not None)
        with torch.no_grad():
            target.weight.mul_(g)
            if getattr(target, "bias", None) is not None and target is a.q_proj:
                target.bias.mul_(g)
        a.scaling = float(a.scaling) / g  # the module as it was (the gain is in the weights now)


def export(ls, out: str | Path, dtype: str = "float32") -> dict:
    """Write the suite's serving checkpoint into ``out``; returns the info README.txt records."""
    import torch

    from harness.models import numerics
    from harness.models.build import build_model, cast_model, seeded_tokens, torch_dtype

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = ls.suite.checks.precision
    mc, kept = serving_config(ls)
    # float64 to calibrate, as the golden does; then the dtype the engine serves
    model, mc = build_model(ls, "float64", "cpu", seed=p.seed, mc=mc)
    model.eval()
    gains = {}
    if p.numerics == "realistic" and ls.weights_path is None:
        ids = seeded_tokens(mc.config.vocab_size, p.batch_size, p.seq_len, p.seed)
        with torch.no_grad():
            num = numerics.calibrate(model, ids, p.attention_logit_std, p.residual_growth)
        gains = num["attention_gain"]
        _bake_attention_gain(model, gains)
        kept.append(f"realistic numerics baked in: attention gains {gains} folded into the query weights, "
                    f"residual gains {num['residual_gain']} in the output projections")
    model = cast_model(model, torch_dtype(dtype))
    model.config.dtype = torch_dtype(dtype)
    model.save_pretrained(out, safe_serialization=True)
    info = {"suite": ls.name, "architecture": mc.architecture, "dtype": dtype, "seed": p.seed,
            "fingerprint": fingerprint(ls, dtype), "kept": kept,
            "vocab_size": int(mc.config.vocab_size), "head_dim": published_head_dim(mc.config)}  # None: it varies by layer
    atomic.write_text(out / README,
        f"harness export {ls.name} ({dtype}): the suite's pruned model, seeded weights (seed {p.seed}, as the\n"
        "precision golden), written with save_pretrained for a serving engine (docs/serving.md).\n"
        "Where it differs from the checks' pruned model, and why (engine kernels dispatch on the head size;\n"
        "an engine does not read harness's attention temperature):\n"
        + "".join(f"  - {k}\n" for k in kept)
        + "Every other width is the pruned one. trust_remote_code is off.\n"
        + "harness-export: " + json.dumps(info, sort_keys=True) + "\n")
    return info


def read_info(out: str | Path) -> dict | None:
    """The info line of an export's README.txt (None: no export there, or an unreadable one)."""
    try:
        for line in (Path(out) / README).read_text().splitlines():
            if line.startswith("harness-export: "):
                return json.loads(line.split(": ", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def cached_export(ls, root: str | Path, dtype: str) -> tuple[Path, dict, bool]:
    """The suite's export for ``dtype`` under ``root`` (made when absent or stale): (dir, info, made)."""
    d = Path(root) / f"{ls.name}-{dtype}"
    info = read_info(d)
    if info is not None and info.get("fingerprint") == fingerprint(ls, dtype) and any(d.glob("*.safetensors")):
        return d, info, False
    if d.exists():
        import shutil

        shutil.rmtree(d)
    return d, export(ls, d, dtype), True


# the draft's weights: each times (1 + DRAFT_NOISE * N(0, 1)), seeded. llama-3.1-8b float32, one 16-token
# prompt, 12 steps: 0.03 -> 8 of 9 drafts accepted, 0.06 -> 7 of 12, 0.2 -> 2 of 27; 0.05 on the check's
# two prompts: 10 of 18 (docs/serving.md, "Speculative decoding")
DRAFT_NOISE = 0.05


def cached_draft(model_dir: str | Path, noise: float = DRAFT_NOISE, seed: int = 0) -> Path:
    """A draft model for the engine's speculative decoding beside the export ``model_dir``: the same
    config, every weight matrix perturbed (times 1 + ``noise`` * N(0, 1), seeded) so that the draft
    agrees with the model on some tokens and not on others - both the accepted drafts and the rejected
    ones (whose KV pages the engine must roll back) are taken. Remade when the export is newer."""
    import torch

    src, out = Path(model_dir), Path(f"{model_dir}-draft")
    want = {"noise": noise, "seed": seed, "source": read_info(src)}
    if _up_to_date(out, out / "harness-draft.json", want):
        return out
    g = torch.Generator().manual_seed(seed)

    def perturb(tensors: dict) -> dict:
        for name, t in sorted(tensors.items()):
            if t.is_floating_point() and t.dim() >= 2:
                e = torch.randn(t.shape, generator=g, dtype=torch.float32)
                tensors[name] = (t.float() * (1 + noise * e)).to(t.dtype)
        return tensors

    _copy_export(src, out, perturb, texts=(".json",))
    atomic.write_text(out / "harness-draft.json", json.dumps(want, sort_keys=True))
    return out


def _up_to_date(out: Path, stamp: Path, want: dict) -> bool:
    """Whether ``out`` was made from the same inputs (its stamp file ``stamp`` says ``want``); where not, it is
    emptied and made anew by the caller."""
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return True
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    return False


def _copy_export(src: Path, out: Path, transform=None, texts: tuple[str, ...] = (".json", ".txt")) -> dict:
    """The export's files into ``out``, one name each: its safetensors through ``transform`` (tensors ->
    tensors; None: as they are), its text files of the suffixes ``texts`` as they are. Returns every tensor
    written, by name."""
    from safetensors.torch import load_file, save_file

    written: dict = {}
    for f in sorted(src.iterdir()):
        dst = paths.join(out, f.name, source=str(src), field="export file")  # the export's own files, one name each
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            tensors = transform(tensors) if transform else tensors
            written.update(tensors)
            save_file(tensors, dst, metadata={"format": "pt"})
        elif f.suffix in texts:
            atomic.write_text(dst, f.read_text())
    return written


# The model's own multi-token-prediction (MTP) layers in the DeepSeek-V3 layout (``num_nextn_predict_layers``:
# DeepSeek-V3/V3.2, GLM-4.5 and GLM-5; Kimi-K2's published config says 0): layer ``num_hidden_layers + i`` holds
# enorm, hnorm, eh_proj [H, 2H] (the next token's embedding and the last hidden state, normed and joined),
# a decoder layer of the model's own kind, and shared_head (norm, head) plus its embed_tokens.
MTP_KEYS = ("num_nextn_predict_layers",)
MTP_MIX = 0.1


def mtp_layers(config: dict) -> int:
    """How many MTP layers the (exported) config declares in the DeepSeek layout; 0: none."""
    return max((int(config.get(k) or 0) for k in MTP_KEYS), default=0)


def cached_mtp(model_dir: str | Path, seed: int = 0) -> Path:
    """The export beside itself with its MTP layers' weights (``<export>-mtp``), for the engine's MTP
    speculative decoding. transformers builds no MTP module, so harness makes them from the export's own
    weights: the decoder layer a copy of the model's last one, shared_head the model's final norm and
    lm_head, embed_tokens the model's, enorm and hnorm ones, and eh_proj the identity on the next token's
    embedding plus ``MTP_MIX`` of the hidden state (seeded). Every draft is verified by the model's own
    forward, so the served tokens stay the model's, judged against float64 as the plain item's (on the
    exported models' flat distributions the drafts are rejected: docs/serving.md). The reference is the
    export itself (without these weights). Remade when the export is newer. A sharded export's index
    gets the MTP tensors too (an engine loads only the files its index names)."""
    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(f"{model_dir}-mtp")
    want = {"seed": seed, "source": read_info(src)}
    if _up_to_date(out, out / "harness-mtp.json", want):
        return out
    cfg = json.loads((src / "config.json").read_text())
    weights = _copy_export(src, out)
    mtp = _mtp_tensors(weights, cfg, seed, src)
    save_file(mtp, out / "mtp.safetensors", metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx.setdefault("weight_map", {}).update(dict.fromkeys(mtp, "mtp.safetensors"))
        atomic.write_text(index, json.dumps(idx, indent=2, sort_keys=True))
    atomic.write_text(out / "harness-mtp.json", json.dumps(want, sort_keys=True))
    return out


def no_mtp(variant: dict, config: dict) -> str | None:
    """Why an item of engine ``variant`` (harness.serve.engine.VARIANTS) cannot run on a model of ``config``:
    MTP decoding on a model without MTP layers in the DeepSeek layout. None: it can."""
    if (variant.get("speculative") or {}).get("method") == "mtp" and not mtp_layers(config):
        return (f"the model has no multi-token-prediction layers to draft with ({', '.join(MTP_KEYS)} 0 or absent "
                "in its config)")
    return None


def drafter(request: dict, model_dir: Path) -> dict:
    """What a speculative request serves: the MTP method the export with its MTP weights (``cached_mtp``,
    the model's own layers draft), the draft-model method the export as the model and its perturbed copy as
    the draft (``cached_draft``)."""
    spec = request["speculative"]
    if spec["method"] == "mtp":
        return {"model": str(cached_mtp(model_dir).resolve())}
    return {"speculative": dict(spec, model=str(cached_draft(model_dir).resolve()))}


def _mtp_tensors(weights: dict, cfg: dict, seed: int, src: Path) -> dict:
    """The MTP layers' tensors (``cached_mtp``) made from the export's ``weights``, by checkpoint name."""
    import torch

    n_mtp, n_layers = mtp_layers(cfg), int(cfg["num_hidden_layers"])
    need = ("model.norm.weight", "model.embed_tokens.weight")
    if missing := [k for k in need if k not in weights]:
        raise ValueError(f"export {src} has no {', '.join(missing)}: harness makes MTP weights in the DeepSeek "
                         "layout only")
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n_layers - 1}."
    h = int(cfg["hidden_size"])
    mtp = {}
    for i in range(n_mtp):
        p = f"model.layers.{n_layers + i}."
        dt = weights["model.norm.weight"].dtype
        mtp.update({name.replace(last, p, 1): t.clone() for name, t in weights.items() if name.startswith(last)})
        mtp[p + "enorm.weight"] = torch.ones(h, dtype=dt)
        mtp[p + "hnorm.weight"] = torch.ones(h, dtype=dt)
        # [embedding | hidden] -> H: the next token's embedding (the identity) and a little of the last hidden
        # state (seeded): the head then runs that token through a copy of the model's last layer and its head,
        # roughly what the model itself will predict after it, the token after next
        eh = torch.cat([torch.eye(h), torch.randn(h, h, generator=g) * (MTP_MIX / h ** 0.5)], dim=1)
        mtp[p + "eh_proj.weight"] = eh.to(dt)
        mtp[p + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
        mtp[p + "shared_head.head.weight"] = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).clone()
        mtp[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    return mtp
