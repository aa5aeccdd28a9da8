"""Build the model a suite describes: pruned, seeded, in a dtype, on a device.

Weights are always created on the CPU in float32 from the seed and then cast and moved, so every
backend and dtype starts from the same numbers (what makes cross-backend comparisons meaningful).
Local weights load through safetensors only; nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from harness.models.config import (
    AdapterError,  # noqa: F401 - re-exported (the builders raise it; callers catch it from here)
    ModelBuildError,
    ModelConfig,
    architecture_class,  # noqa: F401 - re-exported (tests and callers import it from here)
    build_config,
    use_eager_experts,
)
from harness.suite.loader import LoadedSuite, SuiteError

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


class SuiteModelError(SuiteError, ModelBuildError):
    """A suite whose model cannot be built (unknown architecture, a pruned config transformers rejects):
    a SuiteError naming the file, so every command that reports bad suites in one line reports it too."""


def model_config(ls: LoadedSuite, *, pruned: bool = True) -> ModelConfig:
    m = ls.suite.model
    try:
        return build_config(ls.raw_config, ls.suite.prune if pruned else None, architecture=m.architecture,
                            trust_remote_code=m.trust_remote_code)
    except ModelBuildError as e:
        raise SuiteModelError(ls.path, [str(e)]) from None


def load_adapter(spec: str) -> Callable:
    """``package.module:callable`` -> the callable, with an error that says what went wrong."""
    from harness.models.builders import from_import_string

    return from_import_string(spec).fn


def instantiate(ls: LoadedSuite, mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The bare module, on CPU, weights from the current RNG state, built by the suite's
    ``model.adapter`` (a registered builder's name, ``hf`` by default, or an import string)."""
    from harness.models.builders import resolve

    if dtype == torch.float64:
        use_eager_experts(mc.config)
    adapter = ls.suite.model.adapter
    model = resolve(adapter).build(mc, dtype=torch.float32, device="cpu")
    if not isinstance(model, torch.nn.Module):
        raise AdapterError(f"model.adapter {adapter!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def load_weights(model: torch.nn.Module, path: Path) -> list[str]:
    """Load local safetensors (a file or every *.safetensors in a directory). Returns notes on
    missing/unexpected keys rather than failing, since a pruned model only uses part of them."""
    from safetensors.torch import load_file

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"model.weights: no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    result = model.load_state_dict(state, strict=False)
    notes = []
    if result.missing_keys:
        notes.append(f"{len(result.missing_keys)} parameters not in the weights (kept random), "
                     f"e.g. {result.missing_keys[0]}")
    if result.unexpected_keys:
        notes.append(f"{len(result.unexpected_keys)} tensors in the weights unused, e.g. {result.unexpected_keys[0]}")
    return notes


def build_model(ls: LoadedSuite, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                seed: int = 0, mc: ModelConfig | None = None) -> tuple[torch.nn.Module, ModelConfig]:
    """Pruned model for ``ls`` with seeded weights, cast to ``dtype`` and moved to ``device``."""
    dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    mc = mc or model_config(ls)
    real = ls.weights_path is not None
    if real:
        # Real tensors of the kept layers/experts (docs/weights.md). No random init first: the load writes
        # every parameter, and initialising them was most of a pruned build's time.
        from harness.models import loaders

        loader = loaders.registry().get(loaders.DEFAULT)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = loader.empty(ls, mc, dt) if real else instantiate(ls, mc, dt)
    if real:
        mc.notes.extend(loader.load(model, ls, mc, dtype=dt))
    return cast_model(model, dt, device), mc


def cast_model(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.nn.Module:
    """``model.to(device, dtype)`` as a deployed model is: floating parameters and checkpoint buffers
    in ``dtype``, the float32 buffers a checkpoint does not hold kept in float32 (see below)."""
    kept = creation_dtype_buffers(model, dtype)
    fp32 = keep_in_fp32(model, dtype)
    for mod, name, _ in kept:  # out of Module.to's way (it skips None buffers): never cast, no warning
        mod._buffers[name] = None
    for mod, name, t in fp32:
        (mod._parameters if isinstance(t, torch.nn.Parameter) else mod._buffers)[name] = None
    model = model.to(device=device, dtype=dtype)
    for mod, name, t in kept:
        mod._buffers[name] = t.to(device=device)
    moved: dict[int, torch.nn.Parameter] = {}
    for mod, name, t in fp32:
        if isinstance(t, torch.nn.Parameter):
            # A new Parameter, one per original (a tied one stays tied). Not ``t.data = ...``: moving a
            # CPU Parameter's data to a PrivateUse1 device fails ("variable and tensor have incompatible
            # tensor type": a vendor TensorImpl is not shallow-copy compatible with the CPU's).
            if id(t) not in moved:
                moved[id(t)] = torch.nn.Parameter(t.data.to(device=device, dtype=torch.float32),
                                                  requires_grad=t.requires_grad)
            mod._parameters[name] = moved[id(t)]
        else:
            mod._buffers[name] = t.to(device=device, dtype=torch.float32)
    return model


def keep_in_fp32(model: torch.nn.Module, dt: torch.dtype) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Parameters and buffers a deployed model keeps in float32 in a bf16/fp16 build: the model class's
    ``_keep_in_fp32_modules_strict`` (bf16 and fp16; DeepSeek-V3's router ``gate.weight`` and
    ``e_score_correction_bias``) and ``_keep_in_fp32_modules`` (fp16 only), matched as
    ``from_pretrained(dtype=...)`` matches them (transformers' own glob alternation, searched in each
    name). Cast to bf16 here, the router would choose differently from the deployed model."""
    if dt not in (torch.float16, torch.bfloat16):
        return []
    pats = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dt == torch.float16:
        pats |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not pats:
        return []
    from transformers.core_model_loading import build_glob_alternation

    alt = build_glob_alternation(sorted(pats))[0]
    out = []
    for mname, mod in model.named_modules():
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is not None and t.is_floating_point() and alt.search(f"{mname}.{name}" if mname else name):
                out.append((mod, name, t))
    return out


def creation_dtype_buffers(model: torch.nn.Module, dt: torch.dtype) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Float32 buffers that are not part of a checkpoint (non-persistent: rotary ``inv_freq``, its
    ``original_inv_freq``) and must stay float32 in a bf16/fp16 model. ``from_pretrained(dtype=bf16)``
    casts only what it loads, so a deployed model holds ``inv_freq`` in float32; ``model.to(bf16)``
    would round it to 8 bits (2^-9 relative: 0.03 rad of angle error at position 16 already), which
    made the clean run as wrong as a port that builds its rotary tables in bf16 (issue #11). Float64
    (the reference) casts them up as before: exact."""
    out = []
    for mod in model.modules():
        for name, t in mod._buffers.items():
            if t is not None and t.is_complex() and not dt.is_complex:
                # A complex table (Llama-4's vision rotary ``freqs_ci``, complex64): Module.to(real
                # dtype) would cast it to real, dropping the imaginary part (torch warns "Casting
                # complex values to real"). Kept complex; complex128 for the float64 reference.
                out.append((mod, name, t.to(torch.complex128) if dt == torch.float64 else t))
        if dt.itemsize >= 4:
            continue
        for name in getattr(mod, "_non_persistent_buffers_set", ()):
            t = mod._buffers.get(name)
            if t is not None and t.dtype == torch.float32:
                out.append((mod, name, t))
    return out


def seeded_tokens(vocab_size: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Token ids [batch, seq] from a private generator: identical on every rank and backend."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


@contextlib.contextmanager
def cpu_threads(default: int | None):
    """torch's intra-op threads set to ``default`` (or $HARNESS_CPU_THREADS; 0 or None: left alone) for
    the block, restored after. The pruned test models' tensors ([2, 16, 64]) are too small to split:
    a second thread only spin-waits, and on a loaded machine (pytest -n 2, a shared runner) that made
    golden generate and the numerics checks 3-10x slower (measured: 151 s -> 40 s for tests/models)."""
    from harness import settings

    n = settings.env("HARNESS_CPU_THREADS")
    n = default if n is None else n
    before = torch.get_num_threads()
    if n and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
