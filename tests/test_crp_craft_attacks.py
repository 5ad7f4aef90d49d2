"""CRP (ConceptRelevance, concept_references, glocal_figure, principal_directions) and CRAFT attacked as a hostile
user would: models people use (timm and torchvision ResNets, GoogLeNet's auxiliary heads), dead channels, concept
indices that are not channel indices, layers given by a glob or a type, layers that never run, relevance around a
residual branch, reference sets given as a folder, explanations that are not CRP's, more CRAFT concepts than
channels, seeds and targets of numpy's types. Each rule is checked against a by-hand computation where a value is at
stake, on two models or inputs, and every call, refused ones included, leaves the model as found."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import ResidualNet, assert_state_equal, model_state
from test_concepts import masked_by_hand, small_cnn
from test_craft import colour_images, colour_model
from torch import nn

import explain
from explain.methods.concepts import concept_references, glocal_figure, principal_directions

EPSILON_PLUS = {"composite": "epsilon_plus"}


def no_hooks(model: nn.Module) -> bool:
    return not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def cnn_with_dead_channels() -> nn.Module:
    """small_cnn whose layer "4" (a ReLU) has channels 1 and 3 silenced: their convolution's bias is −1000."""
    model = small_cnn()
    with torch.no_grad():
        model[3].bias[[1, 3]] = -1000.0
    return model


def timm_resnet() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=5).eval()


# ------------------------------------------------------------------ 1. a dead concept's map is 0, and not warned of


def test_a_dead_channels_map_is_zero_with_no_warning_and_the_maps_still_sum_to_the_unconditional_map():
    """A channel a ReLU silences carries no relevance (R_c = 0), so its conditional map is 0 everywhere, as it should
    be: no warning that blames the model's weights (HEAD warned once per pass, naming rows of CRP's internal batch as
    "images" and pointing at concepts.py). All channels' maps still add up to the unconditional LRP map."""
    model = cnn_with_dead_channels()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = explain.ConceptRelevance(model, "4", batch_size=5, **EPSILON_PLUS).explain(x, concepts=None)
    assert_state_equal(before, model_state(model))
    assert e.diagnostics["layer_relevance"][:, [1, 3]].abs().max() == 0
    assert torch.equal(e.attributions[:, [1, 3]], torch.zeros_like(e.attributions[:, [1, 3]]))
    unconditional = explain.LRP(model, **EPSILON_PLUS).explain(x, target=e.diagnostics["explained_class"].tolist())
    scale = float(unconditional.attributions.abs().max())
    torch.testing.assert_close(e.attributions.sum(dim=1) / scale, unconditional.attributions[:, 0] / scale,
                               atol=1e-5, rtol=1e-4)


