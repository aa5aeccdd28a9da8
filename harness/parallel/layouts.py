"""A parallel layout and its device mesh.

A layout gives a degree per strategy; the world size is their product (``cp`` only where the
attention supports it). Mesh dimensions are ordered outermost first as torchtitan orders them -
``pp, dp, fsdp, ep, cp, tp`` - so that tensor parallelism, the chattiest, spans neighbouring ranks.

Names are what a suite writes in ``[checks.parallel] variants`` and what item ids show:
``tp2``, ``pp2``, ``ep2xtp2`` (degrees above 1, joined by ``x``), plus ``-ac`` when activation
recomputation is on, ``-zero1`` / ``-zero2`` for data parallelism with ZeRO-1 (optimizer state
sharded) or ZeRO-2 (gradients too); a ``[[checks.parallel.configs]]`` entry may also name itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

# Outermost first. "Data" dimensions split the batch: every rank of one data index sees the
# same sequences.
MESH_ORDER = ("pp", "dp", "fsdp", "ep", "cp", "tp")
DATA_DIMS = ("dp", "fsdp", "ep")
NAME_ORDER = ("ep", "tp", "pp", "dp", "fsdp", "cp")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    fsdp: int = 1
    cp: int = 1
    recompute: bool = False
    microbatches: int = 2
    schedule: str = "GPipe"
    name: str = ""
    # ZeRO stage of the dp dimension: 0 plain DDP, 1 DDP + ZeroRedundancyOptimizer (optimizer state
    # sharded), 2 FSDP2 with reshard_after_forward=False (gradients and optimizer state sharded).
    # ZeRO-3 is ``fsdp``.
    zero: int = 0

    def __post_init__(self) -> None:
        # A layout's label names its ranks' result folder (<run>/<label>/), and layouts also arrive
        # as data (a suite's [[checks.parallel.configs]], the spec file the ranks read): refused here,
        # once, for every reader and writer of that folder.
        if self.name:
            from harness.files.paths import name as plain

            plain(self.name, source="parallel layout", field="name")

    @property
    def world(self) -> int:
        return math.prod(getattr(self, d) for d in MESH_ORDER)

    @property
    def data_degree(self) -> int:
        return math.prod(getattr(self, d) for d in DATA_DIMS)

    @property
    def label(self) -> str:
        return self.name or default_name(self)

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Mesh dimension names and sizes (only dimensions > 1; a single rank gets ('dp',), (1,))."""
        dims = [(d, getattr(self, d)) for d in MESH_ORDER if getattr(self, d) > 1]
        if not dims:
            return ("dp",), (1,)
        return tuple(d for d, _ in dims), tuple(n for _, n in dims)

    def coords(self, rank: int) -> dict[str, int]:
        """Index of ``rank`` along every strategy (0 for strategies not used): row-major over the mesh."""
        names, sizes = self.mesh_shape()
        out = {d: 0 for d in MESH_ORDER}
        rem = rank
        for d, n in zip(reversed(names), reversed(sizes), strict=True):
            out[d] = rem % n
            rem //= n
        return out

    def data_index(self, rank: int) -> int:
        """Which slice of the batch ``rank`` sees (row-major over the data dimensions)."""
        c = self.coords(rank)
        idx = 0
        for d in DATA_DIMS:
            idx = idx * getattr(self, d) + c[d]
        return idx

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.label
        return d


def layout_dir(run_dir, lay: Layout):
    """``run_dir / lay.label``, the folder of one layout's rank files (harness.files.paths)."""
    from harness.files.paths import join

    return join(run_dir, lay.label, source="parallel layout", field="name")


def default_name(lay: Layout) -> str:
    parts = [f"{d}{getattr(lay, d)}" for d in NAME_ORDER if getattr(lay, d) > 1]
    name = "x".join(parts) or "single"
    return name + (f"-zero{lay.zero}" if lay.zero else "") + ("-ac" if lay.recompute else "")


_PART = re.compile(r"^(tp|pp|dp|ep|fsdp|cp)(\d+)$")


def parse_name(name: str) -> Layout:
    """``ep2xtp2`` -> Layout(ep=2, tp=2); ``fsdp2-ac`` -> recompute on. ValueError on anything else."""
    base, ac = (name[:-3], True) if name.endswith("-ac") else (name, False)
    zero = 0
    m = re.match(r"^(.*)-zero([12])$", base)
    if m:
        base, zero = m.group(1), int(m.group(2))
    degrees: dict[str, int] = {}
    for part in base.split("x"):
        m = _PART.match(part)
        if not m or m.group(1) in degrees or int(m.group(2)) < 1:
            raise ValueError(f"not a layout name: {name!r} (expected e.g. tp2, ep2xtp2, fsdp2-ac)")
        degrees[m.group(1)] = int(m.group(2))
    return Layout(**degrees, recompute=ac, zero=zero)


