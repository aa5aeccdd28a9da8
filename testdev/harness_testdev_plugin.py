"""The ``harness.backends`` entry point of the test device, declared as a vendor declares theirs.

Kept apart from ``harness_testdev`` (whose import builds and loads the C++ extension): loading
harness's registry must not build anything; availability imports the device module later, and a
build that fails there is the backend's reason for being unavailable.
"""

from __future__ import annotations

BACKEND_NAME = "testdev"
DEVICE_TYPE = "hdev"  # PrivateUse1 renamed by harness_testdev (different from the backend name on purpose)
COLLECTIVE = "hdccl"  # its torch.distributed backend (harness_testdev.distributed), registered at import


def register(registry) -> None:
    from harness.backends import Backend

    registry.add(Backend(BACKEND_NAME, DEVICE_TYPE, COLLECTIVE, module="harness_testdev", dispatch_key="PrivateUse1",
                         description="harness test device: PrivateUse1 on host memory, other ops through a counted CPU fallback"))