def test_a_timm_resnets_dead_channels_have_zero_maps_and_are_not_warned_of():
    """The same on timm's ResNet-18 (random weights): the channels of layer2 with R_c = 0 for the image, mapped,
    give maps that are 0 everywhere, without a warning; a live channel's map is LRP masked to it by hand."""
    model = timm_resnet()
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    crp = explain.ConceptRelevance(model, "layer2", batch_size=8)
    relevance = crp.explain(x, concepts=1, bypass=False).diagnostics["layer_relevance"][0]
    dead = (relevance == 0).nonzero().flatten()[:6].tolist()
    live = int(relevance.abs().argmax())
    assert len(dead) >= 3  # random weights: many channels of layer2 are silenced for this image
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = crp.explain(x, concepts=dead + [live], bypass=False)
    assert torch.equal(e.attributions[0, :-1], torch.zeros_like(e.attributions[0, :-1]))
    expected = masked_by_hand(model, "layer2", "lrp", {}, x[0], int(e.diagnostics["explained_class"][0]), live, 1)
    scale = float(expected.abs().max())
    torch.testing.assert_close(e.attributions[0, -1] / scale, expected / scale, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ 2. concept indices must be channel indices


def test_concept_indices_that_are_not_whole_numbers_are_refused_and_numpy_counts_are_counts():
    """concepts=[1.7] was truncated to channel 1 and a boolean mask [T, F, T, …] read as the channels 1, 0, 1, …:
    silently another concept's map. Both are refused, saying what to give; whole floats (3.0) are the channel;
    numpy's and 0-d tensors' ints are a count, as a Python int (HEAD refused them with "got shape ()");
    an empty list is refused by name."""
    model = small_cnn()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    crp = explain.ConceptRelevance(model, "4", **EPSILON_PLUS)
    before = model_state(model)
    with pytest.raises(ValueError, match="whole numbers"):
        crp.explain(x, concepts=[1.7])
    mask = torch.tensor([True, False, True, False, False, False])
    with pytest.raises(ValueError, match="boolean mask.*nonzero"):
        crp.explain(x, concepts=mask)
    with pytest.raises(ValueError, match="concepts is empty"):
        crp.explain(x, concepts=[])
    assert_state_equal(before, model_state(model))
    by_index = crp.explain(x, concepts=[3], bypass=False)
    torch.testing.assert_close(crp.explain(x, concepts=[3.0], bypass=False).attributions, by_index.attributions)
    by_mask = crp.explain(x, concepts=mask.nonzero().flatten(), bypass=False)
    assert by_mask.class_indices.tolist() == [[0, 2], [0, 2]]
    top_two = crp.explain(x, concepts=2, bypass=False)
    for count in (np.int64(2), torch.tensor(2)):
        other = crp.explain(x, concepts=count, bypass=False)
        assert torch.equal(other.class_indices, top_two.class_indices)
        torch.testing.assert_close(other.attributions, top_two.attributions)


def test_concept_references_refuse_fractional_and_empty_concepts_before_the_set_runs():
    """The same rule for concept_references (on a ViT with AttnLRP): [1.5] was read as channel 1 and [] gave empty
    references after the whole set ran; now both are refused before any forward pass, as are top=0 and
    batch_size=0 (HEAD: "the input batch is empty" and "range() arg 3 must not be zero"); an int k is refused with
    how to get the k most relevant channels."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2,
                                                             num_heads=2, num_classes=4).eval()
    crp = explain.ConceptRelevance(model, "blocks.0", "attnlrp")
    images = list(torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(3)))
    before = model_state(model)
    forwards = []
    handle = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        for arguments, message in (({"concepts": [1.5]}, "whole numbers"), ({"concepts": []}, "concepts is empty"),
                                   ({"concepts": [1], "top": 0}, "top must be a whole number ≥ 1"),
                                   ({"concepts": [1], "batch_size": 0}, "batch_size must be a whole number ≥ 1"),
                                   ({"concepts": 2}, "explain\\(image, concepts=k\\)")):
            with pytest.raises(ValueError, match=message):
                concept_references(crp, images, **arguments)
        assert forwards == []
    finally:
        handle.remove()
    assert_state_equal(before, model_state(model))
    references = concept_references(crp, images, concepts=[1.0, 5], top=2)
    per_image = torch.cat([crp.explain(image[None], concepts=1, bypass=False).diagnostics["layer_relevance"]
                           for image in images])
    for row, concept in enumerate([1, 5]):
        assert references.images[row].tolist() == per_image[:, concept].topk(2).indices.tolist()


# ------------------------------------------------------------------ 3. one layer, named as the model names it


def test_a_glob_or_a_type_that_selects_several_layers_is_refused_and_a_module_is_named_by_its_name():
    """ConceptRelevance(model, "*") and ConceptRelevance(model, nn.Conv2d) silently took the first layer they
    matched (and named the layer "*" or the class); principal_directions too. Now refused, listing what matched; a
    module object is the layer, named as model.named_modules() names it, with the maps of that name."""
    model = small_cnn()
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    before = model_state(model)
    for layer in ("*", nn.Conv2d):
        with pytest.raises(ValueError, match="one layer.*selects 1?[0-9]+: 0, "):
            explain.ConceptRelevance(model, layer, **EPSILON_PLUS)
    with pytest.raises(ValueError, match="principal_directions reads the concepts of one layer"):
        principal_directions(model, "*", x, count=2)
    assert_state_equal(before, model_state(model))
    by_module = explain.ConceptRelevance(model, model[4], **EPSILON_PLUS).explain(x, concepts=2)
    by_name = explain.ConceptRelevance(model, "4", **EPSILON_PLUS).explain(x, concepts=2)
    assert by_module.layer == "4"
    torch.testing.assert_close(by_module.attributions, by_name.attributions)


def test_a_timm_resnets_stage_glob_is_refused_and_its_single_match_is_that_stage():
    model = timm_resnet()
    with pytest.raises(ValueError, match="'layer\\*' selects 4: layer1, layer2, layer3, layer4"):
        explain.ConceptRelevance(model, "layer*")
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    glob = explain.ConceptRelevance(model, "layer4*").explain(x, concepts=[0, 1], bypass=False)  # one match
    by_name = explain.ConceptRelevance(model, "layer4").explain(x, concepts=[0, 1], bypass=False)
    assert glob.layer == "layer4"
    torch.testing.assert_close(glob.attributions, by_name.attributions)


# ------------------------------------------------------------------ 4. a layer that never runs


class TrainingOnlyHead(nn.Module):
    """A classifier with an auxiliary head that runs in training only (as GoogLeNet's and Inception's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.auxiliary = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, images):
        features = self.features(images)
        if self.training:
            self.auxiliary(features)
        return self.head(features)


@pytest.mark.parametrize("build, layer", [(TrainingOnlyHead, "auxiliary.0"),
                                          (lambda: __import__("torchvision").models.googlenet(
                                              weights=None, aux_logits=True, init_weights=False, num_classes=4),
                                           "aux1.conv")])
def test_a_layer_that_never_runs_is_said_not_to_run_by_crp_and_craft(build, layer):
    """An auxiliary head that runs in training only: explanations run the model in eval mode, so it never runs.
    HEAD said "not on the path from the input to the score" (CRP) and "ran 0 times … not a shared module" (CRAFT);
    both now say it did not run, and why it may not; the training model is left training."""
    model = build().train()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    before = model_state(model)
    with pytest.raises(ValueError, match="did not run in the model's forward pass.*training only"):
        explain.ConceptRelevance(model, layer).explain(x)
    assert_state_equal(before, model_state(model))
    with pytest.raises(TypeError, match="did not run in the model's forward pass.*training only"):  # LayerOutputError
        explain.CRAFT(model, layer, concepts=2, patch_size=16).fit(x)
    assert_state_equal(before, model_state(model))
    assert no_hooks(model)


# ------------------------------------------------------------------ 5. relevance around the layer: what subtracts


def assert_bypass_attributions_subtract(model: nn.Module, layer: str, options: dict, x: torch.Tensor,
                                        concepts) -> None:
    """diagnostics["bypass_attributions"] is LRP with the layer's relevance zeroed by hand (signed, per colour
    channel); each conditional attribution minus it, summed over all concepts, plus it once, is the unconditional
    attribution; subtracting "bypass_map" from a map instead is not a concept's own map (a map is Σ |R|)."""
    crp = explain.ConceptRelevance(model, layer, batch_size=64, **options)
    with pytest.warns(RuntimeWarning, match="subtract diagnostics\\['bypass_attributions'\\]") as caught:
        e = crp.explain(x, concepts=concepts)
    assert {warning.filename for warning in caught if "bypass" in str(warning.message)} == {__file__}
    classes = e.diagnostics["explained_class"]
    bypass = torch.stack([masked_by_hand(model, layer, "lrp", options, x[image], int(classes[image]), -1, 1)
                          for image in range(x.shape[0])])
    scale = float(bypass.abs().max())
    assert scale > 0
    torch.testing.assert_close(e.diagnostics["bypass_attributions"] / scale, bypass / scale, atol=1e-5, rtol=1e-4)
    own = e.attributions - bypass[:, None]  # what flowed through each concept
    if concepts is None:
        unconditional = explain.LRP(model, **options).explain(x, target=classes.tolist()).attributions[:, 0]
        total = float(unconditional.abs().max())
        torch.testing.assert_close((own.sum(dim=1) + bypass) / total, unconditional / total, atol=1e-5, rtol=1e-4)
    # the map of what flowed through a concept is Σ |own| over colour channels, which map − bypass_map is not
    subtracted_maps = e.raw_maps - e.diagnostics["bypass_map"][:, None]
    assert float((subtracted_maps - own.abs().sum(dim=2)).abs().max()) > 1e-3 * float(own.abs().sum(dim=2).max())


def test_the_relevance_around_a_residual_branch_subtracts_as_attributions_not_as_maps():
    assert_bypass_attributions_subtract(ResidualNet().eval(), "branch.0", EPSILON_PLUS,
                                        torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(7)), None)


