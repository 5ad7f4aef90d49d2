"""Turn "what to explain" (a class, top-k classes, a callable) into one scalar per image and target."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

Target = Union[None, int, Sequence[int], Sequence[Sequence[int]], Tensor, Callable[[Any], Tensor]]
"""What to explain for each image.

- ``None``: the top-1 class of each image;
- an ``int``: that class for every image;
- a sequence of N ints: one class per image;
- a sequence of N sequences of K ints (or an (N, K) tensor): K classes per image;
- a callable ``f(output) -> Tensor[N]`` (or ``Tensor[N, K]``): any scalar(s) per image,
  computed from the model's output (segmentation, detection, embedding targets).
  Perturbation methods (Score-CAM, Ablation-CAM) apply it to outputs of batches of
  perturbed copies, so it must score each row of the output on its own.
"""


@dataclass
class SelectedTargets:
    """The scalars to explain, selected from the model's output.

    scores: (N, K) tensor, still connected to the autograd graph when the output is.
    class_indices: (N, K) long tensor of class indices, or None for callable targets.
    keep_target_dim: whether maps keep a K dimension, (N, K, H, W), or drop it, (N, H, W).
    probabilities: (N, K) softmax probabilities of the explained classes, None for callable targets.
    """

    scores: Tensor
    class_indices: Optional[Tensor]
    keep_target_dim: bool
    probabilities: Optional[Tensor] = None
    target_function: Optional[Callable[[Any], Tensor]] = None

    def scores_for(self, output: Any, image_index: Tensor) -> Tensor:
        """The same targets' scores on another forward pass, e.g. of perturbed copies.

        output: the model's output for R rows, row r being a copy of image ``image_index[r]``.
        Returns (R, K). A callable target is applied to the rows as they are, so it must
        score each row on its own.
        """
        if self.target_function is not None:
            scores = self.target_function(output)
            return scores.reshape(scores.shape[0], -1)
        return output.gather(1, self.class_indices[image_index].to(output.device))


def _is_integer(value: object) -> bool:
    return isinstance(value, (Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def _class_index_tensor(target: Any, batch_size: int) -> tuple[Tensor, bool]:
    """(N, K) indices from an int, a sequence of ints or a nested sequence; and whether K is kept."""
    if _is_integer(target):
        return torch.full((batch_size, 1), int(target), dtype=torch.long), False
    try:
        indices = torch.as_tensor(target).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            "target must be None, an int, a sequence of ints (one per image), a sequence of "
            f"sequences of ints (K per image, the same K for all) or a callable; got {target!r}."
        ) from error
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"class targets must be integers; got {target!r}.")
    indices = indices.long()
    if indices.dim() == 0:
        return indices.expand(batch_size).reshape(batch_size, 1).clone(), False
    if indices.dim() > 2:
        raise ValueError(f"class targets have {indices.dim()} dimensions; give at most (N, K).")
    if indices.shape[0] != batch_size:
        raise ValueError(
            f"{indices.shape[0]} targets were given for a batch of {batch_size} images. Give one "
            "target per image, a single int for all images, or target=None for each image's top class."
        )
    if indices.dim() == 1:
        return indices.reshape(batch_size, 1), False
    return indices, True


def select_targets(
    output: Any, target: Target = None, topk: Optional[int] = None, batch_size: Optional[int] = None
) -> SelectedTargets:
    """Select the scalar(s) to explain from a model's output.

    output: the model's output; (N, C) class scores for class targets, anything a
        callable target understands otherwise.
    Returns SelectedTargets with (N, K) scores.
    """
    if callable(target) and not isinstance(target, Tensor):
        if topk is not None:
            raise ValueError("topk selects classes; it cannot be combined with a callable target.")
        scores = target(output)
        if not isinstance(scores, Tensor) or scores.dim() not in (1, 2):
            shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
            raise ValueError(
                f"a target callable must return a tensor of shape (N,) or (N, K); it returned {shape}."
            )
        if batch_size is not None and scores.shape[0] != batch_size:
            raise ValueError(
                f"the target callable returned {scores.shape[0]} scores for a batch of {batch_size} images."
            )
        keep = scores.dim() == 2
        return SelectedTargets(scores.reshape(scores.shape[0], -1), None, keep, target_function=target)

    if not isinstance(output, Tensor) or output.dim() != 2:
        shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise ValueError(
            f"class targets need a model output of shape (N, num_classes); this model returns {shape}. "
            "Pass a callable target, f(output) -> Tensor[N], that selects the score to explain."
        )
    count, num_classes = output.shape
    if batch_size is not None and count != batch_size:
        raise ValueError(f"the model returned {count} rows of scores for a batch of {batch_size} images.")
    if topk is not None:
        if target is not None:
            raise ValueError("give either target or topk, not both.")
        if not _is_integer(topk) or not 1 <= topk <= num_classes:
            raise ValueError(f"topk must be an int between 1 and the number of classes ({num_classes}); got {topk!r}.")
        indices = output.detach().topk(int(topk), dim=1).indices
        keep = True
    elif target is None:
        indices = output.detach().argmax(dim=1, keepdim=True)
        keep = False
    else:
        indices, keep = _class_index_tensor(target, count)
        bad = (indices < 0) | (indices >= num_classes)
        if bad.any():
            raise ValueError(
                f"class index {int(indices[bad][0])} is out of range: the model has {num_classes} "
                f"classes (0 to {num_classes - 1})."
            )
        indices = indices.to(output.device)
    scores = output.gather(1, indices)
    probabilities = output.detach().float().softmax(dim=1).gather(1, indices)
    return SelectedTargets(scores, indices, keep, probabilities)
