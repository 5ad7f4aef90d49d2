"""Deletion and insertion per detected instance, as the D-RISE paper measures a detector's saliency maps.

Petsiuk et al. (CVPR 2021, section 4) adapt RISE's deletion and insertion to detection: the pixels are removed from the
image (deletion) or put back into a blurred copy (insertion) in the order of the instance's map, most relevant first,
and at each step the score is not a class probability but the similarity of the instance to the detections of the
perturbed image: the largest, over the perturbed image's candidates, of D-RISE's similarity
IoU(box) × cos(class vectors) × objectness (the same similarity that weighs D-RISE's masks,
``explain.detection.InstanceTarget.similarity`` without its IoU gate). The area under that curve, over the share of
pixels changed in [0, 1], is the result: lower is better for deletion, higher for insertion.

    e = explain.ODAM(detector, layer).explain(image, instances="all")
    curve = explain.metrics.instance_deletion(detector, image_batch, e)   # curve.area: (M,), one per instance

Rows follow ``instance_boxes``: the M instances present in the explanation, image by image (padding left out).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor, nn

from ..core.capture import preserved_model_state
from ..core.memory_format import model_batch
from ..detection import Instances, InstanceTarget
from ..io.explanation import Explanation
from ..io.inputs import Inputs, PreprocessSpec
from ..io.loaded_model import LoadedModel, loaded_model_parts
from ..methods.options import int_option
from ._common import check_count, model_inputs, ranking
from .faithfulness import Curve, Substrate, _area, check_substrate, step_counts, substrate_for


def _instances_of(explanation: Explanation) -> tuple[Instances, Tensor]:
    """The explanation's instances, and (M, 2) the (image, instance) of each one present."""
    if explanation.boxes is None or explanation.class_indices is None:
        raise ValueError("instance_deletion and instance_insertion take the explanation of detected instances "
                         "(explainer.explain(image, instances=...)); this explanation has no boxes.")
    boxes = explanation.boxes
    present = ~boxes.isnan().any(dim=-1)
    classes = explanation.class_indices.reshape(present.shape).long()
    instances = Instances(torch.nan_to_num(boxes), classes, torch.full(present.shape, float("nan")), present)
    return instances, present.nonzero()


def _similarity_curve(model: Union[nn.Module, LoadedModel], inputs: Inputs, explanation: Explanation, steps: int,
                      insertion: bool, substrate: Substrate, batch_size: int, preprocess: PreprocessSpec) -> Curve:
    int_option("steps", steps, 1)
    int_option("batch_size", batch_size, 1)
    check_substrate(substrate)
    model, preprocess, _, _ = loaded_model_parts(model, preprocess)  # a loaded model: its module and preprocessing
    if not isinstance(model, nn.Module):
        raise TypeError(f"instance_deletion and instance_insertion take the detector (an nn.Module, or what "
                        f"explain.load_model returns); got {type(model).__name__}.")
    batch = model_inputs(model, inputs, preprocess)
    instances, pairs = _instances_of(explanation)
    check_count(instances.present.shape[0], "explained images", batch.shape[0], "images")
    height, width = batch.shape[-2:]
    maps = explanation.map_grid.to(batch.device)
    if tuple(maps.shape[-2:]) != (height, width):
        raise ValueError(f"the explanation's maps are {tuple(maps.shape[-2:])}, the images {(height, width)}: give "
                         "the model-input batch that was explained.")
    target = InstanceTarget(instances, model, (height, width))
    pairs = pairs.to(batch.device)
    fill = substrate_for(batch, substrate)
    ranks = ranking(maps[pairs[:, 0], pairs[:, 1]]).to(batch.device)[:, None]  # (M, 1, H, W), 0 = most relevant
    counts = step_counts(height * width, steps, batch.device)
    rows = torch.arange(pairs.shape[0] * (steps + 1), device=batch.device)
    instance_of_row, step_of_row = rows // (steps + 1), rows % (steps + 1)
    scores: list[Tensor] = []
    with torch.no_grad(), preserved_model_state(model):
        for start in range(0, rows.shape[0], batch_size):
            instance, step = instance_of_row[start: start + batch_size], step_of_row[start: start + batch_size]
            image = pairs[instance, 0]
            changed = ranks[instance] < counts[step].view(-1, 1, 1, 1)  # the most relevant pixels first
            if insertion:  # put back into the substrate
                perturbed = torch.where(changed, batch[image], fill[image])
            else:  # replaced by the substrate
                perturbed = torch.where(changed, fill[image], batch[image])
            candidates = target.candidates(model(model_batch(model, perturbed)))
            similarity, _ = target.similarity(candidates, image, gated=False)  # (R, K, P)
            of_instance = similarity[torch.arange(image.shape[0], device=similarity.device),
                                     pairs[instance, 1].to(similarity.device)]  # (R, P)
            best = of_instance.amax(dim=-1) if of_instance.shape[-1] else of_instance.new_zeros(image.shape[0])
            scores.append(best.float().cpu())
    fractions = (counts / (height * width)).cpu()
    curves = torch.cat(scores).view(pairs.shape[0], steps + 1) if scores else torch.zeros(0, steps + 1)
    return Curve(fractions=fractions, curves=curves, area=_area(fractions, curves))


def instance_deletion(model: Union[nn.Module, LoadedModel], inputs: Inputs, explanation: Explanation, *,
                      steps: int = 16, substrate: Substrate = "zeros", batch_size: int = 16,
                      preprocess: PreprocessSpec = None) -> Curve:
    """D-RISE's deletion per instance: each instance's similarity to the perturbed image's detections as its most
    relevant pixels are replaced by ``substrate`` in ``steps`` equal steps.

    model: the detector explained (a loaded model: its module, and its preprocessing unless ``preprocess`` is
    given); inputs: the images explained (the model-input batch, (N, C, H, W), or what ``preprocess`` takes);
    explanation:
    ``explain(..., instances=...)``'s. Returns a Curve: fractions (steps + 1,), curves (M, steps + 1) similarities
    in [0, 1], area (M,) in [0, 1], lower is better; one row per instance present (``instance_boxes``' order)."""
    return _similarity_curve(model, inputs, explanation, steps, False, substrate, batch_size, preprocess)


def instance_insertion(model: Union[nn.Module, LoadedModel], inputs: Inputs, explanation: Explanation, *,
                       steps: int = 16, substrate: Substrate = "blur", batch_size: int = 16,
                       preprocess: PreprocessSpec = None) -> Curve:
    """D-RISE's insertion per instance: each instance's similarity to the perturbed image's detections as its most
    relevant pixels are put back into ``substrate`` (a blurred copy by default) in ``steps`` equal steps. As
    ``instance_deletion``; higher is better."""
    return _similarity_curve(model, inputs, explanation, steps, True, substrate, batch_size, preprocess)
