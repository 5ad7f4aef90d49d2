"""What this thread's ``explain`` call in progress has run: the batch it explains and the model's passes so far.
Set by the explainers (``explain.methods.base``); read by code the call runs, such as a detector's instance target,
which must know the size of the input whose output it scores."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from .capture import ModelInputError


@dataclass
class PassRecord:
    """The model's passes that ran in an ``explain`` call, so that a later pass that fails can say what ran before.

    images: the images explained (rows of the prepared batch); image_shape: their shape, without the row.
    passes: how many passes of the model have run; shapes: each input shape that ran → its first pass (1, 2, …).
    kept: what targets keep for the call (see ``kept_for_call``).
    """

    images: int
    image_shape: tuple[int, ...]
    passes: int = 0
    shapes: dict[tuple[int, ...], int] = field(default_factory=dict)
    kept: dict[int, tuple[object, Tensor]] = field(default_factory=dict)
    """What a target keeps for the rest of the call, by the target's id (with the target, so that the id stays its
    own): a ``SegmentationTarget``'s pixels predicted as its class on the images explained. Dropped with the record
    when the call ends, so that nothing of a call stays on a target that other calls and threads share."""

    def ran(self, inputs: Tensor) -> None:
        """Count a pass of the model that ran on ``inputs``."""
        self.passes += 1
        self.shapes.setdefault(tuple(inputs.shape), self.passes)

    def failure(self, error: ModelInputError, inputs: Tensor) -> ModelInputError:
        """What to raise for the model's ``error`` on ``inputs`` in the pass after the ones recorded: an error that
        says so where an input of that shape ran earlier in the call (its size is not the cause) or the failed input
        is a batch of copies of the images explained; else ``error`` as it is (it blames the input's size)."""
        shape, rows, failed = tuple(inputs.shape), int(inputs.shape[0]), self.passes + 1
        original = f"{type(error.model_error).__name__}: {str(error.model_error).strip().splitlines()[0]}" \
            if str(error.model_error).strip() else type(error.model_error).__name__
        if shape in self.shapes:
            text = (f"the model failed on pass {failed} of this call, on an input of shape {shape}, the shape it ran "
                    f"on in pass {self.shapes[shape]} of the same call: {original}. So its size is not the cause: the "
                    "model fails on a later pass of the same shape, as a forward that changes its own state or "
                    "counts its calls does, or one that fails only with gradients on (the method's passes differ in "
                    "that). Make the model's forward give the same result whenever it is called.")
        elif shape[1:] == self.image_shape and rows != self.images:
            images = "the image" if self.images == 1 else f"the {self.images} images"
            copies = (f"a batch of {rows} rows (the method's copies of {images} explained, each row of shape "
                      f"{self.image_shape}")
            fixed_rows = ("If the model takes only a fixed number of rows (a forward that reshapes to batch size 1, or "
                          "keeps per-image state), pass batch_size= where the method takes it, or make the forward "
                          "take any number of rows.")
            earlier = [(first, ran) for ran, first in self.shapes.items() if ran[1:] == self.image_shape]
            if not earlier:  # nothing of this shape ran: the size may be the cause, as the error says
                text = f"{error} The input was {copies}). {fixed_rows}"
            else:
                text = (f"the model failed on pass {failed} of this call, {copies}; an input of shape {earlier[0][1]} "
                        f"ran in pass {earlier[0][0]} of this call): {original}. {fixed_rows}")
        else:
            return error
        failure = ModelInputError(text)
        failure.model_error = error.model_error
        return failure


call_passes = threading.local()
"""``record``: the ``PassRecord`` of this thread's ``explain`` call in progress (None outside one)."""


def explained_batch_shape() -> Optional[tuple[int, ...]]:
    """The shape (N, C, H, W) of the batch of this thread's ``explain`` call in progress, or None outside one."""
    record: Optional[PassRecord] = getattr(call_passes, "record", None)
    if record is None or len(record.image_shape) < 2:
        return None
    return (record.images, *record.image_shape)


def kept_for_call(target: object) -> Optional[Tensor]:
    """What ``target`` kept for this thread's ``explain`` call in progress (``keep_for_call``), or None."""
    record: Optional[PassRecord] = getattr(call_passes, "record", None)
    kept = None if record is None else record.kept.get(id(target))
    return None if kept is None else kept[1]


def keep_for_call(target: object, value: Tensor) -> None:
    """Keep ``value`` for ``target`` until this thread's ``explain`` call in progress ends (nothing outside one)."""
    record: Optional[PassRecord] = getattr(call_passes, "record", None)
    if record is not None:
        record.kept[id(target)] = (target, value)