@dataclass
class ArchFacts:
    """What the layouts need to know about the pruned model."""

    moe: bool
    num_layers: int
    num_experts: int = 0
    tied_embeddings: bool = False
    notes: list[str] = field(default_factory=list)
    # What context parallelism needs to know of the attention (harness.parallel.cp.attention_facts).
    attention: dict = field(default_factory=dict)


def default_layouts(facts: ArchFacts) -> list[Layout]:
    """Dense: tp2, pp2, dp2, fsdp2 (with recompute, the memory check), tp2xdp2. MoE adds ep2, ep2xtp2."""
    out = [Layout(tp=2), Layout(pp=2), Layout(dp=2), Layout(fsdp=2, recompute=True), Layout(tp=2, dp=2)]
    if facts.moe:
        out += [Layout(ep=2), Layout(ep=2, tp=2)]
    return out


def validate(lay: Layout, facts: ArchFacts, *, heads: int, kv_heads: int, batch_size: int | None = None,
             seq_lens: tuple[int, ...] = ()) -> str | None:
    """Why ``lay`` cannot run on this pruned model (and batch), or None: the first of its ZeRO stage,
    the batch split, the model's shape, and the strategy combinations checked so far."""
    return (_zero_refusal(lay) or _batch_refusal(lay, batch_size) or _model_refusal(lay, facts, heads, kv_heads)
            or _combination_refusal(lay, facts, seq_lens))


def _zero_refusal(lay: Layout) -> str | None:
    if lay.zero not in (0, 1, 2):
        return f"zero = {lay.zero}: ZeRO stage 1 or 2 with dp (ZeRO-3 is fsdp)"
    if lay.zero and (lay.dp < 2 or lay.world != lay.dp):
        return (f"zero = {lay.zero} shards over the dp dimension alone: it needs dp >= 2 and no other strategy "
                f"(ZeRO-3 is fsdp)")
    return None


def _batch_refusal(lay: Layout, batch_size: int | None) -> str | None:
    slices = lay.data_degree * (lay.microbatches if lay.pp > 1 else 1)
    if batch_size is not None and batch_size % slices:
        # Every data rank (and microbatch) must see as many sequences as the others: the reference's
        # mean loss is their mean only then, and each rank is compared with its equal slice.
        return f"batch_size {batch_size} does not split into {slices} equal slices (data ranks x microbatches)"
    return None


def _model_refusal(lay: Layout, facts: ArchFacts, heads: int, kv_heads: int) -> str | None:
    """What the pruned model's layers, embeddings, experts and heads allow."""
    if lay.pp > 1 and facts.num_layers < lay.pp:
        return f"pp{lay.pp} needs at least {lay.pp} decoder layers (the pruned model has {facts.num_layers})"
    if lay.pp > 1 and facts.tied_embeddings:
        return "pipeline stages with tied input/output embeddings are not supported"
    if lay.ep > 1 and not facts.moe:
        return "expert parallelism needs a mixture-of-experts model"
    if lay.ep > 1 and facts.num_experts % lay.ep:
        return f"ep{lay.ep} does not divide the {facts.num_experts} experts"
    if lay.tp > 1 and (heads % lay.tp or (kv_heads % lay.tp and kv_heads != 1)):
        return f"tp{lay.tp} does not divide {heads} query / {kv_heads} key-value heads"
    return None


def _combination_refusal(lay: Layout, facts: ArchFacts, seq_lens: tuple[int, ...]) -> str | None:
    """Context parallelism's own limits, and the strategy combinations not checked yet."""
    if lay.cp > 1 and (lay.pp > 1 or lay.fsdp > 1 or lay.ep > 1 or lay.zero):
        return "context parallelism combines with dp and tp only so far (cp x pp / fsdp / ep / ZeRO are not checked)"
    if lay.cp > 1:
        from harness.parallel.cp import refusal

        why = refusal(facts.attention, lay.cp, seq_lens)
        if why:
            return why
    if lay.pp > 1 and lay.ep > 1:
        return "pipeline parallelism with ep is not supported yet (pp combines with dp, tp or fsdp)"
    if lay.pp > 1 and lay.dp > 1 and (lay.tp > 1 or lay.fsdp > 1):
        return "pp x dp combines with nothing else yet (pp x dp x tp / fsdp are not checked)"
    if lay.ep > 1 and lay.fsdp > 1 and (lay.dp > 1 or lay.tp > 1):
        return "ep x fsdp combines with nothing else yet (ep x fsdp x dp / tp are not checked)"
    return None
