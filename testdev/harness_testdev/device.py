"""``torch.hdev``: the device module of the test device (what torch and harness call on
``torch.<device_type>``), backed by the C++ extension."""

from __future__ import annotations

import torch

from harness_testdev import _C


def _index(device=None) -> int:
    if device is None:
        return _C.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return _C.current_device() if d.index is None else d.index


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    pass


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device) -> None:
    _C.set_device(_index(device))


def get_device_name(device=None) -> str:
    return f"hdev host-memory test device {_index(device)}"


def synchronize(device=None) -> None:
    """Counted (``synchronize_count``) so tests can see a timing path synchronise."""
    _C.synchronize(_index(device))


def synchronize_count() -> int:
    return _C.synchronize_count()


# --- memory -------------------------------------------------------------------------------------
def memory_allocated(device=None) -> int:
    return _C.memory_allocated(_index(device))


def max_memory_allocated(device=None) -> int:
    return _C.max_memory_allocated(_index(device))


def reset_peak_memory_stats(device=None) -> None:
    _C.reset_peak_memory_stats(_index(device))


def memory_stats(device=None) -> dict[str, int]:
    i = _index(device)
    return {"allocated_bytes.all.current": _C.memory_allocated(i), "allocated_bytes.all.peak": _C.max_memory_allocated(i),
            "allocation.all.allocated": _C.allocation_count(i)}


def empty_cache() -> None:
    pass


# --- random -------------------------------------------------------------------------------------
def default_generator(device=None) -> torch.Generator:
    return _C.default_generator(_index(device))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device="hdev") -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device="hdev") -> None:
    default_generator(device).set_state(new_state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported() -> bool:
    return True


# --- the CPU fallback ---------------------------------------------------------------------------
def fallback_counts() -> dict[str, int]:
    """``{"aten::op.overload": calls}`` of every op that ran through the boxed CPU fallback since the
    last reset: the ops without a native kernel on this device."""
    return dict(_C.fallback_counts())


def reset_fallback_counts() -> None:
    _C.reset_fallback_counts()
