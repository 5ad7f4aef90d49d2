"""CRAFT (Fel et al., CVPR 2023) as specifications: Jansen's total Sobol estimator against functions whose total
indices are known in closed form (additive, Ishigami), independent of any model; the concept bank and the patch
coefficients are a non-negative factorisation of the patches' activations computed here by hand; on a hand-built
model whose activations are made of three colour concepts, the logit that reads one concept gives it the top
importance and the others 0, and a logit linear in the concepts gives the additive function's closed-form indices;
concept maps are the non-negative least-squares coefficients of each position's activation (scipy's NNLS)
upsampled; the model is left as found; bad inputs are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.craft import jansen_total_indices, sobol_masks

# ------------------------------------------------------------------ the estimator, independent of any model


def test_the_sobol_design_is_a_then_b_then_a_with_each_column_from_b():
    masks = sobol_masks(3, 8, seed=1)
    assert masks.shape == (8 * 5, 3) and bool(((masks >= 0) & (masks < 1)).all())
    first, second = masks[:8], masks[8:16]
    for i in range(3):
        mixed = masks[16 + 8 * i:16 + 8 * (i + 1)]
        expected = first.clone()
        expected[:, i] = second[:, i]
        torch.testing.assert_close(mixed, expected, rtol=0, atol=0)
    torch.testing.assert_close(sobol_masks(3, 8, seed=1), masks, rtol=0, atol=0)  # seeded: the same design


def test_jansen_recovers_the_total_indices_of_an_additive_function():
    """f(x) = Σ a_i x_i with x_i uniform: Var f = Σ a_i² / 12 and S_T,i = a_i² / Σ a_j² (no interactions)."""
    for weights in ([1.0, 2.0, 0.0, 3.0], [5.0, 0.5]):
        a = torch.tensor(weights, dtype=torch.float64)
        masks = sobol_masks(len(a), 1024, seed=0)
        indices = jansen_total_indices(masks @ a, 1024, len(a))
        torch.testing.assert_close(indices, a ** 2 / (a ** 2).sum(), atol=0.02, rtol=0)


def test_jansen_recovers_the_total_indices_of_the_ishigami_function():
    """Ishigami (a = 7, b = 0.1) on [−π, π]³: with D = a²/8 + b π⁴/5 + b² π⁸/18 + 1/2,
    S_T1 = (½ (1 + b π⁴/5)² + 8 b² π⁸/225) / D, S_T2 = (a²/8) / D, S_T3 = (8 b² π⁸/225) / D."""
    a, b = 7.0, 0.1
    masks = sobol_masks(3, 4096, seed=0)
    x = (masks * 2 - 1) * math.pi
    outputs = torch.sin(x[:, 0]) + a * torch.sin(x[:, 1]) ** 2 + b * x[:, 2] ** 4 * torch.sin(x[:, 0])
    variance = a ** 2 / 8 + b * math.pi ** 4 / 5 + b ** 2 * math.pi ** 8 / 18 + 0.5
    interaction = 8 * b ** 2 * math.pi ** 8 / 225
    expected = torch.tensor([(0.5 * (1 + b * math.pi ** 4 / 5) ** 2 + interaction) / variance,
                             a ** 2 / 8 / variance, interaction / variance], dtype=torch.float64)
    torch.testing.assert_close(jansen_total_indices(outputs, 4096, 3), expected, atol=0.02, rtol=0)


def test_jansen_is_the_formula_written_out_and_zero_for_a_constant():
    outputs = torch.randn(2, 6 * 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    designs, dimensions = 6, 3
    for row in range(2):
        values = outputs[row].tolist()
        a, b = values[:designs], values[designs:2 * designs]
        mean = sum(a + b) / (2 * designs)
        variance = sum((v - mean) ** 2 for v in a + b) / (2 * designs)
        for i in range(dimensions):
            c = values[2 * designs + i * designs:2 * designs + (i + 1) * designs]
            by_hand = sum((x - y) ** 2 for x, y in zip(a, c)) / designs / 2 / variance
            assert float(jansen_total_indices(outputs, designs, dimensions)[row, i]) == pytest.approx(by_hand)
    assert jansen_total_indices(torch.ones(30), 6, 3).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="designs · \\(dimensions \\+ 2\\) = 30"):
        jansen_total_indices(torch.ones(29), 6, 3)


# ------------------------------------------------------------------ a model made of three colour concepts

PROFILES = torch.tensor([[1.0, 2.0, 0, 0, 0, 0],   # red → channels 0, 1
                         [0, 0, 1.0, 0.5, 0, 0],   # green → channels 2, 3
                         [0, 0, 0, 0, 2.0, 1.0]])  # blue → channels 4, 5


def colour_model(vector_layer: bool = False) -> nn.Module:
    """Layer "1": ReLU of a 1×1 convolution whose six channels are two copies of each colour (PROFILES); the
    head averages over positions and reads class 0 from the red channels, class 1 from the blue ones, class 2 from
    all three colours (weights 1, 2, 3 per colour). vector_layer: the layer is the pooled (N, 6) vector "3"."""
    convolution = nn.Conv2d(3, 6, 1, bias=False)
    head = nn.Linear(6, 3)
    with torch.no_grad():
        convolution.weight.copy_(PROFILES.T[:, :, None, None])
        head.weight.copy_(torch.tensor([[1.0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1], [1, 0, 2, 0, 3, 0]]))
        head.bias.copy_(torch.tensor([0.5, -0.5, 0.0]))
    layers = [convolution, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if vector_layer:
        layers.append(nn.Identity())
    return nn.Sequential(*layers, head).eval()


def colour_images(count: int, seed: int) -> torch.Tensor:
    """(count, 3, 16, 16): each quadrant one pure colour (red, green or blue) of random strength in [0.5, 1]."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.zeros(count, 3, 16, 16)
    for n in range(count):
        for top in (0, 8):
            for left in (0, 8):
                colour = int(torch.randint(3, (1,), generator=generator))
                images[n, colour, top:top + 8, left:left + 8] = 0.5 + 0.5 * float(torch.rand(1, generator=generator))
    return images


