"""Per-instance detector explanations attacked as a hostile user would (session 9): an InstanceTarget made for
another input size than the batch explained (HF DETR's boxes are fractions of the input), checked against the
by-hand gradient of the right query's class score; boxes given as an ndarray; a method scoring windows of the
image (SESS) refused with what to use."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from detection_models import SmallDetector, detr, xyxy
from torchvision.ops import box_iou

import explain
from explain.detection import Instances, InstanceTarget, detect

SIZE = (64, 96)


@pytest.fixture(scope="module")
def diverse_detr() -> torch.nn.Module:
    """A random-weight DETR whose queries propose different boxes (the default initialisation gives every query
    nearly one box): sharper cross-attention and a wider box head."""
    model = detr()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        attention = model.model.decoder.layers[0].encoder_attn
        for weight in (attention.q_proj.weight, attention.k_proj.weight, model.model.query_position_embeddings.weight):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 2)
        for layer in model.bbox_predictor.layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.4)
            layer.bias.zero_()
        last = model.bbox_predictor.layers[-1]
        last.weight.mul_(0.15 / 0.4)
        last.bias.copy_(torch.tensor([0.0, 0.0, -0.5, -0.5]))
        classifier = model.class_labels_classifier
        classifier.weight.copy_(torch.randn(classifier.weight.shape, generator=generator) * 0.5)
    return model


def detr_by_hand(model: torch.nn.Module, image: torch.Tensor):
    """Query boxes in pixels (Q, 4) and softmax class probabilities (Q, C + 1) of image 0, read from DETR's
    documented output (normalised centre x, y, width, height), with a graph to ``image``."""
    output = model(image)
    height, width = image.shape[-2:]
    boxes = xyxy(output.pred_boxes[0]) * torch.tensor([width, height, width, height])
    return boxes, output.logits[0].softmax(dim=-1)


def test_detr_instance_target_input_size_from_the_batch(diverse_detr):
    """The query matched is the one whose box is the instance's in the batch's own pixels, and the map is that
    query's class score's gradient; an input_size that is not the batch's is refused, not read silently."""
    model = diverse_detr
    image = torch.rand(1, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        boxes, probabilities = detr_by_hand(model, image)
    query = int((boxes[:, 2] - boxes[:, 0]).argmax())  # the widest box: its neighbours overlap it least
    label = int(probabilities[query, :-1].argmax())
    similarity = (box_iou(boxes[query: query + 1], boxes)[0] * probabilities[:, label]
                  / probabilities.norm(dim=-1))
    assert int(similarity.argmax()) == query  # the setup: that query is the instance's best match
    instances = Instances(boxes[query][None, None].clone(), torch.tensor([[label]]), torch.tensor([[float("nan")]]),
                          torch.tensor([[True]]))

    pixels = image.clone().requires_grad_(True)
    _, graph_probabilities = detr_by_hand(model, pixels)
    gradient, = torch.autograd.grad(graph_probabilities[query, label], pixels)
    expected = gradient.abs().amax(dim=1)[0]  # Saliency: max over channels of |∂y/∂x|

    before = model_state(model)
    for input_size in (None, SIZE):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            e = explain.Saliency(model).explain(image, target=InstanceTarget(instances, model, input_size))
        torch.testing.assert_close(e.scores[0, 0], probabilities[query, label], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(e.raw_maps[0, 0], expected, rtol=1e-4, atol=1e-7)
    assert_state_equal(before, model_state(model))


def test_instance_target_for_another_input_size_is_refused(diverse_detr):
    """Boxes made for another input size than the batch explained would be read in the wrong pixels (DETR's boxes
    scaled by that size): a clear error saying what to give, for every method's path through the target."""
    model = diverse_detr
    image = torch.rand(1, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    instances = Instances(torch.tensor([[[10.0, 10.0, 50.0, 40.0]]]), torch.tensor([[0]]),
                          torch.tensor([[float("nan")]]), torch.tensor([[True]]))
    before = model_state(model)
    for wrong in ((48, 80), (32, 32), (96, 64)):
        with pytest.raises(ValueError, match=rf"input_size=\({wrong[0]}, {wrong[1]}\).*64 × 96.*batch.shape\[-2:\]"):
            explain.Saliency(model).explain(image, target=InstanceTarget(instances, model, wrong))
    with pytest.raises(ValueError, match=r"input_size=\(32, 32\)"):
        explain.DRISE(model, masks=4, grid=2).explain(image, target=InstanceTarget(instances, model, (32, 32)))
    assert_state_equal(before, model_state(model))


def test_instance_target_size_outside_an_explain_call(diverse_detr):
    """Called on a DETR output directly, the InstanceTarget needs input_size (DETR's boxes are fractions of it)
    and then scores the matched query's class probability; a size that is not (H, W) is refused."""
    model = diverse_detr
    image = torch.rand(1, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        boxes, probabilities = detr_by_hand(model, image)
        output = model(image)
    query = int((boxes[:, 2] - boxes[:, 0]).argmax())
    label = int(probabilities[query, :-1].argmax())
    instances = Instances(boxes[query][None, None].clone(), torch.tensor([[label]]), torch.tensor([[float("nan")]]),
                          torch.tensor([[True]]))
    with pytest.raises(ValueError, match=r"give input_size=\(H, W\)"):
        InstanceTarget(instances, model)(output)
    score = InstanceTarget(instances, model, SIZE)(output)
    torch.testing.assert_close(score[0, 0], probabilities[query, label])
    with pytest.raises(ValueError, match=r"input_size must be \(H, W\)"):
        InstanceTarget(instances, model, image.shape)


def test_boxes_given_as_an_ndarray_are_boxes():
    """instances= takes boxes as an ndarray as it takes a tensor: the same instances, the same maps."""
    model = SmallDetector().eval()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    boxes = torch.tensor([[4.0, 4.0, 16.0, 16.0], [14.0, 10.0, 30.0, 26.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a given box may overlap no detection: the same for both
        from_tensor = explain.Saliency(model).explain(image, instances=boxes)
        from_array = explain.Saliency(model).explain(image, instances=boxes.numpy().astype(np.float64))
    torch.testing.assert_close(from_array.boxes, from_tensor.boxes, equal_nan=True)
    assert torch.equal(from_array.class_indices, from_tensor.class_indices)
    torch.testing.assert_close(from_array.raw_maps, from_tensor.raw_maps)


def test_instances_refused_by_a_method_scoring_windows():
    """SESS scores its target on windows of the image, where an instance's box (in the image's pixels) cannot be
    found: SESS refuses instances before it runs, saying so and what to use, not that the instances are for another
    number of images."""
    model = SmallDetector().eval()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    before = model_state(model)
    with pytest.raises(ValueError, match=r"SESS cannot explain detected instances.*Saliency"):
        explain.SESS(model, "features.4", window=16, num_scales=2, reshape="channels_first").explain(
            image, instances=2)
    assert_state_equal(before, model_state(model))


def test_odam_quantity_and_a_given_target_agree():
    """ODAM(quantity="x0") given an InstanceTarget of the class score would explain the score while saying x0: refused;
    the target's own quantity, given to a default ODAM, is the map of ODAM(quantity=...) with instances=."""
    model = SmallDetector().eval()
    image = torch.rand(1, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    found = detect(model, image, 1)
    with pytest.raises(ValueError, match=r"quantity='x0'.*quantity='score'.*InstanceTarget\(\.\.\., quantity='x0'\)"):
        explain.ODAM(model, "features.4", quantity="x0").explain(image, target=InstanceTarget(found, model))
    by_target = explain.ODAM(model, "features.4").explain(image, target=InstanceTarget(found, model, quantity="x0"))
    by_odam = explain.ODAM(model, "features.4", quantity="x0").explain(image, instances=found)
    x0 = model(image)["boxes"][0, :, 0]
    assert by_odam.scores[0, 0] in x0  # the matched candidate's x0, not a class score in [0, 1]
    torch.testing.assert_close(by_target.scores, by_odam.scores)
    torch.testing.assert_close(by_target.raw_maps, by_odam.raw_maps)
