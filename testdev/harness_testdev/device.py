"""``torch.hdev``: the device module of the test device (what torch and harness call on
``torch.<device_type>``), backed by the C++ extension."""

from __future__ import annotations

import os

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


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of one device, as ``torch.cuda.mem_get_info`` (torch_npu, torch_musa and
    torch_xpu have it too): harness places a full model by it (the weights check). Its memory is the
    host's, so each device's capacity is ``TESTDEV_DEVICE_MEMORY`` bytes (default: the host's total)
    and its free memory that capacity less what its allocator holds, at most what the host has
    available."""
    i = _index(device)
    host_total, host_avail = _host_meminfo()
    total = int(os.environ.get("TESTDEV_DEVICE_MEMORY") or host_total)
    return max(0, min(total - _C.memory_allocated(i), host_avail)), total


def _host_meminfo() -> tuple[int, int]:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


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


# --- streams and events (what FSDP2 and other stream-aware code take from ``torch.<device>``) ------
# Work on the device is synchronous on the host: every stream is idle when asked, a wait has nothing
# to wait for, an event is complete once recorded. Timing events read the host clock.
class Stream:
    def __init__(self, device=None, priority: int = 0, **_kwargs):
        self.device = torch.device(DEVICE_TYPE, _index(device))
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        synchronize(self.device)

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> Event:
        import time

        self._t = time.perf_counter()
        return self

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event's record and ``end``'s."""
        return (end._t - self._t) * 1e3


DEVICE_TYPE = "hdev"
_default_streams: dict[int, Stream] = {}
_current: dict[int, Stream] = {}


def default_stream(device=None) -> Stream:
    i = _index(device)
    if i not in _default_streams:
        _default_streams[i] = Stream(i)
    return _default_streams[i]


def current_stream(device=None) -> Stream:
    i = _index(device)
    return _current.get(i) or default_stream(i)


def set_stream(stream: Stream) -> None:
    _current[stream.device.index] = stream


class stream:  # noqa: N801  (torch.cuda.stream's name)
    """``with torch.hdev.stream(s):`` makes ``s`` current on its device for the block."""

    def __init__(self, s: Stream | None):
        self.s, self.prev = s, None

    def __enter__(self):
        if self.s is not None:
            self.prev = current_stream(self.s.device)
            set_stream(self.s)
        return self.s

    def __exit__(self, *exc):
        if self.s is not None:
            set_stream(self.prev)
        return False