def colour_of(bank: torch.Tensor) -> list[int]:
    """For each concept of the bank (r, 6), the colour whose channels hold its profile."""
    return [int(row.view(3, 2).sum(dim=1).argmax()) for row in bank]


def test_the_concepts_are_a_non_negative_factorisation_of_the_patches_activations_computed_by_hand():
    model = colour_model()
    images = colour_images(6, seed=0)
    unit = explain.Normalize(mean=(0, 0, 0), std=(1, 1, 1))  # the model input is the display image
    craft = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4, preprocess=unit).fit(images)
    # the patches by hand: a 3 × 3 grid of 8-pixel crops per image, resized to 16, through the layer, averaged
    crops = torch.stack([images[n, :, top:top + 8, left:left + 8] for n in range(6) for top in (0, 4, 8)
                         for left in (0, 4, 8)])
    resized = F.interpolate(crops, size=(16, 16), mode="bilinear", align_corners=False)
    with torch.no_grad():
        by_hand = model[:2](resized).mean(dim=(2, 3))
    torch.testing.assert_close(craft.patch_activations, by_hand, atol=1e-6, rtol=1e-5)
    assert craft.patches.shape == (54, 8, 8, 3) and craft.patches.dtype == np.uint8
    np.testing.assert_array_equal(craft.patches[4], (crops[4].permute(1, 2, 0) * 255).round().byte().numpy())
    # A ≈ U W with U, W ≥ 0; the bank's rows have length 1; the activations have rank 3: exact here
    bank, coefficients = craft.concept_bank, craft.patch_coefficients
    assert bank.shape == (3, 6) and coefficients.shape == (54, 3)
    assert float(bank.min()) >= 0 and float(coefficients.min()) >= 0
    torch.testing.assert_close(bank.norm(dim=1), torch.ones(3))
    reconstruction_error = float((by_hand - coefficients @ bank).norm() / by_hand.norm())
    assert reconstruction_error == pytest.approx(craft.relative_error, abs=1e-6) and reconstruction_error < 1e-3
    assert sorted(colour_of(bank)) == [0, 1, 2]  # one concept per colour, its profile the colour's channels
    for row, colour in zip(bank, colour_of(bank)):
        torch.testing.assert_close(row, PROFILES[colour] / PROFILES[colour].norm(), atol=1e-4, rtol=0)
    # the top patches of a concept show its colour
    red = colour_of(bank).index(0)
    top = craft.top_patches(red, count=3)
    assert top.shape == (3, 8, 8, 3) and bool((top[..., 0] > 0).all()) and not top[..., 1:].any()


