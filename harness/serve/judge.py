"""The float64 reference of an engine run, and the verdict.

The reference is transformers on the same exported checkpoint, in float64, teacher-forced on the
prompt followed by the engine's own continuation: at every position it gives the log-probabilities the
engine should have produced given what the engine had actually seen.

Rows (one per position, first to last):

* ``prompt`` rows (positions 0 .. n-2, predicting prompt token p+1) and ``step`` rows (position
  n-1+s, predicting the s-th generated token): |engine logprob - reference logprob| of the
  *reference's* top-1 token, against the dtype's budget. The engine reports its top k and the token it
  was given or chose; a reference top-1 outside them is a failure of its own (the engine ranks it
  below k others);
* on ``step`` rows, the greedy choice: the engine's token against the reference's argmax. A different
  token whose reference logit is within ``tie_margin`` of the argmax is a near tie (a note: float32 may
  round either way), further than that a failure naming the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    kind: str  # "prompt" | "step"
    prompt: int  # which prompt of the request
    index: int  # prompt position, or decode step
    position: int  # sequence position whose output this is
    ref_token: int  # the reference's top-1 token here
    err: float | None  # |engine - reference| logprob of ref_token (None: not among the engine's reported tokens)
    budget: float
    chosen: int | None = None  # step rows: the engine's greedy token
    margin: float = 0.0  # step rows: reference logprob(argmax) - logprob(chosen), >= 0
    tie: bool = False  # a different token within the tie margin
    name: str = ""  # how the request is named in messages (default "prompt <i>"; a probe's: "hit", "filler 2")
    # err None, and the engine's own k-th log-probability is within the budget of the reference's value: the
    # engine reports nothing that shows an error above the budget (the reference's top-1 may sit just below
    # the engine's k others where the distribution is flat and the dtype coarse: not judged, counted)
    unordered: bool = False

    @property
    def use(self) -> float:
        """err / budget; infinite for a reference top-1 the engine did not report, 0 where that shows nothing."""
        if self.err is None:
            return 0.0 if self.unordered else float("inf")
        return self.err / self.budget

    @property
    def ok(self) -> bool:
        greedy = self.chosen in (None, self.ref_token) or self.tie
        return greedy and (self.unordered if self.err is None else self.err <= self.budget)


@dataclass
class Verdict:
    rows: list[Row] = field(default_factory=list)

    @property
    def bad(self) -> list[Row]:
        # the earliest position first, whichever prompt: a positional fault shows where it starts
        return sorted((r for r in self.rows if not r.ok), key=lambda r: (r.position, r.prompt))

    @property
    def ties(self) -> list[Row]:
        return [r for r in self.rows if r.tie]

    def worst(self, kind: str) -> float:
        return max((r.err for r in self.rows if r.kind == kind and r.err is not None), default=0.0)


def reference_logprobs(model_dir, sequences: list[list[int]], routes: list | None = None,
                       chosen: list | None = None, force: list | None = None):
    """float64 log-probabilities [len(seq), vocab] for each sequence, from the checkpoint in
    ``model_dir`` through transformers (eager attention: the plainest float64 path). ``routes``: a
    list that gets, per sequence, its routers' choices by layer (harness.serve.routes); ``chosen``: the
    same by router name {router: [T, k]}. ``force``: per sequence, every router's experts {router: [T, k]}
    to take instead of its own (``forced_logprobs``)."""
    import torch
    from transformers import AutoModelForCausalLM

    # eager experts too: transformers' default grouped_mm MoE path rejects float64 on CPU
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager", trust_remote_code=False)
    model.eval()
    if force is not None:
        return forced_logprobs(model, sequences, force)
    out = []
    capture = None
    if routes is not None:
        from harness.serve.routes import ReferenceRoutes

        capture = ReferenceRoutes(model)
    try:
        with torch.no_grad():
            for seq in sequences:
                logits = model(torch.tensor([seq])).logits[0].double()
                out.append(torch.log_softmax(logits, -1))
                if capture is not None:
                    routes.append(capture.take())
                    if chosen is not None:
                        chosen.append(capture.chosen)
    finally:
        if capture is not None:
            capture.remove()
    return out


def forced_logprobs(model, sequences: list[list[int]], force: list) -> list:
    """Log-probabilities (float64 from the model's logits) of each sequence with every router taking the
    experts ``force[i]`` {router: [T, k]} gives it (harness.precision.routing.ForcedRouting); a router that
    could not be forced raises, naming it."""
    import torch

    from harness.precision.routing import ForcedRouting

    forced = ForcedRouting({}, phase="step")
    handles = forced.attach(model)
    out = []
    try:
        with torch.no_grad():
            for seq, f in zip(sequences, force, strict=True):
                forced.force = {"step": f}
                out.append(torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1))
    finally:
        for h in handles:
            h.remove()
    if forced.unforced:
        raise RuntimeError(f"router {forced.unforced[0]} could not be forced to the engine's routes")
    return out


def clean_logprobs(model_dir, sequences: list[list[int]], dtype: str, force: list | None = None):
    """Log-probabilities [len(seq), vocab] (float64 from the dtype's logits) of each sequence from harness's
    own run of the checkpoint in the served ``dtype``: transformers on the CPU, its default kernels. What a
    correct implementation in that dtype measures against float64 on exactly these tokens: the clean run
    the serve budget is measured from (``measured_budget``), as every other check's budget is."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.models.build import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype), trust_remote_code=False)
    model.eval()
    if force is not None:
        return forced_logprobs(model, sequences, force)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1) for seq in sequences]


