"""The ``harness.backends`` entry point of the test device, declared as a vendor declares theirs.

Kept apart from ``harness_testdev`` (whose import builds and loads the C++ extension): loading
harness's registry must not build anything; availability imports the device module later, and a
build that fails there is the backend's reason for being unavailable.
"""

from __future__ import annotations

from pathlib import Path

BACKEND_NAME = "testdev"
DEVICE_TYPE = "hdev"  # PrivateUse1 renamed by harness_testdev (different from the backend name on purpose)
COLLECTIVE = "hdccl"  # its torch.distributed backend (harness_testdev.distributed), registered at import


# Its op list, generated from what the device really registers (with the device built):
#   harness oplist update --backend testdev --from dispatcher -o testdev/harness_testdev/oplists/testdev-0.1.0.txt
# (tests/testdev/test_ops_coverage.py regenerates it and fails when it is stale)
OP_LIST = Path(__file__).resolve().parent / "harness_testdev" / "oplists" / "testdev-0.1.0.txt"


def register(registry) -> None:
    from harness.backends import Backend

    registry.add(Backend(BACKEND_NAME, DEVICE_TYPE, COLLECTIVE, module="harness_testdev", dispatch_key="PrivateUse1",
                         description="harness test device: PrivateUse1 on host memory, other ops through a counted CPU fallback",
                         op_lists=[OP_LIST]))
