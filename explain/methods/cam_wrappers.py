"""Methods built on another CAM: Finer-CAM (what sets a class apart from the classes most like it) and
SESS (the CAM of many windows of the image at several scales, fused)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import Unpack

from ..core.targets import SelectedTargets, Target, select_targets
from ..detection.instances import InstanceSpec, InstanceTarget
from ..io.blur import gaussian_blur
from ..io.loaded_model import ModelSource, loaded_model_parts
from .base import Explainer
from .cam import CAM, CAMOptions, GradCAM, TargetLayers
from .maps import Attribution, normalize_maps
from .options import int_option, number_option
from .perturbation import PerturbationCAM
from .registry import register
from .signatures import ExplainerOptions

CAM_ONLY_OPTIONS = ("relu", "combine", "normalize_layers", "smooth", "reshape")


def wrapped_cam(model: ModelSource, layer: TargetLayers, cam: object, options: dict[str, Any], wrapper: str,
                output: Any) -> Explainer:
    """The explainer a wrapper runs: ``cam`` built on ``model`` and ``layer`` when it is a CAM class (with
    the CAM options, raw maps), or ``cam`` itself when it is an explainer of the same model."""
    cam_options = {key: options.pop(key) for key in CAM_ONLY_OPTIONS if key in options}
    if isinstance(cam, Explainer):
        if cam.model is not loaded_model_parts(model)[0]:  # a LoadedModel's module
            raise ValueError(f"the explainer given to {wrapper} must be built on the same model.")
        if cam_options:
            raise ValueError(f"{sorted(cam_options)} are options of the CAM that {wrapper} builds; give them to the "
                             f"CAM instance passed as cam= instead.")
        return cam
    if isinstance(cam, type) and issubclass(cam, CAM):
        return cam(model, layer, normalize=None, output=output, progress=False, **cam_options)
    raise TypeError(f"cam must be a CAM class (such as explain.GradCAM) or an explainer built on the model; "
                    f"got {cam!r}.")


class FinerTarget:
    """Finer-CAM's score of class c against the classes d_1 … d_J the model finds most like it:
    Σ_j p_j (y_c − α y_dj) / (Σ_j p_j + 1e-9), p = softmax(y), for each of N images and K targets.

    classes: (N, K) class indices c; compared: (N, K, J) class indices d; alpha: α.
    Called on the (N, classes) output of the N images (or of copies of them, one per image, in order).
    """

    def __init__(self, classes: Tensor, compared: Tensor, alpha: float):
        self.classes, self.compared, self.alpha = classes, compared, alpha

    def __call__(self, output: Tensor) -> Tensor:
        count, targets, others = self.compared.shape
        if not isinstance(output, Tensor) or output.dim() != 2 or output.shape[0] != count:
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"Finer-CAM's target scores the (N, classes) output of the {count} images explained; "
                             f"got {shape}. Run Finer-CAM on the images themselves, not on perturbed copies.")
        classes, compared = self.classes.to(output.device), self.compared.to(output.device)
        scores = output.gather(1, classes)  # (N, K)
        compared_scores = output.gather(1, compared.flatten(1)).view(count, targets, others)
        weights = output.softmax(dim=1).gather(1, compared.flatten(1)).view(count, targets, others)
        numerator = (weights * (scores[..., None] - self.alpha * compared_scores)).sum(dim=2)
        return numerator / (weights.sum(dim=2) + 1e-9)


def most_similar_classes(logits: Tensor, classes: Tensor, ranks: Sequence[int]) -> Tensor:
    """(N, K, J) the classes at similarity ranks ``ranks`` (1: the closest) to each target class: the other
    classes ordered by |y_d − y_c|, the logit's distance to the target's (ties in class order)."""
    main = logits.gather(1, classes)  # (N, K)
    distance = (logits[:, None, :] - main[..., None]).abs()  # (N, K, classes)
    distance.scatter_(2, classes[..., None], -1.0)  # the class itself comes first (rank 0)
    order = distance.argsort(dim=2, stable=True)
    return order[..., list(ranks)]


@register
class FinerCAM(Explainer):
    """Finer-CAM (Zhang et al. 2025): the CAM of a class's score taken relative to the classes the model
    finds most like it, so that the map shows what sets the class apart (fine-grained classes) rather
    than what they share. The explained score, for target class c and compared classes d_j (the
    classes whose logits are closest to y_c, ranks ``similar``), is
    Σ_j p_j (y_c − α y_dj) / Σ_j p_j with p = softmax(y), as pytorch-grad-cam 1.5.7's
    ``FinerWeightedTarget``; α = 0 gives the CAM of y_c itself.

    layer: the CAM's layer (None: chosen on the first call). cam: the CAM method, a class (default
        GradCAM, built with the CAM options given here) or a CAM built on the same model.
    alpha: α, how strongly the compared classes are subtracted (default 1).
    similar: the similarity ranks of the compared classes (default (1, 2, 3): the three closest other
        classes); ranks beyond the model's other classes are left out, as pytorch-grad-cam does.
    Targets are classes (an int, one per image, K per image, or topk; default the top class); the
    compared classes are chosen on each image's own output and recorded in ``diagnostics["compared_classes"]``
    (N, K, J). The Explanation's scores are the Finer scores explained.
    """

    name = "finercam"
    summary = "Finer-CAM: a CAM of the class's score against the most similar classes (fine-grained differences)"
    needs_layer = True
    scores_are_outputs = False
    records_the_forward = False  # the wrapped CAM checks the model for itself

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, cam: Union[type[CAM], CAM] = GradCAM,
                 alpha: float = 1.0, similar: Sequence[int] = (1, 2, 3), **options: Unpack[CAMOptions]):
        own: dict[str, Any] = dict(options)
        self.cam = wrapped_cam(model, layer, cam, own, "FinerCAM", own.get("output"))
        shared: ExplainerOptions = own  # type: ignore[assignment]  # the CAM options were taken out
        super().__init__(model, **shared)
        if not isinstance(self.cam, CAM) or not self.cam.uses_gradients or isinstance(self.cam, PerturbationCAM):
            raise ValueError(f"Finer-CAM needs a CAM that differentiates the score (GradCAM, GradCAMPlusPlus, "
                             f"LayerCAM, HiResCAM, ...); {type(self.cam).__name__} does not.")
        self.alpha = number_option("alpha", alpha, minimum=-float("inf"))
        if isinstance(similar, (str, bytes)) or not isinstance(similar, Sequence) or not similar:
            raise ValueError(f"similar must be a sequence of similarity ranks (1: the closest class); got {similar!r}.")
        self.similar = [int_option("each rank in similar", rank, 1) for rank in similar]

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        with torch.no_grad():
            output = self.call_model(batch)
        main = select_targets(output, target, topk, batch_size=batch.shape[0])
        if main.class_indices is None:
            raise ValueError("Finer-CAM compares a class with the classes most like it, so its targets are classes "
                             "(an int, one per image, K per image, or topk), not a callable.")
        logits = output.detach().float()
        ranks = [rank for rank in self.similar if rank < logits.shape[1]]
        if not ranks:
            raise ValueError(f"the model has {logits.shape[1]} class(es): no other class to compare with at ranks "
                             f"{self.similar}.")
        classes = main.class_indices.to(logits.device)
        compared = most_similar_classes(logits, classes, ranks)
        finer = FinerTarget(classes, compared, self.alpha)
        self.cam._forward_call = self._forward_call
        try:
            inner = self.cam.attribute(batch, finer, None)
        finally:
            self.cam._forward_call = None
        inner.selected = SelectedTargets(scores=inner.selected.scores, class_indices=main.class_indices,
                                         keep_target_dim=main.keep_target_dim, probabilities=main.probabilities)
        inner.diagnostics["compared_classes"] = compared
        return inner


POOLS = ("mean", "max")

INSTANCES_REFUSED = (
    "SESS cannot explain detected instances (instances= or an InstanceTarget): it scores the target on windows of "
    "the image, resized at several scales, where an instance's box, in the image's own pixels, matches the wrong "
    "detection or none. Explain instances with a method that runs the detector on the whole image: explain.GradCAM, "
    "explain.ODAM, explain.DRISE or explain.Saliency.")


@register
class SESS(Explainer):
    """SESS, saliency enhancing with scaling and sliding (Tursun et al. 2022): the image is resized so that
    its shorter side takes each of several ``scales``, a square window slides over each resized image,
    and the CAM of every window is computed, min-max normalised to [0, 1], weighted by the window's score
    for the target divided by the highest window's, pasted back where the window was and resized to
    the image; the pasted maps are fused by a weighted average over the windows that cover a pixel
    with a value above ``theta`` ("mean") or by their maximum ("max"), then blurred. Robust to scale
    and to several instances of the class; as pytorch-grad-cam 1.5.7's SESS.

    layer: the CAM's layer. cam: the CAM method, a class (default GradCAM) or an explainer built on the
        model (any method of the toolkit).
    scales: the shorter side's sizes, each ≥ the window; default ``num_scales`` sizes from the window up
        in steps of round(``scale_step`` × window) (the paper's 224, 288, … for 224 px).
    window: the window's side (default the image's shorter side: the first scale is the image itself);
        stride: its step (default the window; the last window of a row or column is moved back inside).
    pre_filter: the share of the lowest-scoring windows left out (in [0, 1)); theta: the threshold of
        "mean" fusion; pool: "mean" or "max"; blur: a Gaussian blur (11 × 11 taps, σ = 5 pixels, edges
        reflected) of the fused map; softmax_scores: a window's score is the class's softmax probability
        (the paper) rather than its logit (both clipped at 0; callable targets score the raw output).
    batch_size: windows per pass, for the scores and for the CAMs.
    Detected instances (``instances=``, an ``InstanceTarget``) are refused: their boxes are in the image's pixels,
    not in a window's.
    Costs one CAM per window: 150 windows of 224 px at the default 12 scales of a 224 px image.
    """

    name = "sess"
    summary = "SESS: a CAM of windows of the image at several scales, fused (robust to scale and repeats)"
    needs_layer = True
    records_the_forward = False  # the wrapped CAM checks the model for itself

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, cam: Union[type[CAM], Explainer] = GradCAM,
                 scales: Optional[Sequence[int]] = None, num_scales: int = 12, scale_step: float = 2 / 7,
                 window: Optional[int] = None, stride: Optional[int] = None, pre_filter: float = 0.0,
                 theta: float = 0.0, pool: str = "mean", blur: bool = True, softmax_scores: bool = True,
                 batch_size: int = 32, **options: Unpack[CAMOptions]):
        own: dict[str, Any] = dict(options)
        self.cam = wrapped_cam(model, layer, cam, own, "SESS", own.get("output"))
        shared: ExplainerOptions = own  # type: ignore[assignment]  # the CAM options were taken out
        super().__init__(model, **shared)
        if scales is not None:
            if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence) or not scales:
                raise ValueError(f"scales must be a sequence of sizes in pixels; got {scales!r}.")
            scales = [int_option("each of scales", scale, 1) for scale in scales]
        self.scales = scales
        self.num_scales = int_option("num_scales", num_scales, 1)
        self.scale_step = number_option("scale_step", scale_step)
        self.window = None if window is None else int_option("window", window, 1)
        self.stride = None if stride is None else int_option("stride", stride, 1)
        self.pre_filter = number_option("pre_filter", pre_filter)
        if self.pre_filter >= 1:
            raise ValueError(f"pre_filter must be a share in [0, 1); got {pre_filter!r}.")
        self.theta = number_option("theta", theta, minimum=-float("inf"))
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}; got {pool!r}.")
        self.pool, self.blur, self.softmax_scores = pool, bool(blur), bool(softmax_scores)
        self.batch_size = int_option("batch_size", batch_size, 1)

    def reads_pixel_gradients(self) -> bool:
        return self.cam.reads_pixel_gradients()

    def instance_target(self, batch: Tensor, instances: InstanceSpec) -> InstanceTarget:
        """Refused, before the detector runs: instances cannot be found in windows (``INSTANCES_REFUSED``)."""
        raise ValueError(INSTANCES_REFUSED)

    def scales_for(self, window: int) -> list[int]:
        """The shorter side's sizes, each checked to be at least the window."""
        step = round(window * self.scale_step)
        scales = self.scales or [window + step * index for index in range(self.num_scales)]
        too_small = [scale for scale in scales if scale < window]
        if too_small:
            raise ValueError(f"every scale must be at least the window, {window} px; got {too_small}.")
        return list(scales)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        if isinstance(target, InstanceTarget):
            raise ValueError(INSTANCES_REFUSED)
        count, _, height, width = batch.shape
        with torch.no_grad():
            output = self.call_model(batch)
        selected = select_targets(output, target, topk, batch_size=count)
        window = self.window or min(height, width)
        if window > min(height, width):
            raise ValueError(f"window ({window} px) must fit in the image ({height} × {width}).")
        stride = self.stride or window
        scales = self.scales_for(window)
        maps = torch.zeros(count, selected.scores.shape[1], height, width, device=batch.device)
        with self.progress_bar(count * len(scales), count * len(scales), "scale") as bar:
            for image in range(count):
                windows, places = self.windows(batch[image: image + 1], scales, window, stride)
                for index in range(selected.scores.shape[1]):
                    maps[image, index] = self.fused_map(windows, places, image, index, selected, (height, width))
                bar.update(len(scales))
        return Attribution(maps=maps, selected=selected, layer=getattr(self.cam, "layer_names", None))

    def windows(self, image: Tensor, scales: Sequence[int], window: int, stride: int
                ) -> tuple[Tensor, list[tuple[int, int, int, int]]]:
        """The windows of one image (1, C, H, W) at every scale: (P, C, window, window) and, per window,
        (top, left, resized height, resized width)."""
        height, width = image.shape[-2:]
        crops: list[Tensor] = []
        places: list[tuple[int, int, int, int]] = []
        for scale in scales:
            if height <= width:
                size = (scale, int(scale * width / height))
            else:
                size = (int(scale * height / width), scale)
            resized = F.interpolate(image, size=size, mode="bilinear", align_corners=False, antialias=True)
            for top in window_starts(size[0], stride, window):
                for left in window_starts(size[1], stride, window):
                    crops.append(resized[:, :, top: top + window, left: left + window])
                    places.append((top, left, *size))
        return torch.cat(crops), places

    def fused_map(self, windows: Tensor, places: list[tuple[int, int, int, int]], image: int, index: int,
                  selected: SelectedTargets, size: tuple[int, int]) -> Tensor:
        """(H, W): the fused map of one image's windows for its target ``index``."""
        rows = torch.full((len(windows),), image, dtype=torch.long, device=windows.device)
        scores = torch.cat([self.window_scores(windows[part], rows[part], selected)[:, index]
                            for part in self.parts(len(windows))]).clamp_min(0)
        order = scores.argsort(stable=True)[int(len(scores) * self.pre_filter):]
        best = scores[order[-1]]
        weights = scores[order] / best if best > 0 else torch.ones(len(order), device=scores.device)
        fixed: Target = (selected.target_function if selected.target_function is not None
                         else selected.class_indices[image: image + 1, index: index + 1])  # type: ignore[index]
        total = torch.zeros(size, device=windows.device)
        covered = torch.zeros(size, device=windows.device)
        for part in self.parts(len(order)):
            chosen = order[part]
            cams = self.window_cams(windows[chosen], rows[chosen], fixed) * weights[part, None, None]
            for cam, place in zip(cams, (places[int(i)] for i in chosen)):
                pasted = pasted_back(cam, place, size)
                if self.pool == "max":
                    total = torch.maximum(total, pasted)
                else:
                    counted = pasted > self.theta
                    total += torch.where(counted, pasted, 0.0)
                    covered += counted
        fused = total if self.pool == "max" else torch.where(covered > 0, total / covered.clamp_min(1), 0.0)
        if self.blur:
            fused = gaussian_blur(fused[None, None], 5.0, boundary="reflect", radii=5)[0, 0]
        return fused

    def parts(self, count: int) -> list[slice]:
        return [slice(start, min(start + self.batch_size, count)) for start in range(0, count, self.batch_size)]

    def window_scores(self, windows: Tensor, rows: Tensor, selected: SelectedTargets) -> Tensor:
        """(R, K) the targets' scores on windows (R, C, w, w), row r a window of image ``rows[r]``."""
        with torch.no_grad():
            output = self.call_model(windows, rows=rows)
            if self.softmax_scores and selected.target_function is None:
                output = output.float().softmax(dim=1)
            return selected.scores_for(output, rows).float()

    def window_cams(self, windows: Tensor, rows: Tensor, target: Target) -> Tensor:
        """(R, w, w): the wrapped CAM of each window, resized to the window and min-max normalised."""
        call = self._forward_call
        self.cam._forward_call = None if call is None else call.for_rows(rows)
        try:
            fixed = target if callable(target) else target.expand(len(windows), -1)  # type: ignore[union-attr]
            maps = self.cam.attribute(windows, fixed, None).maps.detach().float()[:, :1]
        finally:
            self.cam._forward_call = None
        # normalised before and after resizing: the map's minimum is an exact 0, which "mean" fusion leaves out
        resized = F.interpolate(normalize_maps(maps, "minmax"), size=windows.shape[-2:], mode="bilinear",
                                align_corners=False)
        return normalize_maps(resized, "minmax")[:, 0]


def window_starts(length: int, stride: int, window: int) -> list[int]:
    """The first pixel of each window along a side of ``length``: every ``stride`` pixels, the last one
    moved back so that it ends at the side's end."""
    starts = []
    for start in range(0, length, stride):
        if start + window >= length:
            starts.append(max(length - window, 0))
            break
        starts.append(start)
    return starts


def pasted_back(cam: Tensor, place: tuple[int, int, int, int], size: tuple[int, int]) -> Tensor:
    """(H, W): a window's map (w, w) placed at (top, left) of its resized image (zeros elsewhere), the
    whole resized to the image's ``size`` (bilinear)."""
    top, left, resized_height, resized_width = place
    canvas = cam.new_zeros(resized_height, resized_width)
    canvas[top: top + cam.shape[0], left: left + cam.shape[1]] = cam
    return F.interpolate(canvas[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