def clean_error(ref, clean) -> float:
    """The largest |clean - float64| log-probability of the reference's top-1 token over a sequence's
    positions (``ref``, ``clean``: [len(seq), vocab])."""
    top = ref.argmax(-1, keepdim=True)
    return float((clean.gather(-1, top) - ref.gather(-1, top)).abs().max())


def clean_worst(model_dir, ref: dict, dtype: str, force: dict | None = None) -> float:
    """The worst ``clean_error`` of harness's own run in ``dtype`` over the reference's sequences (``ref``:
    tuple(sequence) -> float64 log-probabilities); 0 for float64 itself. ``force``: tuple(sequence) ->
    the experts {router: [T, k]} its routers take (the same the reference took)."""
    if dtype == "float64":
        return 0.0
    seqs = list(ref)
    clean = clean_logprobs(model_dir, [list(q) for q in seqs], dtype, [force[q] for q in seqs] if force else None)
    return max((clean_error(ref[q], c) for q, c in zip(seqs, clean, strict=True)), default=0.0)


def engine_routed(chosen: dict, engine: list, n_experts: int) -> tuple[dict, int]:
    """The reference's choices ``chosen`` {router: [T, k]} with the engine's own (``engine[p][layer]``:
    the experts it reported at position p) wherever it reported a set of k valid experts: what the engine
    routed, for a reference run forced to take the same (``forced_logprobs``). Also how many (position,
    layer) pairs differ from the reference's own choice."""
    import torch

    from harness.serve.routes import layer_of

    out, moved = {}, 0
    for name, idx in chosen.items():
        layer, t = layer_of(name), idx.clone()
        for p in range(min(len(engine), t.shape[0])):
            e = engine[p][layer] if layer is not None and layer < len(engine[p] or []) else None
            if not e or len(e) != t.shape[1] or any(not 0 <= int(x) < n_experts for x in e):
                continue  # not reported, or ids the router does not have (the route verdict names those)
            if {int(x) for x in e} != set(t[p].tolist()):
                t[p] = torch.tensor([int(x) for x in e], dtype=t.dtype)
                moved += 1
        out[name] = t
    return out, moved


def plain_reference(model_dir, seqs: list[tuple], results: list[dict], ref: dict, chosen: dict, dtype: str,
                    n_experts: int) -> tuple[dict, float, int]:
    """The plain run of an MoE model whose engine returned its routes, judged on the routes it took: the
    engine's routers cannot be forced, and a near tie it rounds the other way (a note of the route verdict)
    moves every later log-probability by more than rounding. Per sequence, the float64 reference forced to
    the engine's experts (recomputed only where they differ from its own), and the worst error of the clean
    ``dtype`` run forced the same (the plain rows' budget: the dtype's arithmetic alone, not harness's own
    near-tie flips); and how many (position, layer) pairs the engine routed otherwise."""
    force, moved, redo = {}, 0, []
    for q, r in zip(seqs, results, strict=True):
        force[q], m = engine_routed(chosen[q], r.get("routed_experts") or [], n_experts)
        moved += m
        if m:
            redo.append(q)
    out = {q: ref[q] for q in seqs}
    if redo:
        out.update(zip(redo, reference_logprobs(model_dir, [list(q) for q in redo], force=[force[q] for q in redo]),
                       strict=True))
    return out, clean_worst(model_dir, out, dtype, force), moved


def measured_budget(floor: float, clean: float, k: float, dtype: str = "") -> tuple[float, list[str]]:
    """(budget, notes): the larger of the dtype's floor (``logprob_atol``) and k x the clean run's worst
    error, said where that is larger: a model whose own dtype run moves its log-probabilities further than
    the floor (Gemma-4 in bfloat16: 0.070 nats, the floor 0.05) gets room for it, and a correct engine is
    not failed for the dtype."""
    budget = max(floor, k * clean)
    if budget <= floor:
        return floor, []
    return budget, [f"budget {budget:.3g} nats: {k:g} x the model's own {dtype} run (transformers, {clean:.3g} "
                    f"from float64), above the dtype's floor {floor:g}"]


def _err(engine: dict | None, token: int, ref: float) -> float | None:
    if engine is None or str(token) not in engine:
        return None
    return abs(float(engine[str(token)]) - ref)


