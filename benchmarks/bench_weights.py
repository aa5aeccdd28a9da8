"""Pruned real-weight load vs a full ``from_pretrained``, on a synthetic checkpoint of >= 2 GB.

Writes a Llama-shaped bf16 checkpoint (24 layers, width 2048, ~2.4 GB) in many shards with an index
under a temporary directory (deleted at the end), then, in one run:

* pruned:  ``build_model`` of a suite keeping 2 of its layers (plus embeddings, final norm, lm_head),
           loading through harness.weights (safe_open, one tensor at a time), parameters never
           initialised (built on meta, materialized empty, filled);
* former:  the same pruned build as it was before: seeded random init of every parameter, then the
           load overwriting it (page cache warm for both: this isolates the init);
* full:    ``AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16)`` of the same checkpoint.

Reported: bytes kept (the pruned model's tensors, at checkpoint dtype), bytes the reader copied out
of the shards (counted by the reader), bytes the kernel read from storage (``/proc/self/io``
``read_bytes``: the page cache is emptied for the shards with ``posix_fadvise(DONTNEED)`` before each
load, so this counts real reads, mmap read-around included), their ratio to the bytes kept, and the
wall time of each load with their ratio.

Usage: python benchmarks/bench_weights.py [--layers 24] [--hidden 2048] [--shard-mb 100] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def evict(root: Path) -> None:
    """Drop the shards' pages from the page cache (clean pages: fsync first), so the next load reads disk."""
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes() -> int:
    from harness.weights.reader import file_read_bytes

    return file_read_bytes() or 0


