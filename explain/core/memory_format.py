"""The memory layout in which the toolkit hands a batch to the model.

On the CPU, PyTorch's oneDNN convolutions run forward and backward faster on a channels-last
batch (the same values, stored pixel by pixel instead of plane by plane) once the batch holds a
few rows: from 4 rows, 0.62–0.87× the time on resnet18/50, vgg11, densenet121, mobilenet_v3 and
efficientnet_b0 (convnext and ViT level), while at 1–2 rows resnet18's forward ran 1.45× and 1.16×
slower (``benchmarks/memory_format.py``, table in benchmarks/RESULTS.md). Small images run slower
channels-last too: at 32 and 64 px resnet18's and resnet50's forward and gradient took 1.07–1.72× the
time, at 112 px 0.89–1.28×, from 160 px 0.76–1.03× (RESULTS.md, "Memory layout of the model's input by
image size"). So the copy of the batch that every method makes for the model's forward is made
channels-last where that was measured faster: on the CPU, a float32 or bfloat16 4-D batch of at least
``CHANNELS_LAST_MIN_ROWS`` rows of at least ``CHANNELS_LAST_MIN_PIXELS`` pixels, for a model with 2-D
convolutions. The model itself (parameters, buffers) is never touched, and maps,
scores and gradients have the same values up to float rounding.

A model whose forward refuses that layout (a ``.view`` of a tensor that is not contiguous, an
``assert x.is_contiguous()``, an extension that wants contiguous memory) raises; when a call that
gave the model a channels-last batch fails inside the model (or with an error about strides or
contiguity), the call is run once more with the usual layout (``usual_layout_only``): such a model
gets the map, or the error, it would have got without this. A model that silently reads memory by
its own strides (``torch.as_strided`` written for contiguous tensors) cannot be told apart: explain
it inside ``usual_layout_only()``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

from .capture import ModelInputError, error_chain

CHANNELS_LAST_MIN_ROWS = 4
"""The fewest rows a batch needs before it is given to the model channels-last (CPU only)."""

CHANNELS_LAST_MIN_PIXELS = 128 * 128
"""The fewest pixels (height × width) an image of the batch needs before the batch is given to the model
channels-last (CPU only)."""

CHANNELS_LAST_DTYPES = (torch.float32, torch.bfloat16)
"""The input dtypes for which oneDNN runs channels-last convolutions (float64 has no such kernels)."""

_LAYOUT_WORDS = ("stride", "contiguous", "view size is not compatible")

_thread = threading.local()


@contextmanager
def usual_layout_only() -> Iterator[None]:
    """Within the block, on this thread, every batch goes to the model in the usual (contiguous) layout."""
    previous = getattr(_thread, "usual_only", False)
    _thread.usual_only = True
    try:
        yield
    finally:
        _thread.usual_only = previous


def has_convolutions(model: nn.Module) -> bool:
    """Whether the model contains a 2-D convolution (which a channels-last batch speeds up)."""
    return any(isinstance(module, nn.Conv2d) for module in model.modules())


def wants_channels_last(model: nn.Module, inputs: Tensor) -> bool:
    """Whether a batch is given to this model channels-last (see the module's docstring)."""
    return (
        not getattr(_thread, "usual_only", False)
        and inputs.device.type == "cpu"
        and inputs.dim() == 4
        and inputs.shape[0] >= CHANNELS_LAST_MIN_ROWS
        and inputs.shape[-2] * inputs.shape[-1] >= CHANNELS_LAST_MIN_PIXELS
        and inputs.dtype in CHANNELS_LAST_DTYPES
        and has_convolutions(model)
    )


def model_batch(model: nn.Module, inputs: Tensor) -> Tensor:
    """A copy of ``inputs`` for one forward of ``model`` (inside the autograd graph when ``inputs``
    requires grad), in the memory layout that runs fastest: channels-last where
    ``wants_channels_last``, else contiguous, whatever layout ``inputs`` has (a NumPy (N, H, W, C) array
    transposed to (N, C, H, W) gives the maps its contiguous copy gives, to the last bit). Same shape,
    dtype, device and values."""
    if wants_channels_last(model, inputs):
        _thread.channels_last_copies = channels_last_copies() + 1
        return inputs.clone(memory_format=torch.channels_last)
    return inputs.clone(memory_format=torch.contiguous_format)


def channels_last_copies() -> int:
    """How many channels-last batches this thread has given to a model so far (to tell whether a
    failed call used one)."""
    return getattr(_thread, "channels_last_copies", 0)


def may_be_layout_error(error: BaseException) -> bool:
    """Whether an error could come from a model refusing a channels-last batch: the model itself failed
    (a ``ModelInputError`` anywhere in the chain, whatever its message: a bare ``assert
    x.is_contiguous()`` says nothing) or an error mentions strides or contiguity. Chains that loop
    back on themselves are walked once."""
    return any(isinstance(seen, ModelInputError) or any(word in str(seen) for word in _LAYOUT_WORDS)
               for seen in error_chain(error))