@pytest.mark.parametrize("vector_layer", [False, True], ids=["feature-map", "vector"])
def test_a_logit_that_reads_one_concept_gives_it_the_top_importance_and_the_others_zero(vector_layer):
    """Class 0 reads the red channels only, class 1 the blue ones: perturbing the other concepts' coefficients
    does not move the logit (total index 0), and the one concept it reads carries all of its variance (≈ 1). The
    same on the model's (N, C, h, w) layer and on its pooled (N, C) vector."""
    model = colour_model(vector_layer)
    layer = "4" if vector_layer else "1"
    images = colour_images(6, seed=1)
    craft = explain.CRAFT(model, layer, concepts=3, patch_size=8, patch_stride=4).fit(images)
    colours = colour_of(craft.concept_bank)
    tagged = images[[n for n in range(6) if images[n, 0].any() and images[n, 2].any()]]  # red and blue present
    for target, colour in ((0, 0), (1, 2)):
        importance = craft.importance(tagged, target=target, designs=32)
        read = colours.index(colour)
        assert int(craft.ranking[0]) == read
        assert float(importance[read]) > 0.8
        assert all(float(importance[j]) < 1e-6 for j in range(3) if j != read)


def test_a_logit_linear_in_the_concepts_gets_the_additive_closed_form_indices():
    """Class 2's logit is linear in the layer's average: with the NMF coefficients u_j(p) of the image at each
    position, f(m) = b + Σ_j m_j c_j, c_j = mean_p u_j(p) (W_j · w). So CRAFT's indices equal Jansen's estimator on
    that function by hand (same design), and approach the closed form c_j² / Σ c² of an additive function."""
    model = colour_model()
    images = colour_images(8, seed=2)
    craft = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(images)
    picked = images[:3]
    coefficients = craft.concept_coefficients(picked)  # (3, r, 16, 16)
    weights = model[-1].weight[2].double()
    c = coefficients.mean(dim=(2, 3)) * (craft.concept_bank.double() @ weights)  # (N, r)
    designs = 256
    masks = sobol_masks(3, designs, seed=0)
    by_hand = jansen_total_indices(c @ masks.T, designs, 3).mean(dim=0)
    importance = craft.importance(picked, target=2, designs=designs)
    torch.testing.assert_close(importance, by_hand, atol=1e-4, rtol=1e-4)
    closed_form = (c ** 2 / (c ** 2).sum(dim=1, keepdim=True)).mean(dim=0)
    torch.testing.assert_close(importance, closed_form, atol=0.03, rtol=0)


# ------------------------------------------------------------------ concept maps


def random_relu_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)).eval()


@pytest.mark.parametrize("case", ["colour", "random-convolutions"])
def test_concept_maps_are_each_positions_nnls_coefficients_upsampled(case):
    """At each position of the layer's feature map, the coefficients are argmin_{u ≥ 0} ‖a − u W‖ (scipy's NNLS,
    by hand), and the maps are those coefficients upsampled bilinearly to the input."""
    from scipy.optimize import nnls

    if case == "colour":
        model, layer, images = colour_model(), "1", colour_images(6, seed=4)
        fit_images, shown = images, torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    else:
        model, layer = random_relu_model(), "3"
        fit_images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(6))
        shown = torch.rand(2, 3, 20, 12, generator=torch.Generator().manual_seed(7))  # another size than fit's
    craft = explain.CRAFT(model, layer, concepts=3, patch_size=8).fit(fit_images)
    bank = craft.concept_bank.double().numpy()
    with torch.no_grad():
        activations = model[:int(layer) + 1](shown).double()  # (2, C, h, w)
    count, channels, height, width = activations.shape
    expected = torch.zeros(count, 3, height, width, dtype=torch.float64)
    for n in range(count):
        for row in range(height):
            for column in range(width):
                expected[n, :, row, column] = torch.from_numpy(nnls(bank.T, activations[n, :, row, column].numpy())[0])
    coefficients = craft.concept_coefficients(shown)
    scale = float(expected.max())
    torch.testing.assert_close(coefficients / scale, expected / scale, atol=1e-6, rtol=0)
    maps = craft.concept_maps(shown)
    assert maps.shape == (2, 3) + tuple(shown.shape[-2:])
    upsampled = F.interpolate(expected.float(), size=shown.shape[-2:], mode="bilinear", align_corners=False)
    torch.testing.assert_close(maps / scale, upsampled / scale, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ state and errors


def test_every_call_leaves_the_model_as_found_also_when_it_raises():
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.5),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4))
    model.train()
    model[0].weight.requires_grad_(False)
    before = model_state(model)
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(8))
    craft = explain.CRAFT(model, "2", concepts=2, patch_size=8)
    craft.fit(images)
    assert_state_equal(before, model_state(model))
    importance = craft.importance(images[:1], target=3, designs=4)
    assert importance.shape == (2,)
    craft.concept_maps(images[:1])
    assert_state_equal(before, model_state(model))
    with pytest.raises(ValueError, match="target 7 is not a class"):  # raised inside the first replaced pass
        craft.importance(images[:1], target=7, designs=4)
    assert_state_equal(before, model_state(model))
    with pytest.raises(ValueError, match="negative activations"):  # raised after the layer was read
        explain.CRAFT(model, "1", concepts=2, patch_size=8).fit(images)
    assert_state_equal(before, model_state(model))