def write_checkpoint(root: Path, layers: int, hidden: int, shard_mb: int) -> dict:
    from safetensors.torch import save_file

    raw = json.loads((REPO / "suites/configs/Llama-3.1-8B.json").read_text())
    raw.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
               num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, bos_token_id=0, eos_token_id=1,
               torch_dtype="bfloat16", tie_word_embeddings=False)
    h, i, kv = hidden, raw["intermediate_size"], hidden // 16 * 4
    shapes = {"model.embed_tokens.weight": (32000, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (32000, h)}
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shards: list[dict] = [{}]
    size = 0
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) if len(shape) == 2 else torch.ones(shape, dtype=torch.bfloat16)
        nb = t.numel() * 2
        if size and size + nb > shard_mb << 20:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    weight_map, total = {}, 0
    for k, sd in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, str(root / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(sd, fname)
        total += sum(t.numel() * 2 for t in sd.values())
        sd.clear()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(raw))
    return {"shards": len(shards), "bytes": sum(p.stat().st_size for p in root.glob("*.safetensors"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--dir", default=None, help="parent of the temporary checkpoint (default: /tmp)")
    args = ap.parse_args()

    from harness.suite.loader import load_suite

    tmp = Path(tempfile.mkdtemp(prefix="bench-weights-", dir=args.dir))
    try:
        ckpt = tmp / "ckpt"
        t = time.perf_counter()
        info = write_checkpoint(ckpt, args.layers, args.hidden, args.shard_mb)
        print(f"checkpoint: {info['bytes'] / 2**30:.2f} GiB in {info['shards']} shards, {args.layers} layers "
              f"(written in {time.perf_counter() - t:.1f} s)")
        suite = tmp / "bench.toml"
        suite.write_text('[model]\nconfig = "ckpt/config.json"\nweights = "ckpt"\n[prune]\nnum_hidden_layers = 2\n')
        ls = load_suite(suite)
        pruned = time_pruned_build(ckpt, ls)
        warm = time_warm_builds(ls)
        full = time_full_load(ckpt)
        report(args.layers, info, pruned, warm, full)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def time_pruned_build(ckpt: Path, ls) -> dict:
    """The pruned build from a cold page cache: its time, the bytes it kept, copied and read."""
    from harness.models.build import build_model, instantiate, model_config

    # Import transformers' modeling code for this architecture before timing (a meta build reads no
    # weights), so the first timed build is not charged the one-time imports from_pretrained is not.
    with torch.device("meta"):
        instantiate(ls, model_config(ls), torch.float32)

    evict(ckpt)
    r0 = read_bytes()
    t = time.perf_counter()
    model, mc = build_model(ls, "bfloat16")
    t_pruned = time.perf_counter() - t
    r_pruned = read_bytes() - r0
    kept = sum(v.numel() * 2 for v in model.state_dict().values())  # bf16 checkpoint
    note = next(n for n in mc.notes if n.startswith("real weights"))
    counted = float(note.split("read ")[1].split(" MiB")[0]) * 2**20
    return {"t": t_pruned, "read": r_pruned, "kept": kept, "note": note, "counted": counted}


def time_warm_builds(ls) -> tuple[float, float]:
    """The former pruned build (random init, then the load), against the current one, both with the
    shards in the page cache: the difference is the random init alone."""
    from harness.models.build import build_model, cast_model, instantiate, model_config
    from harness.weights.load import load_pruned

    t = time.perf_counter()
    model, _ = build_model(ls, "bfloat16")
    t_new_warm = time.perf_counter() - t
    del model
    t = time.perf_counter()
    mc_old = model_config(ls)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = instantiate(ls, mc_old, torch.float32)
    load_pruned(model, ls, mc_old, dtype=torch.bfloat16)
    model = cast_model(model, torch.bfloat16)
    t_old_warm = time.perf_counter() - t
    del model
    return t_new_warm, t_old_warm


def time_full_load(ckpt: Path) -> dict:
    """The full from_pretrained from a cold page cache: at its return, and once every weight is in memory."""
    from transformers import AutoModelForCausalLM

    evict(ckpt)
    r0 = read_bytes()
    t = time.perf_counter()
    full = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    t_full = time.perf_counter() - t
    r_full = read_bytes() - r0
    # from_pretrained may leave parameters backed by the shards' memory maps (same dtype: no copy),
    # so it returns before all bytes are read; touching every parameter once makes the figure the
    # time to a model whose weights are all in memory, as the pruned one's are.
    with torch.no_grad():
        for prm in full.parameters():
            prm.view(torch.int16).sum()
    t_full_touched = time.perf_counter() - t
    r_full_touched = read_bytes() - r0
    del full
    return {"t": t_full, "read": r_full, "t_touched": t_full_touched, "read_touched": r_full_touched}


def report(layers: int, info: dict, pruned: dict, warm: tuple[float, float], full: dict) -> None:
    kept, counted, r_pruned, note = pruned["kept"], pruned["counted"], pruned["read"], pruned["note"]
    t_full, t_full_touched = full["t"], full["t_touched"]
    print(f"pruned (2 of {layers} layers): kept {kept / 2**20:.1f} MiB; reader copied {counted / 2**20:.1f} MiB "
          f"({counted / kept:.3f} x kept); storage read_bytes {r_pruned / 2**20:.1f} MiB ({r_pruned / kept:.3f} x kept)")
    print(f"  {note}")
    fill = float(note.rsplit(" in ", 1)[1].split(" s")[0])
    print(f"full from_pretrained: storage read_bytes {full['read'] / 2**20:.1f} MiB at return "
          f"({full['read'] / info['bytes']:.3f} x checkpoint), {full['read_touched'] / 2**20:.1f} MiB once every "
          f"parameter is touched ({full['read_touched'] / info['bytes']:.3f} x)")
    print(f"time: full from_pretrained {t_full:.2f} s at return, {t_full_touched:.2f} s all weights in memory")
    print(f"      pruned load (open + plan + read/copy) {fill:.2f} s: ratio {fill / t_full_touched:.3f} of the full "
          f"load in memory ({fill / t_full:.3f} of from_pretrained's return)")
    print(f"      pruned build_model {pruned['t']:.2f} s ({kept // 2 / 1e6:.0f} M parameters, none initialised "
          f"before the load): ratio {pruned['t'] / t_full_touched:.3f} of the full load in memory")
    print(f"      page cache warm: pruned build_model {warm[0]:.2f} s, the former build (seeded random init, "
          f"then the load) {warm[1]:.2f} s: ratio new / former {warm[0] / warm[1]:.3f}")


if __name__ == "__main__":
    sys.exit(main())