def test_the_relevance_around_a_torchvision_resnets_inner_convolution_subtracts_as_attributions():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).eval()
    assert_bypass_attributions_subtract(model, "layer1.0.conv2", {},
                                        torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(8)),
                                        [0, 1, 2])


# ------------------------------------------------------------------ 6. reference sets as a folder, a path, an array


def test_concept_references_of_a_folder_or_a_path_are_those_of_its_images(tmp_path):
    """concept_references(crp, "folder") iterated the string character by character ("no image file at '/'"); a
    folder is now its image files sorted by name, a path one image, an (N, H, W, 3) uint8 array its N images: the
    same references as the list of those images."""
    from PIL import Image

    model = small_cnn()
    crp = explain.ConceptRelevance(model, "4", **EPSILON_PLUS)
    pixels = (np.random.default_rng(9).random((4, 16, 16, 3)) * 255).astype(np.uint8)
    for index, picture in enumerate(pixels):
        Image.fromarray(picture).save(tmp_path / f"{index}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    expected = concept_references(crp, list(pixels), concepts=[0, 2], top=3)
    for images in (tmp_path, str(tmp_path), pixels):
        references = concept_references(crp, images, concepts=[0, 2], top=3)
        assert torch.equal(references.images, expected.images)
        torch.testing.assert_close(references.values, expected.values)
    one = concept_references(crp, str(tmp_path / "2.png"), concepts=[0], top=1)
    assert one.images.tolist() == [[0]]
    torch.testing.assert_close(one.values[0, 0].double(),
                               crp.explain(pixels[2], concepts=[0], bypass=False).scores[0, 0].double())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no image files"):
        concept_references(crp, tmp_path / "empty", concepts=[0])


# ------------------------------------------------------------------ 7. the glocal figure draws CRP's explanations


def test_the_glocal_figure_refuses_what_is_not_a_crp_explanation_and_draws_one_concept():
    """A K-target Grad-CAM or LRP explanation gave KeyError 'explained_class'; image=5 of 2 and patches=-1 gave
    IndexErrors. Each is refused saying what to give; one concept gives one row titled with its relevance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = small_cnn()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(10))
    others = (explain.GradCAM(model, "4").explain(x, topk=3), explain.LRP(model, **EPSILON_PLUS).explain(x, topk=2))
    for other in others:
        with pytest.raises(ValueError, match="glocal_figure draws ConceptRelevance.explain's result"):
            glocal_figure(other)
    e = explain.ConceptRelevance(model, "4", **EPSILON_PLUS).explain(x, concepts=1)
    with pytest.raises(ValueError, match="image=5: the explanation holds 2 image\\(s\\); give 0 to 1"):
        glocal_figure(e, image=5)
    with pytest.raises(ValueError, match="patches must be a whole number ≥ 0"):
        glocal_figure(e, patches=-1)
    figure = glocal_figure(e, image=np.int64(1))
    assert len(figure.axes) == 2
    assert figure.axes[1].get_title() == f"concept {int(e.class_indices[1, 0])}: {float(e.scores[1, 0]):.3g}"
    plt.close(figure)


# ------------------------------------------------------------------ 8. CRAFT: concepts, seeds, targets


def test_craft_refuses_more_concepts_than_channels_and_fits_as_many():
    """More NMF concepts than the layer's channels: the bank is not unique (an activation has many sets of
    coefficients), so maps and importances were arbitrary; HEAD fitted 10 concepts on 6 channels silently. Refused,
    on a feature map and on a vector layer; as many concepts as channels fit, with the NMF's coefficients
    reconstructing the activations."""
    images = colour_images(4, seed=0)
    for model, layer in ((colour_model(), "1"), (colour_model(vector_layer=True), "4")):
        before = model_state(model)
        with pytest.raises(ValueError, match="concepts=7 is more than layer .*'s 6 channels.*concepts ≤ 6"):
            explain.CRAFT(model, layer, concepts=7, patch_size=8, patch_stride=4).fit(images)
        assert_state_equal(before, model_state(model))
        craft = explain.CRAFT(model, layer, concepts=6, patch_size=8, patch_stride=4).fit(images)
        reconstruction = craft.patch_coefficients @ craft.concept_bank
        scale = float(craft.patch_activations.abs().max())
        torch.testing.assert_close(reconstruction / scale, craft.patch_activations / scale, atol=1e-3, rtol=0)


def test_craft_seeds_are_whole_numbers_and_a_numpy_or_tensor_target_is_that_class():
    """seed=None and seed="a" failed deep inside torch ("manual_seed expected a long"); refused at construction.
    The same seed gives the same bank and importance; target=np.int64(c) and torch.tensor(c) (argmax's result)
    were refused as "not an int"; now they are class c, with c's importance."""
    model = colour_model()
    images = colour_images(4, seed=1)
    for seed in (None, "a", 1.5, -1):
        with pytest.raises(ValueError, match="seed must be a whole number ≥ 0"):
            explain.CRAFT(model, "1", concepts=3, patch_size=8, seed=seed)
    first = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4, seed=np.int64(3)).fit(images)
    second = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4, seed=3).fit(images)
    assert torch.equal(first.concept_bank, second.concept_bank)
    expected = second.importance(images[:2], target=2, designs=8)
    for target in (np.int64(2), torch.tensor(2), model(images[:1]).argmax(dim=1)[0] * 0 + 2):
        torch.testing.assert_close(first.importance(images[:2], target=target, designs=8), expected, rtol=0,
                                   atol=0)
    with pytest.raises(TypeError, match="target must be a class index"):
        first.importance(images[:2], target=torch.tensor(2.0), designs=8)