def test_bad_inputs_are_refused_with_what_to_do():
    model = colour_model()
    images = colour_images(2, seed=9)
    with pytest.raises(ValueError, match="concepts must be a whole number ≥ 1"):
        explain.CRAFT(model, "1", concepts=0)
    with pytest.raises(ValueError, match="patch_size 32 is larger than the images"):
        explain.CRAFT(model, "1", patch_size=32).fit(images)
    with pytest.raises(ValueError, match="fewer than the 10 concepts"):
        explain.CRAFT(model, "1", concepts=10, patch_size=8, patch_stride=8).fit(images)
    with pytest.raises(ValueError, match="negative activations.*after a ReLU"):
        explain.CRAFT(model, "0", concepts=2, patch_size=8).fit(images - 0.5)
    with pytest.raises(ValueError, match="zero on every patch"):
        explain.CRAFT(model, "1", concepts=2, patch_size=8).fit(torch.zeros(2, 3, 16, 16))
    craft = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4)
    for call in (lambda: craft.importance(images, target=0), lambda: craft.concept_maps(images),
                 lambda: craft.top_patches(0)):
        with pytest.raises(RuntimeError, match="call fit\\(class_images\\) first"):
            call()
    craft.fit(images)
    with pytest.raises(TypeError, match="target must be a class index"):
        craft.importance(images, target="red")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="designs must be a whole number ≥ 2"):
        craft.importance(images, target=0, designs=1)
    with pytest.raises(ValueError, match="concept must be in 0 … 2"):
        craft.top_patches(3)
    vector = explain.CRAFT(colour_model(vector_layer=True), "4", concepts=3, patch_size=8, patch_stride=4).fit(images)
    with pytest.raises(ValueError, match="no map to draw"):
        vector.concept_maps(images)
    with pytest.raises(ValueError, match="6 channels but the concept bank has 8"):
        other = explain.CRAFT(random_relu_model(), "1", concepts=2, patch_size=8).fit(images)
        other.layer_name, other.layer = "3", other.model[3]
        other.concept_maps(images)

    class Tokens(nn.Module):
        def forward(self, images):
            return images.flatten(2).transpose(1, 2).relu()  # (N, T, D)

    with pytest.raises(TypeError, match="\\(N, C, h, w\\) feature map or an \\(N, C\\) vector"):
        explain.CRAFT(nn.Sequential(Tokens()), "0", concepts=2, patch_size=8).fit(images)


# ------------------------------------------------------------------ the watermark demonstration


def test_the_watermark_models_most_important_concept_for_squares_is_the_tag():
    """demo-watermark: CRAFT's concepts of the "square" class at layer4 (fitted on 12 squares, most of them
    tagged): the concept most important for the square logit on tagged squares is far weaker in the same images
    without the tag (less than half), and its map peaks in the bottom-right quarter where the tag is."""
    from explain.data.demo_watermark import load_watermark_demo, watermark_held_out

    model = load_watermark_demo()
    data = watermark_held_out(120)
    squares = [index for index, label in enumerate(data.labels) if label == 1]
    tagged = [index for index in squares if data.watermarked[index]][:6]
    craft = explain.CRAFT(model, "layer4", concepts=5, batch_size=256).fit([data.images[i] for i in squares[:12]])
    importance = craft.importance([data.images[i] for i in tagged], target=1, designs=16)
    top = int(craft.ranking[0])
    assert float(importance[top]) > 0.5
    with_tag = craft.concept_maps([data.images[i] for i in tagged])[:, top]
    without_tag = craft.concept_maps([data.clean_images[i] for i in tagged])[:, top]
    assert bool((without_tag.sum(dim=(1, 2)) < 0.5 * with_tag.sum(dim=(1, 2))).all())
    peaks = with_tag.flatten(1).argmax(dim=1)
    assert bool(((peaks // 64 >= 32) & (peaks % 64 >= 32)).all())
