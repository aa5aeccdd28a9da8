"""Built-in backends, registered through the same ``harness.backends`` entry point a vendor uses.

Out-of-tree PrivateUse1 backends (torch_npu, torch_musa, torch_mlu) rename PrivateUse1 to their
device type on import; their kernels sit under the PrivateUse1 dispatch key.
"""

from __future__ import annotations

from pathlib import Path

from harness.backends.base import Backend, Registry

# The operator lists harness ships (docs/backends.md): a built-in declares its own, as a vendor's
# backend declares the files in its package.
OPLISTS = Path(__file__).resolve().parent.parent / "oplists"


def _lists(name: str) -> list[Path]:
    return sorted(p for p in OPLISTS.glob("*.txt") if p.stem == name or p.name.startswith(f"{name}-"))

BUILTINS = [
    Backend("cpu", "cpu", "gloo", dispatch_key="CPU", description="host CPU (the reference)"),
    Backend("cuda", "cuda", "nccl", dispatch_key="CUDA", description="NVIDIA CUDA, or AMD ROCm (HIP) builds"),
    Backend("xpu", "xpu", "xccl", dispatch_key="XPU", description="Intel GPU"),
    Backend("mps", "mps", "gloo", dispatch_key="MPS", description="Apple Metal"),
    Backend("npu", "npu", "hccl", module="torch_npu", dispatch_key="PrivateUse1",
            description="Huawei Ascend through torch_npu"),
    Backend("musa", "musa", "mccl", module="torch_musa", dispatch_key="PrivateUse1",
            description="Moore Threads through torch_musa"),
    Backend("mlu", "mlu", "cncl", module="torch_mlu", dispatch_key="PrivateUse1",
            description="Cambricon through torch_mlu"),
]


def register(registry: Registry) -> None:
    for b in BUILTINS:
        # fresh copies: probes cache their answers on the instance
        registry.add(Backend(b.name, b.device_type, b.collective, b.module, b.dispatch_key, b.description,
                             op_lists=_lists(b.name)))
    # ROCm builds of torch run as the cuda backend; their kernel set is a column of its own in coverage
    registry.declare_op_list("rocm", _lists("rocm"))