def _unordered(engine: dict | None, ref: float, budget: float, k: int | None) -> bool:
    """A reference top-1 the engine did not report, whose absence shows no error above ``budget``: the
    engine's k-th log-probability is within the budget of the reference's value, so the engine's own value
    for the token, below that, may be too. Further below, the error is at least ref - k-th, beyond the
    budget: a failure (a token the engine ranks far down). The k-th of the engine's top ``k``: vLLM adds
    the position's own token (the prompt's, or the one it chose) to them, wherever that ranks (Gemma-4
    bfloat16: its top 5 down to -5.901 against the reference's -5.825, the prompt token at -6.3)."""
    if not engine or k is None:
        return False
    kth = sorted((float(v) for v in engine.values()), reverse=True)[min(k, len(engine)) - 1]
    return ref - kth <= budget


def judge(prompts: list[list[int]], results: list[dict], ref: list, budget: float, tie_margin: float,
          names: list[str] | None = None, starts: list[int] | None = None, k: int | None = None) -> Verdict:
    """Rows of every prompt (``ref[i]``: reference logprobs of prompt i followed by the engine's tokens).
    ``starts[i]``: the first prompt position the engine computed for prompt i (a prefix-cache hit serves
    the positions before it from cached KV pages and returns placeholders there); ``names[i]`` names it;
    ``k``: the engine's top k (``_unordered``; None: a top-1 it did not report always fails)."""
    v = Verdict()
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        lp, n, name = ref[i], len(prompt), names[i] if names else ""
        plp = res["prompt_logprobs"]
        for p in range(starts[i] if starts else 0, n - 1):  # position p predicts token p+1: prompt_logprobs[p+1]
            t = int(lp[p].argmax())
            err = _err(plp[p + 1], t, float(lp[p, t]))
            v.rows.append(Row("prompt", i, p, p, t, err, budget, name=name,
                              unordered=err is None and _unordered(plp[p + 1], float(lp[p, t]), budget, k)))
        for s, (chosen, got) in enumerate(zip(res["tokens"], res["logprobs"], strict=True)):
            pos = n - 1 + s
            t = int(lp[pos].argmax())
            margin = float(lp[pos, t] - lp[pos, chosen])
            err = _err(got, t, float(lp[pos, t]))
            v.rows.append(Row("step", i, s, pos, t, err, budget, chosen, margin,
                              tie=chosen != t and margin <= tie_margin, name=name,
                              unordered=err is None and _unordered(got, float(lp[pos, t]), budget, k)))
    return v


def describe_where(r: Row) -> str:
    who = r.name or f"prompt {r.prompt}"
    return (f"{who} position {r.position} (predicting prompt token {r.position + 1})" if r.kind == "prompt"
            else f"{who} decode step {r.index} (position {r.position})")


def describe(r: Row) -> str:
    """What differs at one row, in one phrase."""
    where = describe_where(r)
    if r.chosen is not None and r.chosen != r.ref_token and not r.tie:
        return (f"{where}: the engine's greedy token {r.chosen} is not the reference's {r.ref_token} "
                f"(reference margin {r.margin:.3g} nats > tie margin)")
    if r.err is None:
        return f"{where}: the reference's top-1 token {r.ref_token} is not among the engine's top-k"
    return f"{where}: |logprob diff| of the reference's top-1 token {r.ref_token} {r.err:.3g} > budget {r.budget:.3g}"


def table(rows: list[Row], limit: int = 30) -> str:
    lines = ["prompt  kind    index  position  ref_token  chosen  err         budget"]
    for r in rows[:limit]:
        err = "missing" if r.err is None else f"{r.err:.4g}"
        who = (r.name or str(r.prompt)).replace(" ", "_")  # one column per field
        lines.append(f"{who:<7} {r.kind:<7} {r.index:<6} {r.position:<9} {r.ref_token:<10} "
                     f"{'' if r.chosen is None else r.chosen!s:<7} {err:<11} {r.budget:.3g}")
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more")
    return "\n".join(lines)


def record(ctx, v: Verdict, budget: float, tie: float) -> None:
    """The plain run's metrics and near-tie notes (the serve check's ``record`` step)."""
    ctx.metric("serve_prompt_logprob_max_abs_diff", v.worst("prompt"))
    ctx.metric("serve_step_logprob_max_abs_diff", v.worst("step"))
    ctx.tolerance("serve_prompt_logprob_max_abs_diff", budget)
    ctx.tolerance("serve_step_logprob_max_abs_diff", budget)
    ctx.metric("serve_worst_budget_use", max(r.use for r in v.rows))
    unordered = [r for r in v.rows if r.unordered]
    ctx.metric("serve_unordered_positions", len(unordered))
    if unordered:
        ctx.notes.append(f"{len(unordered)} position(s) not judged: the reference's top-1 is not among the engine's top "
                         f"k, whose k-th is within the budget of it (a flat distribution; first: "
                         f"{describe_where(unordered[0])})")
    ctx.metric("serve_greedy_mismatches", sum(r.kind == "step" and r.chosen != r.ref_token and not r.tie
                                              for r in v.rows))
    ctx.metric("serve_near_ties", len(v.ties))
    for r in v.ties:
        ctx.notes.append(f"near tie at prompt {r.prompt} step {r.index}: engine chose {r.chosen}, reference "
                         f"{r.ref_token} ({r.margin:.2g} nats apart, tie margin {tie:g})")
