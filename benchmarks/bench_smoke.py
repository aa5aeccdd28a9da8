"""Smoke-check overhead: harness against a bare torch script doing the same work, side by side.

For every bundled suite and dtype, in one process (interpreter start and imports excluded), we
time in interleaved rounds:

* bare:    a plain script: config dict -> transformers class -> forward, backward, AdamW steps,
           final loss, second build + forward, greedy generation with and without KV cache;
* check:   harness.checks.run_one(suite, "smoke") - the same work through harness;
* item:    the pytest item, through pytest.main on that one suite file (collection, plugin,
           JUnit properties included).

Reports the median of each and the ratios check/bare and item/bare (goal: at most 1.3x).
Usage: python benchmarks/bench_smoke.py [--rounds 5] [--suite kimi-k2 ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from harness.checks import run_one  # noqa: E402
from harness.suite.loader import discover, load_suite  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def bare(ls, dtype: str) -> None:
    """What the smoke check does, written the way one would without harness."""
    s = ls.suite.checks.smoke
    d = copy.deepcopy(ls.raw_config)
    for k in ("auto_map", "quantization_config"):
        d.pop(k, None)
    prune = ls.suite.prune.model_dump(exclude_none=True, exclude={"overrides", "num_experts"})
    d.update(prune)
    for k in ("num_local_experts", "n_routed_experts", "num_experts"):
        if k in d and ls.suite.prune.num_experts:
            d[k] = ls.suite.prune.num_experts
    for i, k in enumerate(("bos_token_id", "eos_token_id", "pad_token_id")):
        if isinstance(d.get(k), int) and d[k] >= d["vocab_size"]:
            d[k] = d["vocab_size"] - 1 - i
    arch = d["architectures"][0]
    cls = getattr(transformers, arch)
    d.pop("model_type")
    cfg = cls.config_class(**d)
    dt = getattr(torch, dtype)

    def build():
        torch.manual_seed(s.seed)
        return cls(cfg).to(dtype=dt)

    model = build()
    ids = torch.randint(0, cfg.vocab_size, (s.batch_size, s.seq_len), generator=torch.Generator().manual_seed(1))
    model.train()
    out = model(input_ids=ids, labels=ids)
    logits = out.logits.detach().float()
    assert torch.isfinite(logits).all()
    out.loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    opt = torch.optim.AdamW(params, lr=s.lr, eps=max(1e-8, 2 * torch.finfo(dt).tiny))
    opt.step()
    for _ in range(s.steps - 1):
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    model2 = build()
    with torch.no_grad():
        assert torch.equal(model2(input_ids=ids).logits.float(), logits)
    model2.eval()
    model2.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=s.generate_tokens, min_new_tokens=s.generate_tokens, do_sample=False,
              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        a = model2.generate(ids, use_cache=True, **kw).sequences
        b = model2.generate(ids, use_cache=False, **kw).sequences
    assert torch.equal(a, b)


def item(ls, dtype: str) -> None:
    code = pytest.main([str(ls.path), f"--harness-dtype={dtype}", "--harness-backend=cpu",
                        "--harness-check=smoke", "-p", "no:terminal", "-p", "no:cacheprovider"])
    assert code == 0, code


def timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--suite", action="append", default=[])
    ap.add_argument("--dtype", action="append", default=[])
    args = ap.parse_args()
    os.chdir(REPO)
    suites = [load_suite(p) for p in discover("suites") if not args.suite or p.stem in args.suite]
    dtypes = args.dtype or ["float32", "bfloat16"]
    # warm-up: first calls pay lazy imports (transformers model modules, generation) - excluded
    for ls in suites:
        for dt in dtypes:
            bare(ls, dt)
            run_one(ls, "smoke", "cpu", dt)
            item(ls, dt)
    totals = {"bare": 0.0, "check": 0.0, "item": 0.0}
    print(f"{'suite':<16}{'dtype':<10}{'bare s':>9}{'check s':>9}{'item s':>9}{'check/bare':>12}{'item/bare':>11}")
    for ls in suites:
        for dt in dtypes:
            t = {"bare": [], "check": [], "item": []}
            for _ in range(args.rounds):  # interleaved, so drift hits all three alike
                t["bare"].append(timed(bare, ls, dt))
                t["check"].append(timed(lambda: run_one(ls, "smoke", "cpu", dt)))
                t["item"].append(timed(item, ls, dt))
            m = {k: statistics.median(v) for k, v in t.items()}
            for k in totals:
                totals[k] += m[k]
            print(f"{ls.name:<16}{dt:<10}{m['bare']:>9.3f}{m['check']:>9.3f}{m['item']:>9.3f}"
                  f"{m['check'] / m['bare']:>12.2f}{m['item'] / m['bare']:>11.2f}")
    print(f"{'all':<26}{totals['bare']:>9.3f}{totals['check']:>9.3f}{totals['item']:>9.3f}"
          f"{totals['check'] / totals['bare']:>12.2f}{totals['item'] / totals['bare']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