def test_craft_on_a_torchvision_resnet_takes_a_numpy_target_and_refuses_too_many_concepts():
    """The same rules on torchvision's ResNet-18 (random weights, a training model left training): layer1's 64
    channels refuse 65 concepts; np.int64 and int targets give the same importance."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).train()
    model.conv1.weight.requires_grad_(False)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(11))
    before = model_state(model)
    with pytest.raises(ValueError, match="concepts=65 is more than layer 'layer1''s 64 channels"):
        explain.CRAFT(model, "layer1", concepts=65, patch_size=8, patch_stride=4).fit(images)
    craft = explain.CRAFT(model, "layer4", concepts=3, patch_size=16, patch_stride=8).fit(images)
    torch.testing.assert_close(craft.importance(images[:1], target=np.int64(1), designs=4),
                               craft.importance(images[:1], target=1, designs=4), rtol=0, atol=0)
    assert_state_equal(before, model_state(model))


# ------------------------------------------------------------------ 9. warnings of the inner passes point at the caller


def test_crps_autocast_precision_warning_points_at_the_callers_line():
    model = small_cnn()
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(12))
    crp = explain.ConceptRelevance(model, "4", **EPSILON_PLUS)
    with pytest.warns(RuntimeWarning, match="ran in bfloat16") as caught, torch.autocast("cpu", dtype=torch.bfloat16):
        crp.explain(x, concepts=2)
    assert {warning.filename for warning in caught if "bfloat16" in str(warning.message)} == {__file__}
