"""Methods made for object detectors, explaining one detected instance per map: ODAM (gradients) and D-RISE
(random masks). Every other method explains instances too, through ``explain(image, instances=...)``."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import Unpack

from ..core.capture import model_dtype
from ..core.targets import SelectedTargets, Target, select_targets
from ..detection.instances import QUANTITIES, InstanceSpec, InstanceTarget
from ..io.loaded_model import ModelSource
from .base import Explainer
from .cam import CAM, CAMOptions, TargetLayers, required
from .maps import Attribution, flags_of
from .options import int_option, number_option, random_generator, seed_option
from .passes import checked_batch_size
from .registry import register
from .signatures import ExplainerOptions


def _instance_target(target: Target, method: str) -> InstanceTarget:
    if not isinstance(target, InstanceTarget):
        raise ValueError(f"{method} explains detected instances: call explain(image, instances='all' | k | a score "
                         "threshold | boxes), or pass target=explain.detection.InstanceTarget(...).")
    return target


@register
class ODAM(CAM):
    """ODAM (Zhao et al., ICLR 2023): one map per detected instance, ReLU(Σ_k G_k ⊙ A_k) with G = ∂y/∂A the
    element-wise gradient of the instance's scalar y at the layer's feature maps A (no pooling of the gradient:
    the weighting is specific to the instance's location), resized to the input and min-max normalised per map.

    quantity: y, "score" (the instance's class score in every forward, ``explain.detection.InstanceTarget``) or one
        coordinate of its box, "x0", "y0", "x1", "y1" (the paper's box maps; the authors differentiate the box head's
        outputs, here the decoded coordinate in input pixels; a torchvision box clipped to an image side keeps the
        gradient of its unclipped coordinate, the regression's). layer: the feature maps, e.g. the FPN level or head
        input the instance is detected at (the authors take the detection's own level).
    Call ``explain(image, instances=...)``, or give ``target=explain.detection.InstanceTarget(...)``, whose own
    ``quantity`` is then explained (one that differs from a ``quantity`` other than "score" given here is refused).
    The authors' training loss and ODAM-NMS are not part of the explanation. Other keyword arguments: see ``CAM``
    (``normalize`` defaults to "minmax", as the authors').
    """

    name = "odam"
    explains_instances = True
    summary = "ODAM: per-instance element-wise gradient × activation maps for object detectors"

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, quantity: str = "score",
                 **options: Unpack[CAMOptions]):
        if quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {', '.join(QUANTITIES)}; got {quantity!r}.")
        options.setdefault("normalize", "minmax")
        super().__init__(model, layer, **options)
        self.quantity = quantity

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        return required(gradients) * activations

    def reads_pixel_gradients(self) -> bool:
        """Its gradients are used element by element, not averaged: reduced precision changes them materially."""
        return True

    def instance_target(self, batch: Tensor, instances: InstanceSpec) -> InstanceTarget:
        target = super().instance_target(batch, instances)
        target.quantity = self.quantity
        return target

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        given = _instance_target(target, self.method_name)
        if self.quantity != "score" and given.quantity != self.quantity:
            raise ValueError(f"{self.method_name} was made with quantity={self.quantity!r}, and the InstanceTarget "
                             f"given explains quantity={given.quantity!r}: give the quantity once, to the target "
                             f"(InstanceTarget(..., quantity={self.quantity!r})) or to {self.method_name} with "
                             "instances=.")
        attribution = super().attribute(batch, target, topk)  # (torchvision's boxes: before they are clipped)
        if given.quantity != "score":
            _blame_the_border(attribution, given.quantity, batch.shape[-2:])
        return attribution


def _blame_the_border(attribution: Attribution, quantity: str, size: Sequence[int]) -> None:
    """An empty map of a box coordinate that lies on the image's border (0 or the side) is said to come from the
    detector clipping its boxes there (the coordinate a constant, its gradient 0), not from a zero-initialised
    head."""
    side = size[-1] if quantity.startswith("x") else size[-2]
    values = attribution.selected.scores.detach().cpu()
    on_border = (values == 0) | (values == side)  # where clipping puts a coordinate
    if not on_border.any():
        return
    zero_gradient = attribution.zero_gradient
    if zero_gradient is not None:
        attribution.zero_gradient = lambda: flags_of(zero_gradient).cpu() & ~on_border  # type: ignore[union-attr]
    attribution.empty_reason = (
        f"the instance's {quantity} lies on the image's border (0 or {side}), where a detector that clips its boxes "
        f"to the image puts it: a clipped {quantity} is a constant whose gradient is 0 (explain "
        "reads torchvision's boxes before clipping; this detector clips them itself). Explain quantity='score' or "
        "the box's other coordinates, or return the boxes before clipping (the map is also zero where the layer's "
        "activations are all zero)")


def rise_masks(count: int, grid: int, probability: float, size: Sequence[int], generator: torch.Generator,
               device: torch.device) -> Tensor:
    """RISE's masks (Petsiuk et al. 2018), as D-RISE uses them: each a ``grid`` × ``grid`` binary grid, each cell 1
    with ``probability``, upsampled bilinearly to (grid + 1) cells of ⌈H / grid⌉ × ⌈W / grid⌉ pixels and cropped to
    (H, W) at a random offset within one cell. Returns (count, H, W) float in [0, 1] on ``device``; the grids and
    offsets are drawn from ``generator`` (on the CPU) in that order."""
    height, width = int(size[0]), int(size[1])
    cell_height, cell_width = math.ceil(height / grid), math.ceil(width / grid)
    cells = (torch.rand(count, grid, grid, generator=generator) < probability).float()
    offsets_y = torch.randint(0, cell_height, (count,), generator=generator)
    offsets_x = torch.randint(0, cell_width, (count,), generator=generator)
    upsampled = F.interpolate(cells[:, None].to(device), size=((grid + 1) * cell_height, (grid + 1) * cell_width),
                              mode="bilinear", align_corners=False)[:, 0]
    return torch.stack([upsampled[index, int(y):int(y) + height, int(x):int(x) + width]
                        for index, (y, x) in enumerate(zip(offsets_y, offsets_x))])


@register
class DRISE(Explainer):
    """D-RISE (Petsiuk et al., CVPR 2021): one map per detected instance, Σ_i w_i M_i over random masks M_i, each
    weighted by how well the detector still finds the instance in the masked image: w_i = max_j s(d, d_j), D-RISE's
    similarity of the instance d to each candidate d_j of the masked image (IoU of the boxes × cosine of the class
    vectors × objectness; ``explain.detection.InstanceTarget.similarity``, candidates before NMS where the detector
    has a stage before it).

    masks: how many (the paper: 5000; the map's noise falls as 1/√masks). grid: the cells per side of a mask (16).
    probability: of a cell being kept (0.5). fill: the masked pixels' value, "black" (the model input of a black
    pixel, from the preprocessing's mean and std when it has them, else 0, as the paper masks images; 0 for
    torchvision's and Ultralytics' detectors without a stated preprocess: they take [0, 1] pixels) or a number
    in the model's input space. seed: the masks' generator seed (the same masks on every call). batch_size: masked
    images per forward pass (None: chosen for the device).
    Call ``explain(image, instances=...)``. Maps are ≥ 0, one forward pass per mask and image, no gradient.
    """

    name = "drise"
    explains_instances = True
    summary = "D-RISE: black-box per-instance maps for object detectors from randomly masked images"
    uses_gradients = False

    def __init__(self, model: ModelSource, *, masks: int = 1000, grid: int = 16, probability: float = 0.5,
                 fill: Any = "black", seed: int = 0, batch_size: Optional[int] = None,
                 **options: Unpack[ExplainerOptions]):
        super().__init__(model, **options)
        self.masks = int_option("masks", masks, 1)
        self.grid = int_option("grid", grid, 1)
        self.probability = number_option("probability", probability, minimum=0.0, allow_minimum=False)
        if self.probability > 1:
            raise ValueError(f"probability must be in (0, 1]; got {probability!r}.")
        if not (fill == "black" or (isinstance(fill, (int, float)) and not isinstance(fill, bool)
                                    and math.isfinite(fill))):
            raise ValueError(f"fill must be 'black' or a finite number (the masked pixels' model input); got {fill!r}.")
        self.fill = fill
        self.seed = seed_option(seed)
        self.batch_size = checked_batch_size(batch_size)

    def mask_set(self, size: Sequence[int], device: torch.device) -> Tensor:
        """The (masks, H, W) masks of a call on inputs of ``size``: the same on every call for an int ``seed``,
        fresh draws for None."""
        generator = random_generator(self.seed, torch.device("cpu"))
        return rise_masks(self.masks, self.grid, self.probability, size, generator, device)

    def fill_values(self, channels: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """(C, 1, 1): the model input of a masked pixel."""
        if self.fill != "black":
            return torch.full((channels, 1, 1), float(self.fill), device=device, dtype=dtype)
        mean, std = getattr(self.preprocess, "mean", None), getattr(self.preprocess, "std", None)
        if mean is None or std is None:
            return torch.zeros(channels, 1, 1, device=device, dtype=dtype)
        black = (0 - torch.as_tensor(mean, dtype=torch.float64)) / torch.as_tensor(std, dtype=torch.float64)
        return black.reshape(-1, 1, 1).expand(channels, 1, 1).to(device, dtype)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        instance_target = _instance_target(target, self.method_name)
        if instance_target.quantity != "score":
            raise ValueError(f"{self.method_name} weighs each mask by the instance's similarity to the masked image's "
                             f"detections, not by its {instance_target.quantity}: give an InstanceTarget of "
                             "quantity='score', or explain a box coordinate with ODAM(model, layer, "
                             f"quantity={instance_target.quantity!r}).")
        count, channels, height, width = batch.shape
        with torch.no_grad():
            selected: SelectedTargets = select_targets(self.call_model(batch), instance_target, batch_size=count)
            masks = self.mask_set((height, width), batch.device)
            fill = self.fill_values(channels, batch.device, model_dtype(self.model))
            instances = instance_target.instances.count
            present = instance_target.instances.present.to(batch.device, torch.float32)  # (N, K)
            saliency = torch.zeros(count, instances, height, width, dtype=torch.float64, device=batch.device)
            for image in range(count):
                def weights_of(chunk: slice, image: int = image) -> Tensor:
                    chunk_masks = masks[chunk, None].to(batch.dtype)  # (R, 1, H, W)
                    masked = batch[image] * chunk_masks + fill.to(batch.dtype) * (1 - chunk_masks)
                    candidates = instance_target.candidates(self.call_model(masked))
                    rows = torch.full((masked.shape[0],), image, dtype=torch.long, device=batch.device)
                    similarity, _ = instance_target.similarity(candidates, rows, gated=False)  # (R, K, P)
                    if similarity.shape[-1] == 0:
                        return similarity.new_zeros(similarity.shape[:2])
                    return similarity.amax(dim=-1) * present[image]  # (R, K); padding: no map
                for chunk, weights in self.row_passes(self.masks, self.batch_size, batch.device, weights_of,
                                                      batch.shape[1:].numel()):
                    saliency[image] += torch.einsum("rk,rhw->khw", weights.double(), masks[chunk].double())
        return Attribution(maps=saliency.float(), selected=selected, nonnegative_maps=True,
                           empty_reason=f"no candidate of the detector overlapped the instance's box (IoU > 0) with a "
                           f"score for its class in any of the {self.masks} masked images (D-RISE's weights are not "
                           "gated by min_iou): use more masks (masks=) or keep more of the image (probability=)")
