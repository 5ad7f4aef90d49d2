"""Concept methods attacked with the layers and calls people use: a ReLU(inplace=True) or an nn.Identity as the layer,
a channels-last model, per-image targets and concepts, no_grad / inference_mode around the call, concept counts given
as numpy or 0-d tensor integers, and deep feature factorisation into more concepts than its activations span. Values
are checked against one call per condition, the unconditional LRP map and a by-hand reconstruction."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

import explain


def relu_identity_cnn() -> nn.Module:
    """conv → ReLU → conv → ReLU(inplace=True) → Identity → mean → linear: its layers "3" (an in-place ReLU) and "4"
    (an Identity returning the ReLU's tensor) hold the same 5 concepts."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1),
                         nn.ReLU(inplace=True), nn.Identity(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(5, 4)).eval()


IMAGES = torch.rand(3, 3, 10, 10, generator=torch.Generator().manual_seed(1))
TARGETS = [0, 2, 3]


# ------------------------------------------------------------------ CRP: one call for many conditions, and conservation


@pytest.mark.parametrize("layer, context", [("2", "grad"), ("3", "no_grad"), ("4", "inference_mode"),
                                            ("3", "channels_last")])  # before an in-place ReLU, it, an Identity
def test_crp_maps_of_one_call_are_those_of_one_call_each_and_add_up_to_lrps(layer, context):
    model = relu_identity_cnn()
    images = IMAGES
    if context == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        images = IMAGES.contiguous(memory_format=torch.channels_last)
    before = model_state(model)
    crp = explain.ConceptRelevance(model, layer, batch_size=4)  # 15 conditions: 4 passes, the last one short
    around = {"grad": nullcontext(), "no_grad": torch.no_grad(), "inference_mode": torch.inference_mode(),
              "channels_last": nullcontext()}[context]
    with around:
        every = crp.explain(images, target=TARGETS, concepts=None)
        per_image = crp.explain(images, target=TARGETS, concepts=[[4, 0], [1, 1], [3, 2]])  # a repeat too
    unconditional = explain.LRP(relu_identity_cnn()).explain(IMAGES, target=TARGETS).attributions[:, 0]
    assert every.attributions.shape == (3, 5, 3, 10, 10)
    largest = float(unconditional.abs().max())
    assert largest > 0
    torch.testing.assert_close(every.attributions.sum(dim=1), unconditional, rtol=0, atol=1e-5 * largest)
    assert float(every.diagnostics["bypass_map"].abs().max()) == 0  # every path goes through these layers
    for image, concepts in enumerate([[4, 0], [1, 1], [3, 2]]):
        for slot, concept in enumerate(concepts):
            torch.testing.assert_close(per_image.attributions[image, slot], every.attributions[image, concept],
                                       rtol=0, atol=1e-6 * largest)
    for image, slot in [(0, 0), (2, 1)]:  # and those of a call for that image and concept alone
        concept = int(per_image.class_indices[image, slot])
        alone = crp.explain(IMAGES[image:image + 1], target=[TARGETS[image]], concepts=[concept], bypass=False)
        torch.testing.assert_close(per_image.attributions[image, slot], alone.attributions[0, 0], rtol=0,
                                   atol=1e-6 * largest)
        assert float(per_image.scores[image, slot]) == pytest.approx(float(alone.scores[0, 0]), abs=1e-9)
    assert_state_equal(before, model_state(model))


def test_the_in_place_relu_and_the_identity_after_it_have_the_same_concepts():
    model = relu_identity_cnn()
    relu = explain.ConceptRelevance(model, "3").explain(IMAGES, target=TARGETS, concepts=[4, 0, 2])
    identity = explain.ConceptRelevance(model, "4").explain(IMAGES, target=TARGETS, concepts=[4, 0, 2])
    assert torch.equal(relu.class_indices, identity.class_indices)
    torch.testing.assert_close(relu.attributions, identity.attributions)


# ------------------------------------------------------------------ counts of concepts as numpy and tensor integers


def test_dff_and_craft_take_a_numpy_or_0d_tensor_concept_count_as_that_count():
    model = relu_identity_cnn()
    by_int = explain.DeepFeatureFactorization(model, "3", concepts=2, iterations=50, classifier=None)
    reference = by_int.factorize(IMAGES)
    for count in (np.int64(2), torch.tensor(2)):
        dff = explain.DeepFeatureFactorization(model, "3", concepts=count, iterations=50, classifier=None)
        assert dff.concepts == 2 and type(dff.concepts) is int
        torch.testing.assert_close(dff.factorize(IMAGES).maps, reference.maps)
    craft = explain.CRAFT(model, "4", concepts=2, patch_size=5, patch_stride=5).fit(IMAGES)
    for count in (np.int32(2), torch.tensor(2, dtype=torch.int16)):
        other = explain.CRAFT(model, "4", concepts=count, patch_size=5, patch_stride=5).fit(IMAGES)
        assert other.concepts == 2
        torch.testing.assert_close(other.concept_bank, craft.concept_bank)
    for refused in (torch.tensor(2.0), torch.tensor([2]), torch.tensor(True)):
        with pytest.raises(ValueError, match="concepts must be"):
            explain.CRAFT(model, "4", concepts=refused)
        with pytest.raises(ValueError, match="concepts must be"):
            explain.DeepFeatureFactorization(model, "3", concepts=refused)


# ------------------------------------------------------------------ DFF into more concepts than the activations span


def test_dff_into_more_concepts_than_channels_or_positions_is_refused_and_as_many_reconstruct_the_layer():
    model = relu_identity_cnn()
    before = model_state(model)
    with pytest.raises(ValueError, match=r"concepts=6 of layer '3', which has 5 channels at 300 positions.*"
                                         r"concepts ≤ 5\.$"):
        explain.DeepFeatureFactorization(model, "3", concepts=6, classifier=None).factorize(IMAGES)
    # one image of a 1×1 feature map: 1 position, at most 1 concept, whatever the channels
    pooled = nn.Sequential(*list(relu_identity_cnn())[:5], nn.AdaptiveAvgPool2d(1), nn.ReLU()).eval()
    with pytest.raises(ValueError, match=r"5 channels at 1 positions.*concepts ≤ 1, or more images\."):
        explain.DeepFeatureFactorization(pooled, "6", concepts=2, classifier=None).factorize(IMAGES[:1])
    assert_state_equal(before, model_state(model))
    # as many concepts as channels: allowed, and concepts ᵀ · maps is the layer's activation at every position
    result = explain.DeepFeatureFactorization(model, "3", concepts=5, iterations=300,
                                              classifier=None).factorize(IMAGES)
    with torch.no_grad():
        activation = model[:4](IMAGES.clone())
    rebuilt = torch.einsum("kc,nkhw->nchw", result.concepts.double(), result.low_res_maps.double())
    assert result.relative_error < 1e-3
    torch.testing.assert_close(rebuilt, activation.double(), rtol=0, atol=2e-3 * float(activation.abs().max()))


def test_craft_refuses_more_concepts_than_a_timm_resnets_channels_and_leaves_it_as_found():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18d", pretrained=False, num_classes=3).eval()
    before = model_state(model)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))  # 98 patches
    with pytest.raises(ValueError, match=r"concepts=65 is more than layer 'layer1''s 64 channels"):
        explain.CRAFT(model, "layer1", concepts=torch.tensor(65), patch_size=8, patch_stride=4).fit(images)
    assert_state_equal(before, model_state(model))
