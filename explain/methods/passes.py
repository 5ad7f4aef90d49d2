"""Passes through the model: how many rows each takes, what to say when one runs out of memory, and the precision it
runs in."""

from __future__ import annotations

import numbers
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

ROWS_PER_PASS = {"cpu": 16}
"""Rows (path points, noisy or reference copies of the images) per forward/backward pass when a
method's ``batch_size`` is None, by device type; 256 on other devices (GPUs). On the CPU, passes of
16 rows of 224 px images cost the least per row (Integrated Gradients, 32 steps, 224 px: 0.86× the
time of 32-row passes on resnet18, 0.63× on resnet50; per-row costs by pass size in
benchmarks/RESULTS.md, "Memory layout of the model's input"): what matters there is how much a pass
holds, so smaller images get more rows per pass (``CPU_VALUES_PER_PASS``), where a pass's fixed cost
(Python, dispatching every operation) would otherwise dominate. On a GPU each pass has a fixed cost
(kernel launches, Python) that small passes do not spread: on an H200, Captum's single 256-row pass
of Integrated Gradients took 0.62× the time of eight 32-row passes (benchmarks/RESULTS.md,
"Attribution methods next to their peers (CUDA)"). A pass that runs out of memory is run again in
halves (``Explainer.row_passes``)."""

CPU_VALUES_PER_PASS = 16 * 3 * 224 * 224
"""On the CPU, the input values a pass holds by default: 16 rows of 3 × 224 × 224, more rows of smaller inputs (32
rows of 32 px images in one pass rather than two), at most ``CPU_MOST_ROWS_PER_PASS``."""

CPU_MOST_ROWS_PER_PASS = 64
"""The most rows a CPU pass holds by default, however small the inputs: a model that enlarges its input inside (a
resize to 224 px in its forward) then holds 4× a 224 px pass's activations, not 16×."""


def checked_batch_size(batch_size: Optional[int]) -> Optional[int]:
    """``batch_size`` as a method takes it: None (automatic, see ``rows_per_pass``) or an int ≥ 1."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be None (chosen for the device) or an int of at least 1; "
                         f"got {batch_size!r}.")
    return int(batch_size)


def rows_per_pass(batch_size: Optional[int], device: torch.device, row_values: Optional[int] = None) -> int:
    """The rows per forward/backward pass: ``batch_size`` if given, else ``ROWS_PER_PASS`` for the device; on the
    CPU, for rows of ``row_values`` input values each (when given), as many as ``CPU_VALUES_PER_PASS`` holds (16 to
    ``CPU_MOST_ROWS_PER_PASS``)."""
    if batch_size is not None:
        return batch_size
    default = ROWS_PER_PASS.get(device.type, 256)
    if device.type == "cpu" and row_values:
        return min(CPU_MOST_ROWS_PER_PASS, max(default, CPU_VALUES_PER_PASS // row_values))
    return default


PROGRESS_THRESHOLD = 8
"""With ``progress=None`` a bar is shown when a call needs more passes through the model than this."""


def out_of_memory_error(error: BaseException, method: str, device: torch.device, rows: int,
                        batch_size: Optional[int]) -> BaseException:
    """The error to raise when a pass of ``rows`` rows ran out of memory and cannot be made smaller:
    ``error`` with what was tried and what to do, as torch's OutOfMemoryError or a RuntimeError as it
    was (an error of the model's own type is returned as it is, with the advice as a note on Python 3.11+)."""
    if batch_size is not None and batch_size > 1:
        hint = f"batch_size={batch_size} was given: pass a smaller one"
    else:
        hint = "even one row at a time: explain fewer images per call, use smaller inputs, or another device"
    advice = f"{method} ran out of memory on {device} at {rows} row{'s' if rows > 1 else ''} per pass ({hint})."
    if type(error) in (torch.cuda.OutOfMemoryError, RuntimeError):
        return type(error)(f"{error}\n{advice}")
    if hasattr(error, "add_note"):
        error.add_note(advice)
    return error


def check_parameters_usable(model: nn.Module, cause: Optional[BaseException] = None) -> None:
    """Refuse a model whose parameters were created inside ``torch.inference_mode()``: autograd
    cannot record operations on them, so no gradient-based map can be computed. cause: the error autograd raised
    (explainer calls check when one is raised; a method that needs no gradient works with such parameters)."""
    if any(parameter.is_inference() for parameter in model.parameters()):
        raise RuntimeError(
            "the model's parameters were created inside torch.inference_mode() (inference tensors), which "
            "autograd cannot use. Build or load the model outside inference_mode (calling explain inside "
            "inference_mode is fine), or clone its parameters: model.load_state_dict({k: v.clone() for k, v "
            "in model.state_dict().items()}) outside it."
        ) from cause


REDUCED_PRECISIONS = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` computes in on this device type in this thread, or None when it is off."""
    try:
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: one function per device type
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return dtype if enabled else None


def reduced_precision(model: nn.Module, batch: Tensor, modules: Optional[list[nn.Module]] = None) -> Optional[str]:
    """How the model computes when it is not float32/float64: "bfloat16 (torch.autocast)", "float16 (the
    model's dtype)", ...; None when it computes in full precision. modules: ``list(model.modules())``, when the
    caller has it (each module's own parameters are read then, without ``parameters()``'s walk of the tree: 40 µs
    against 250 µs on resnet50). Autocast casts float32 operations only: a float64 model on a float64 (or integer:
    token ids) input computes in float64 inside it."""
    def parameters() -> Iterator[nn.Parameter]:
        return model.parameters() if modules is None else (
            parameter for module in modules for parameter in module._parameters.values() if parameter is not None)

    autocast = autocast_dtype(batch.device.type)
    if autocast in REDUCED_PRECISIONS and not _all_float64(parameters(), batch):  # walked twice only under autocast
        return f"{REDUCED_PRECISIONS[autocast]} (torch.autocast)"
    for parameter in parameters():
        if parameter.dtype in REDUCED_PRECISIONS:
            return f"{REDUCED_PRECISIONS[parameter.dtype]} (the model's dtype)"
    if batch.dtype in REDUCED_PRECISIONS:
        return f"{REDUCED_PRECISIONS[batch.dtype]} (the input's dtype)"
    return None


def _all_float64(parameters: Iterable[nn.Parameter], batch: Tensor) -> bool:
    """Whether every floating-point parameter and the batch (unless it is integer: token ids) are float64, which
    ``torch.autocast`` leaves alone."""
    return ((batch.dtype == torch.float64 or not batch.is_floating_point())
            and all(parameter.dtype == torch.float64 for parameter in parameters if parameter.is_floating_point()))
