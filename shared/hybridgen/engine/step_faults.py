"""What a failed step means for its requests, and the fault drill that proves it.

Engine.steps catches what a step raises and ends that step's requests with the StepFailed
made here; out of memory (the device's or the host's) is RESOURCE_EXHAUSTED, anything else
INTERNAL. A CUDA error that leaves the device unusable is not survivable: `device_usable`
tells the engine to let it propagate, so that the daemon exits and is restarted.

The drill: HYBRIDGEN_FAULT_STEPS="5:oom,9:error" makes the engine's 5th step run out of
device memory for real (an allocation larger than the device) and its 9th raise, so that
tests and operators can watch a failing step end only its own requests.
"""

from __future__ import annotations

import os

import torch

from hybridgen.engine.step_errors import ErrorCode, StepFailed

FAULT_ENV = "HYBRIDGEN_FAULT_STEPS"
"""Environment variable of the fault drill: comma-separated STEP:KIND, KIND oom or error."""


class InjectedFault(RuntimeError):
    """Raised by the fault drill's `error` kind."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation that failed on the device (torch.OutOfMemoryError) or the host."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def step_failure(exc: BaseException) -> StepFailed:
    """The StepFailed that the requests of a step that raised `exc` end with."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    if is_out_of_memory(exc):
        return StepFailed(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"the step ran out of memory ({type(exc).__name__}: {first}); this request was "
            "stopped, the others go on. Lower max_num_batched_tokens or max_model_len, or "
            "raise device_topology.gpu.memory_mb",
        )
    return StepFailed(
        ErrorCode.INTERNAL,
        f"the step failed ({type(exc).__name__}: {first}); this request was stopped, the "
        "others go on",
    )


def device_usable(device: torch.device) -> bool:
    """False when the device is broken for good (a sticky CUDA error): the daemon must exit."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except Exception:  # a sticky CUDA error fails every call from now on
        return False
    return True


class FaultDrill:
    """Faults to raise at given engine steps (HYBRIDGEN_FAULT_STEPS); none by default."""

    def __init__(self, spec: str = "") -> None:
        self.at: dict[int, str] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            step, _, kind = item.partition(":")
            if not step.isdigit() or kind not in ("oom", "error"):
                raise ValueError(
                    f"{FAULT_ENV}: {item!r} is not STEP:KIND with STEP >= 0 and KIND oom or error"
                )
            self.at[int(step)] = kind

    @classmethod
    def from_env(cls) -> FaultDrill:
        return cls(os.environ.get(FAULT_ENV, ""))

    def check(self, step: int, device: torch.device) -> None:
        """Raise the fault planned for `step` (numbered from 0), if any."""
        kind = self.at.pop(step, None)
        if kind == "error":
            raise InjectedFault(f"fault drill: step {step} fails ({FAULT_ENV})")
        if kind == "oom":  # a real failed allocation: more bytes than any device has
            torch.empty(1 << 50, dtype=torch.uint8, device=device)
