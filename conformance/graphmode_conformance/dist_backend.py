"""The distributed backend, per device type.

A tensor-parallel run makes its process group with the backend
``graphmode_dist_backend`` names for the rank's device. A vendor answering
its own library for every device (``"cncl"`` for a CUDA device) breaks every
run on the others at start-up, in ``init_process_group``; one answering
nothing for its own device leaves it to the default, which knows only CUDA
and the CPU.

:class:`DistributedBackendTests` asks the hook about every device type this
torch can name among the vendor's, torch's own
(``torch.distributed.Backend.default_device_backend_map``: cpu, cuda, xpu,
mps, and what runtimes such as torch_npu register) and the device under
test. Where torch names a backend for the type, the answer must be it
(the vendor answers None for types it does not drive, and the default
answers torch's); the vendor's own device types must get an answer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed

from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.structure import ConformanceFailure

__all__ = ["DistributedBackendTests", "torch_backends"]


def torch_backends() -> dict[str, str]:
    """torch.distributed's backend per device type, as
    ``init_process_group`` picks it when given none (runtimes add theirs)."""
    return dict(getattr(torch.distributed.Backend, "default_device_backend_map", {"cpu": "gloo", "cuda": "nccl"}))


def _nameable(device_type: str) -> torch.device | None:
    """``torch.device(device_type)``, or None if this torch cannot name it
    (npu, mlu without their runtime)."""
    try:
        return torch.device(device_type)
    except RuntimeError:
        return None


def _vendors_answer(vendor: Any, device: torch.device) -> Any:
    """What the vendor's own implementations answer (the first non-None),
    the defaults left out: for a device type it does not drive, the
    default's answer is graphmode's, not the vendor's."""
    for impl in reversed(vendor.hook.graphmode_dist_backend.get_hookimpls()):  # pluggy calls the last first
        if impl.plugin is vendor.plugin and not (impl.hookwrapper or getattr(impl, "wrapper", False)):
            answer = impl.function(**{name: device for name in impl.argnames})
            if answer is not None:
                return answer
    return None


class DistributedBackendTests(ConformanceFixtures):
    def test_distributed_backend_per_device_type(self, vendor, device):
        """For every device type torch names here: torch's own backend where
        it has one, and an answer for the vendor's own types."""
        expected = torch_backends()
        own = set(vendor.info.device_types)
        types = dict.fromkeys((*vendor.info.device_types, device.type, *expected))
        asked = []
        for device_type in types:
            named = _nameable(device_type)
            if named is None:
                continue
            asked.append(device_type)
            # The whole hook's answer for the vendor's own types; for the
            # others the vendor's alone (None lets the default answer).
            answer = (vendor.hook.graphmode_dist_backend(device=named) if device_type in own
                      else _vendors_answer(vendor, named))
            right = expected.get(device_type)
            where = f"[distributed backend] vendor {vendor.name}: graphmode_dist_backend answers {answer!r} for {device_type}"
            if device_type in own and answer is None:
                raise ConformanceFailure(
                    f"{where}, one of the vendor's device types {vendor.info.device_types}: a tensor-parallel run "
                    f"there has no backend to make its process group with. Hook: graphmode_dist_backend must name "
                    f"the vendor's collective library for {device_type}"
                )
            if right is not None and answer != right and (device_type in own or answer is not None):
                drives = ("one of the vendor's device types" if device_type in own else
                          f"a device type the vendor does not drive (its device_types {vendor.info.device_types})")
                raise ConformanceFailure(
                    f"{where}, {drives}, whose torch.distributed backend is {right!r} "
                    f"(torch.distributed.Backend.default_device_backend_map): a tensor-parallel run on {device_type} "
                    f"devices fails at start-up, in init_process_group({answer!r}), or moves every collective "
                    f"through another library. Hook: graphmode_dist_backend must answer from device.type: the "
                    f"vendor's library for its own device types only"
                    + (", and None for the others, so that the default answers" if device_type not in own else "")
                )
        if not asked:
            pytest.skip("torch here names none of the device types to ask about")
