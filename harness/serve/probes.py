"""The engine's own features as probes, each judged against the float64 reference (issue #46 item 3).

A serving engine does not run one prompt at a time through one code path: it batches requests, serves
prompt prefixes from cached KV pages, splits long prefills into chunks and preempts requests when KV
memory runs out, recomputing them later. Each feature is a path of its own through the engine's
kernels and bookkeeping, and a Day-0 break can live in one of them only (sglang #25733: NaN only at
batch-1 decode). A probe serves seeded requests so that one feature is exercised and holds every
judged request to the float64 reference of its own tokens, position by position, as the plain run is:
never one engine run against another, so a fault both runs share cannot hide.

All probes run in the engine instance of the plain run (vllm_runner.py ``probe``: one start-up, most of
a minute, for all of them); each costs one or two generate calls. Each probe also reports what the
engine did, and a probe that did not exercise its feature (no cache hit, one prefill chunk, no
preemption) is a failure of its own: a green probe must mean the feature ran.

This module builds the probes' requests (plain data for the runner), and judges their results
(harness.serve.judge on each judged request). It does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.serve.judge import Row, Verdict, judge

# name -> what it serves (docs/serving.md, "Probes")
PROBES = {
    "batch": "the prompts in one batch with seeded requests of other lengths and lengths of decode",
    "prefix": "a request whose first KV page is a prefix-cache hit, after the request that filled it",
    "chunked": "a prompt prefilled in chunks (the scheduler's token budget per step), across a KV page boundary",
    "preempt": "two requests competing for one KV page beyond their prefills: one is preempted, then recomputed",
}
# The preemption probe's KV budget: two requests of block_size - 4 prompt tokens each need one more page
# after 5 decode steps; one page free beyond their prefills (the runner counts them in the engine's own
# pages: 3 of 32 tokens, 5 of 16 where vLLM's CPU MLA forces 16) holds one more page, so one request is
# preempted, and each alone fits: it finishes after the other. Fixed: the shape depends on it.
# the prefix probe's shared part may grow to this many pages (the engine's hit unit: fit_prefix)
PREFIX_ROOM = 4
PREEMPT_KV_BLOCKS_AFTER_PREFILL = 1


def _req(ids, steps: int, label: str, judged: bool = True, read_prefix_cache: bool = False) -> dict:
    return {"ids": [int(t) for t in ids], "steps": int(steps), "label": label, "judge": judged,
            "read_prefix_cache": read_prefix_cache}


def build(names, prompts: list[list[int]], tokens, steps: int, block_size: int, fillers: int,
          chunk_tokens: int) -> list[dict]:
    """The runner's probe requests. ``tokens(n, length, i)``: n seeded prompts of ``length`` tokens, the
    i-th seeded set (each probe's own, none equal to the check's prompts)."""
    n = len(prompts[0])
    half = max(2, n // 2)
    out = []
    for name in names:
        if name == "batch":
            # other lengths (prefill rows of other sizes in one forward) and other decode lengths (the
            # batch shrinks while the prompts decode); the prompts in between, not first
            lengths = [half, 2 * n, n + 3, 3]
            fill = [_req(tokens(1, lengths[j % 4], 10 + j)[0], max(1, steps - 3 + 2 * j), f"filler {j}", False)
                    for j in range(fillers)]
            group = []
            for j in range(max(len(fill), len(prompts))):
                group += fill[j:j + 1] + ([_req(prompts[j], steps, f"prompt {j}")] if j < len(prompts) else [])
            out.append({"name": name, "groups": [group]})
        elif name == "prefix":
            # one full page shared (only full pages are cached); the hit recomputes its own tail only. The
            # engine grows the shared part to its hit unit where that is longer (pages of two sizes: the
            # runner's fit_prefix), up to PREFIX_ROOM pages: the engine's length limit leaves room for it
            shared, (a, b) = tokens(1, block_size, 20)[0], tokens(2, half, 21)
            out.append({"name": name, "groups": [[_req(shared + a, steps, "miss")],
                                                  [_req(shared + b, steps, "hit", read_prefix_cache=True)]],
                        "shared": block_size, "grow_to": PREFIX_ROOM * block_size})
        elif name == "chunked":
            ids = tokens(1, block_size + half, 30)[0]
            out.append({"name": name, "groups": [[_req(ids, steps, "chunked")]],
                        "max_num_scheduled_tokens": chunk_tokens})
        elif name == "preempt":
            two = tokens(2, block_size - 4, 40)
            out.append({"name": name, "groups": [[_req(p, max(steps, 8), f"request {i}") for i, p in enumerate(two)]],
                        "free_kv_blocks_after_prefill": PREEMPT_KV_BLOCKS_AFTER_PREFILL})
        else:
            raise ValueError(f"unknown probe {name!r} (known: {', '.join(PROBES)})")
    return out


def requests(probes: list[dict]) -> list[dict]:
    return [r for p in probes for g in p["groups"] for r in g]


def max_len(probes: list[dict]) -> int:
    """The longest sequence a probe may send (a prefix probe's shared part grown to its room)."""
    return max((len(r["ids"]) + r["steps"] + p.get("grow_to", 0) - p.get("shared", 0)
                for p in probes for g in p["groups"] for r in g), default=0)


def max_seqs(probes: list[dict]) -> int:
    return max((len(g) for p in probes for g in p["groups"]), default=1)


def judged(probe: dict, result: dict) -> list[tuple[dict, dict]]:
    """(request, its result) of every judged request of a probe, in order."""
    served = result.get("served") or [[r["ids"] for r in g] for g in probe["groups"]]  # what the engine was sent
    pairs = [(dict(r, ids=ids), res) for g, gres, gids in zip(probe["groups"], result["groups"], served, strict=True)
             for r, res, ids in zip(g, gres, gids, strict=True)]
    return [(r, res) for r, res in pairs if r["judge"]]


def sequences(probes: list[dict], results: dict[str, dict]) -> list[list[int]]:
    """Every judged request's prompt followed by the engine's continuation (what the reference reads)."""
    return [r["ids"] + res["tokens"] for p in probes if not results[p["name"]].get("skipped")
            for r, res in judged(p, results[p["name"]])]


@dataclass
class Outcome:
    name: str
    seconds: float
    did: str  # what the engine did, in a phrase (the proof that the feature ran)
    problem: str | None = None  # the feature did not run: the probe probed nothing
    verdict: Verdict = field(default_factory=Verdict)

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.verdict.bad

    @property
    def worst(self) -> float:
        return max(self.verdict.worst("prompt"), self.verdict.worst("step"))

    def budget_use(self) -> float:
        return max((r.use for r in self.verdict.rows), default=0.0)


def _exercised(probe: dict, result: dict) -> tuple[str, str | None]:
    """What the engine did in the probe, and why that is not the feature (None: it is)."""
    name, sched = probe["name"], result.get("scheduled_tokens") or []
    if name == "batch":
        g = probe["groups"][0]
        held = result.get("scheduled_requests")
        if held is not None:  # the steps' own count of requests (the server's clients arrive when they do)
            did = f"{len(g)} requests, up to {max(held, default=0)} in one step ({max(sched, default=0)} tokens)"
            return did, None if max(held, default=0) > 1 else "no step held more than one request"
        most = max(len(r["ids"]) for r in g)
        did = f"{len(g)} requests, up to {max(sched, default=0)} tokens in one step"
        return did, None if max(sched, default=0) > most else "no step held more than one request's prompt"
    if name == "prefix":
        hit, unit = result["groups"][1][0]["num_cached_tokens"], result.get("prefix_unit")
        ids = (result.get("served") or [[r["ids"] for r in g] for g in probe["groups"]])[1][0]
        grown = f"; shared part grown to the engine's hit unit, {unit} tokens" if result.get("served") else ""
        did = f"hit: {hit} of {len(ids)} prompt tokens from the prefix cache{grown}"
        if hit > 0:
            return did, None
        if unit and unit > probe.get("grow_to", probe.get("shared", 0)):
            return did, (f"the engine caches prefixes in units of {unit} tokens here (KV pages of several sizes), "
                         f"more than the probe's room of {probe.get('grow_to')}")
        return did, "the engine served the hit request from 0 cached tokens"
    if name == "chunked":
        chunks = sum(1 for t in sched if t > 1)  # one request: every step of more than one token is prefill
        did = f"prefill in {chunks} chunk(s) of <= {probe['max_num_scheduled_tokens']} tokens"
        return did, None if chunks > 1 else "the prompt was prefilled in one step"
    n = result.get("preemptions", 0)
    return f"{n} preemption(s)", None if n > 0 else "no request was preempted"


def judge_probe(probe: dict, result: dict, ref: dict, budget: float, tie_margin: float, k: int | None = None) -> Outcome:
    """One probe's outcome. ``ref``: tuple(sequence) -> float64 log-probabilities (sequences()); ``k``: the
    engine's top k (``judge``)."""
    did, problem = _exercised(probe, result)
    pairs = judged(probe, result)
    seqs = [tuple(r["ids"] + res["tokens"]) for r, res in pairs]
    v = judge([r["ids"] for r, _ in pairs], [res for _, res in pairs], [ref[q] for q in seqs], budget, tie_margin,
              names=[r["label"] for r, _ in pairs],
              # the cached positions come back as placeholders: judge what the engine computed
              starts=[res.get("num_cached_tokens", 0) if r["read_prefix_cache"] else 0 for r, res in pairs], k=k)
    return Outcome(probe["name"], float(result.get("seconds", 0.0)), did, problem, v)


def first_failure(outcomes: list[Outcome]) -> tuple[Outcome, Row | None] | None:
    """The first failing probe, and its earliest bad row (None: it did not exercise its feature)."""
    for o in outcomes:
        if o.problem is not None:
            return o, None
        if o.verdict.bad:
            return o, o.verdict.bad[0]
    return None


def record_probe(ctx, name: str, o, budget: float) -> None:
    """A judged probe's metrics, detail and near-tie notes (the serve check's probe steps)."""
    ctx.metric(f"serve_{name}_logprob_max_abs_diff", o.worst)
    ctx.tolerance(f"serve_{name}_logprob_max_abs_diff", budget)
    ctx.metric(f"serve_{name}_budget_use", o.budget_use())
    ctx.metric(f"serve_{name}_s", o.seconds)
    ctx.detail(f"serve_probe_{name}", o.did)
    ctx.notes.extend(f"probe {name}: near tie at {r.name} step {r.index} ({r.margin:.2g} nats apart)"
                     for r in o.verdict.ties)


def speculated(result: dict) -> tuple[str, str | None] | None:
    """What the engine's speculative decoding did in the plain run (the ``speculative`` variant), and
    why that is not speculation (None: drafts were proposed and verified); None: not speculating."""
    s = result.get("speculative")
    if s is None:
        return None
    did = (f"{s['method']}, {s['drafted']} draft token(s) verified in {s['verify_steps']} step(s), "
           f"{s['accepted']} accepted")
    return did, None if s["drafted"] > 0 else "the engine proposed no draft token"


def record_speculative(ctx, result: dict) -> tuple[str, str | None] | None:
    """The speculative variant's figures (nothing without speculation); what speculated() says."""
    out = speculated(result)
    if out is not None:
        ctx.metric("serve_spec_drafted", result["speculative"]["drafted"])
        ctx.metric("serve_spec_accepted", result["speculative"]["accepted"])
        ctx.detail("serve_speculative", out[0])
        s = result["speculative"]
        if 0 < s["drafted"] == s["accepted"]:
            ctx.notes.append("speculative decoding: every draft was accepted (the rejected drafts' path not taken)")
        elif s["drafted"] and not s["accepted"]:
            ctx.notes.append("speculative decoding: every draft was rejected (the accepted drafts' path not taken)")
    return out
