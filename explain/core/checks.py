"""Checks of values that live on the model's device, decided with one host synchronisation per call.

A check that reads a tensor's values in Python (is the input finite? the scores? is a map empty?) makes the host wait
for the device and, on a GPU, costs a transfer. During an explainer call (``deferred_checks``) each check hands over
a small tensor and a function that decides on its values; the values of every check are brought to the host together
once, at the end of the call, and the decisions run in the order the checks were made (the first failure raises).
Outside such a call a check is decided at once. A check of a whole tensor hands over a reduction of it (a sum: NaN
and inf survive it) and looks at the whole tensor only when the reduction is not finite.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

Decision = Callable[[list[float]], None]
"""Receives the check's values on the host, flattened (row-major), and raises if they are wrong."""


class DeferredChecks:
    """The checks of one call: (values on the device, decision), decided together by ``run``."""

    def __init__(self) -> None:
        self.pending: list[tuple[Tensor, Decision]] = []

    def add(self, values: Tensor, decide: Decision) -> None:
        """``values``: a small tensor outside the autograd graph (made under ``torch.no_grad()``)."""
        self.pending.append((values, decide))

    def run(self) -> None:
        """Bring every check's values to the host at once and decide them in order; cleared either way."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        if all(values.device.type == "cpu" for values, _ in pending):  # read where they are: no operation
            for values, decide in pending:
                decide(_flattened(values.tolist()))
            return
        with torch.no_grad():
            flat = [values.reshape(-1) for values, _ in pending]
            dtype = torch.float64 if any(part.dtype == torch.float64 for part in flat) else torch.float32
            on_host = torch.cat([part if part.dtype == dtype else part.to(dtype) for part in flat]).cpu().tolist()
        start = 0
        for (_, decide), part in zip(pending, flat):
            decide(on_host[start : start + part.numel()])
            start += part.numel()


def _flattened(values: object) -> list[float]:
    """``Tensor.tolist()``'s nested lists (or a number, for a 0-d tensor) in row-major order."""
    if not isinstance(values, list):
        return [float(values)]  # type: ignore[arg-type]
    flat: list[float] = []
    for value in values:
        flat.extend(_flattened(value) if isinstance(value, list) else [float(value)])
    return flat


_calls = threading.local()


def current() -> Optional[DeferredChecks]:
    """The checks of this thread's innermost deferring call, if any."""
    stack = getattr(_calls, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Within the block, in this thread, ``check`` defers; the caller runs the checks (``DeferredChecks.run``)."""
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    checks = DeferredChecks()
    stack.append(checks)
    try:
        yield checks
    finally:
        stack.remove(checks)


def check(values: Tensor, decide: Decision) -> None:
    """Decide on ``values`` (a small tensor outside the graph) now, or at the end of this thread's deferring call."""
    checks = current()
    if checks is None:
        decide(_flattened(values.detach().tolist()))
    else:
        checks.add(values, decide)


def check_finite(tensor: Tensor, fail: Callable[[Tensor], None]) -> None:
    """``fail(tensor)`` unless every value of ``tensor`` is finite; decided from its sum (one reduction), the whole
    tensor read only when the sum is not finite (a NaN, an inf, or finite values whose sum overflows)."""

    def decide(total: list[float]) -> None:
        if not math.isfinite(total[0]) and not bool(torch.isfinite(tensor).all()):
            fail(tensor)

    with torch.no_grad():
        total = tensor.sum()
    check(total, decide)
