"""Model adapters (``model.adapter = "faulty_models:<name>"``) that misbehave the way a real
bring-up does: a kernel that never returns, a driver that aborts, a forward that leaks memory. Each
builds the real transformers model from the suite's pruned config and adds the fault with a forward
pre-hook on one module, so the harness sees an ordinary model until that module runs."""

from __future__ import annotations

import os
import time

import torch
from transformers import LlamaForCausalLM

_LEAKED: list[torch.Tensor] = []


def hang(config, dtype, device):
    m = LlamaForCausalLM(config)

    def forever(mod, args):
        while True:  # a kernel that never returns (sleeps, so it does not burn the CI's cores)
            time.sleep(0.05)

    m.model.layers[1].mlp.register_forward_pre_hook(forever)
    return m


def abort(config, dtype, device):
    m = LlamaForCausalLM(config)
    m.model.layers[0].self_attn.register_forward_pre_hook(lambda mod, args: os.abort())
    return m


def leak(config, dtype, device):
    """Every forward of layer 0's MLP keeps 64 MiB alive for good (touched, so it is resident)."""
    m = LlamaForCausalLM(config)

    def grab(mod, args):
        _LEAKED.append(torch.ones(64 * 2**20 // 4))

    m.model.layers[0].mlp.register_forward_pre_hook(grab)
    return m


def missing_module(config, dtype, device):  # pragma: no cover - never importable on purpose
    import harness_no_such_vendor_module  # noqa: F401


def balloon(config, dtype, device):
    """The first forward of layer 0's MLP grows the process by 64 MiB every 50 ms, up to 3 GiB: a
    runaway allocation that a memory limit must stop."""
    m = LlamaForCausalLM(config)

    def grow(mod, args):
        for _ in range(48):
            _LEAKED.append(torch.ones(64 * 2**20 // 4))
            time.sleep(0.05)

    m.model.layers[0].mlp.register_forward_pre_hook(grow)
    return m


# What a failed collective and a failed download print, together: a gloo source location (shaped
# like a closing console-markup tag) and a Hugging Face token the URL carried.
HOSTILE_MESSAGE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                   "peer [red]x[/red]; GET https://huggingface.co/x/resolve/main/model.safetensors "
                   "Authorization: Bearer hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345 failed")


def hostile_error(config, dtype, device):
    """A forward that raises with :data:`HOSTILE_MESSAGE` (console markup and a token in one line)."""
    m = LlamaForCausalLM(config)

    def fail(mod, args):
        raise RuntimeError(HOSTILE_MESSAGE)

    m.model.layers[0].mlp.register_forward_pre_hook(fail)
    return m


# --- for confirm-before-filing (harness/run/confirm.py) ---------------------------------------------

def _nan_mlp(m):
    m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * float("nan"))
    return m


def nan(config, dtype, device):
    """Deterministic: layer 0's MLP returns NaN in every run (a wrong kernel)."""
    return _nan_mlp(LlamaForCausalLM(config))


def _processes_so_far() -> int:
    """How many worker processes built this adapter before this one (a counter file named by
    $HARNESS_TEST_FLAKY_COUNTER, advanced once per process)."""
    path = os.environ["HARNESS_TEST_FLAKY_COUNTER"]
    if getattr(_processes_so_far, "n", None) is None:
        n = int(open(path).read() or 0) if os.path.exists(path) else 0
        with open(path, "w") as f:
            f.write(str(n + 1))
        _processes_so_far.n = n
    return _processes_so_far.n


def flaky(config, dtype, device):
    """Fails one run in three: in the first worker process of every three that build it, layer 0's
    MLP returns NaN (a race that corrupts a buffer now and then). Each of harness's confirming reruns
    is a fresh process, so a run's first attempt fails and its two reruns pass."""
    m = LlamaForCausalLM(config)
    return _nan_mlp(m) if _processes_so_far() % 3 == 0 else m


def oom_killed(config, dtype, device):
    """The runner's OOM killer: the process is sent SIGKILL from outside harness mid-forward."""
    import signal

    m = LlamaForCausalLM(config)
    m.model.layers[0].self_attn.register_forward_pre_hook(lambda mod, args: os.kill(os.getpid(), signal.SIGKILL))
    return m


def low_precision_mlp(config, dtype, device):
    """Layer 1's MLP off by 2 % in every dtype but float64: a kernel that is only wrong in low
    precision. The float64 golden (built by this same adapter, so its config hash matches) is
    clean; the float32 target is not, and precision names ``model.layers.1.mlp``."""
    m = LlamaForCausalLM(config)

    def skew(mod, args, out):
        return out if out.dtype == torch.float64 else out * 1.02

    m.model.layers[1].mlp.register_forward_hook(skew)
    return m


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds  # CPU seconds, not wall: as slow as the machine is loaded
    while time.process_time() < end:
        pass


def _first_time(work):
    """A forward pre-hook that does ``work`` on the module's first forward only: slow once, as a cold
    compile is (the smoke item runs the model about nine times - training steps, generation - and the
    work in every one made one item 54 s on a quiet machine)."""
    done = []

    def hook(mod, args):
        if not done:
            done.append(True)
            work()

    return hook


def busy(config, dtype, device):
    """Slow but alive: layer 1's MLP computes for 6 s of CPU in one module, once (no module entered
    meanwhile), as a cold compile does; under load that is much longer on the wall clock."""
    m = LlamaForCausalLM(config)
    m.model.layers[1].mlp.register_forward_pre_hook(_first_time(lambda: _burn(6.0)))
    return m


def busy_child(config, dtype, device):
    """Slow but alive in another process: layer 1's MLP waits on a child that computes for 6 s of
    CPU (inductor's compile workers, a launcher's ranks): the item's own process uses none."""
    import subprocess
    import sys

    m = LlamaForCausalLM(config)
    code = "import time\nend = time.process_time() + 6\nwhile time.process_time() < end: pass\n"

    def wait_for_child():
        subprocess.run([sys.executable, "-c", code], check=True)

    m.model.layers[1].mlp.register_forward_pre_hook(_first_time(wait_for_child))
    return m


def hang_with_escaped_child(config, dtype, device):
    """Layer 1's MLP starts a helper that leaves the item's session (setsid, as a compile pool or a
    server's helper may), writes its pid to $ESCAPED_PID_FILE, then hangs: the kill at the item's
    limit must take the helper too."""
    import subprocess
    import sys

    m = LlamaForCausalLM(config)

    def escape_then_hang(mod, args):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        with open(os.environ["ESCAPED_PID_FILE"], "w") as f:
            f.write(str(p.pid))
        while True:
            time.sleep(0.05)

    m.model.layers[1].mlp.register_forward_pre_hook(escape_then_hang)
    return m
