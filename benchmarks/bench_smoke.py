"""Smoke-check overhead: harness against a bare torch script doing the same work, side by side.

For every bundled suite and dtype, in one process (interpreter start and imports excluded), we
time in interleaved rounds:

* bare:    a plain script: config dict -> transformers class -> forward, backward, AdamW steps,
           final loss, second build + forward, greedy generation with and without KV cache;
* check:   harness.checks.run_one(suite, "smoke") - the same work through harness;
* session: every smoke item of all suites in one in-process pytest session, as `harness run` runs
           them (collection, plugin, reports included), against the sum of the bare runs; once
           with the isolated worker (a new interpreter per session: its imports are most of the
           figure) and once with ``--harness-isolate=off``.

Reports medians and the ratios check/bare per suite and session/bare overall (goal: at most 1.3x).
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


def session(paths: list[Path], dtypes: list[str], isolate: str = "on") -> None:
    """Every smoke item of these suites in one pytest session, as `harness run` runs them (isolated:
    each session starts its worker, a new interpreter that imports torch and transformers again)."""
    code = pytest.main([str(p) for p in paths] + [f"--harness-dtype={d}" for d in dtypes] + [
        "--harness-backend=cpu", "--harness-check=smoke", "-p", "no:terminal", "-p", "no:cacheprovider",
        f"--harness-isolate={isolate}"])
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
    session([ls.path for ls in suites], dtypes)

    per: dict[tuple, dict[str, list[float]]] = {(ls.name, dt): {"bare": [], "check": []}
                                               for ls in suites for dt in dtypes}
    rounds = {"bare": [], "session": [], "in-process": []}
    for _ in range(args.rounds):  # interleaved, so drift hits both sides alike
        total = 0.0
        for ls in suites:
            for dt in dtypes:
                b = timed(bare, ls, dt)
                total += b
                per[(ls.name, dt)]["bare"].append(b)
                per[(ls.name, dt)]["check"].append(timed(lambda ls=ls, dt=dt: run_one(ls, "smoke", "cpu", dt)))
        rounds["bare"].append(total)
        rounds["session"].append(timed(session, [ls.path for ls in suites], dtypes))
        rounds["in-process"].append(timed(session, [ls.path for ls in suites], dtypes, "off"))

    print(f"{'suite':<16}{'dtype':<10}{'bare s':>9}{'check s':>9}{'check/bare':>12}")
    tb = tc = 0.0
    for (name, dt), t in per.items():
        b, c = statistics.median(t["bare"]), statistics.median(t["check"])
        tb, tc = tb + b, tc + c
        print(f"{name:<16}{dt:<10}{b:>9.3f}{c:>9.3f}{c / b:>12.2f}")
    print(f"{'sum of medians':<26}{tb:>9.3f}{tc:>9.3f}{tc / tb:>12.2f}")
    b, s_ = statistics.median(rounds["bare"]), statistics.median(rounds["session"])
    print(f"\nall smoke items in one pytest session: {s_:.3f} s vs bare {b:.3f} s -> ratio {s_ / b:.2f} "
          f"(median of {args.rounds} rounds; goal <= 1.3)")
    p_ = statistics.median(rounds["in-process"])
    print(f"the same with --harness-isolate=off (no worker to start): {p_:.3f} s -> ratio {p_ / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
