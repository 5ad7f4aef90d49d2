"""Concept methods attacked as a hostile user: CRP against an LRP written out by hand (the CRP paper's conditional
relevance: the relevance at the layer masked to the concept, propagated the rest of the way with the same rules);
concept indices given as text, one float or negatives; a layer inside a squeeze-and-excitation gate; TCAV's alpha,
randoms and concepts given in the wrong form, 1-D and sequence-first layer outputs, a set of mixed sizes named; CRAFT's
top patches and the total Sobol index of a single concept."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.concepts import concept_references
from explain.methods.craft import CRAFT, jansen_total_indices, sobol_masks
from explain.methods.tcav import TCAV

# ------------------------------------------------------------------ CRP against LRP written out by hand


def tiny_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(5 * 6 * 6, 3)).eval()


def stabilized(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    return z + epsilon * torch.where(z >= 0, 1.0, -1.0).to(z)


def lrp_by_hand(model: nn.Sequential, x: torch.Tensor, label: int, keep: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The epsilon_plus composite written out (z⁺ for the convolutions: R_i = Σ_j x_i w⁺_ij / (Σ x w⁺ + b⁺)_j R_j on
    non-negative inputs; ε for the linear layer: R_i = Σ_j x_i w_ij / (z_j ± ε) R_j; ReLU passes relevance on), in
    float64, starting from the class's logit. At the second ReLU's output (layer "3") the relevance is multiplied by
    ``keep`` (C,) per channel (None: kept). Returns the input relevance (N, 3, H, W) and the layer's relevance per
    channel (N, C) before the mask."""
    conv1, _, conv2, _, _, linear = list(model)
    w1, b1, w2, b2 = conv1.weight.double(), conv1.bias.double(), conv2.weight.double(), conv2.bias.double()
    wl, bl = linear.weight.double(), linear.bias.double()
    x0 = x.double()
    a1 = F.relu(F.conv2d(x0, w1, b1, padding=1))
    a2 = F.relu(F.conv2d(a1, w2, b2, padding=1))
    flat = a2.flatten(1)
    z = flat @ wl.T + bl
    start = torch.zeros_like(z)
    start[:, label] = z[:, label]
    relevance = flat * ((start / stabilized(z, 1e-6)) @ wl)  # ε rule (explain's default ε is 1e-6)
    relevance = relevance.view_as(a2)
    per_channel = relevance.sum(dim=(2, 3))
    if keep is not None:
        relevance = relevance * keep.double().view(1, -1, 1, 1)

    def zplus(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
        positive = weight.clamp(min=0)
        zp = F.conv2d(inputs, positive, bias.clamp(min=0), padding=1)
        share = above / stabilized(zp, 1e-6)
        return inputs * F.conv_transpose2d(share, positive, padding=1)

    relevance = zplus(a1, w2, b2, relevance)
    return zplus(x0, w1, b1, relevance), per_channel


def test_each_crp_map_is_lrp_written_out_by_hand_with_the_layers_relevance_masked_and_they_sum_to_lrps():
    model = tiny_cnn()
    x = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    label = 2
    before = model_state(model)
    crp = explain.ConceptRelevance(model, "3", composite="epsilon_plus")
    e = crp.explain(x, target=label, concepts=None)
    assert_state_equal(before, model_state(model))
    unmasked, per_channel = lrp_by_hand(model, x, label, None)
    torch.testing.assert_close(e.diagnostics["layer_relevance"], per_channel, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(e.scores.double(), per_channel, rtol=1e-4, atol=1e-7)
    for concept in range(5):
        by_hand, _ = lrp_by_hand(model, x, label, torch.eye(5)[concept])
        torch.testing.assert_close(e.attributions[:, concept].double(), by_hand, rtol=1e-4, atol=1e-7)
    # conservation over concepts: the conditional input relevances of all channels sum to the unconditional one
    torch.testing.assert_close(e.attributions.sum(1).double(), unmasked, rtol=1e-4, atol=1e-7)
    # ... and an image explained alone gets the maps it gets in the batch
    alone = crp.explain(x[1:], target=label, concepts=[4, 0], bypass=False)
    torch.testing.assert_close(alone.attributions[0], e.attributions[1, [4, 0]], rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------ CRP: concepts given wrong


class Counting(nn.Module):
    """tiny_cnn counting its forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_cnn()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x)


def test_concepts_given_as_text_one_float_or_negatives_are_refused_saying_what_to_give():
    """HEAD: "3" raised TypeError "new(): invalid data type 'str'", 1.0 said "got shape ()", and concept_references
    ran the whole set before refusing a negative channel."""
    model = Counting().eval()
    x = torch.rand(3, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    crp = explain.ConceptRelevance(model, "net.3", composite="epsilon_plus")
    with pytest.raises(ValueError, match="is text; give the channels' indices as numbers"):
        crp.explain(x, concepts="3")
    with pytest.raises(ValueError, match="give an int k .* as a list \\(channel 1: \\[1\\]\\)"):
        crp.explain(x, concepts=1.0)
    with pytest.raises(ValueError, match="is text"):
        concept_references(crp, x, concepts="3")
    model.calls = 0
    with pytest.raises(ValueError, match="must be ≥ 0.*got -1"):
        concept_references(crp, x, concepts=[2, -1])
    assert model.calls == 0  # refused before the set runs
    with pytest.raises(ValueError, match="not channel indices"):
        crp.explain(x, concepts=[[1, 2], [3]])
    # what is right still works: float whole numbers are channels, duplicates give the same map twice
    e = crp.explain(x, concepts=[3.0, 3], bypass=False)
    assert e.class_indices.tolist() == [[3, 3]] * 3
    torch.testing.assert_close(e.attributions[:, 0], e.attributions[:, 1], rtol=0, atol=0)


def test_a_layer_inside_a_squeeze_and_excitation_gate_is_said_to_get_no_relevance_from_the_rules():
    """LRP treats the SE block's gate as a constant weight, so its fc layers get no relevance although the score
    depends on them; HEAD said the layer is "not on the path … give a layer the prediction depends on", which it is.
    The SE block's output, on the main path, conserves relevance over its channels."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=4).eval()
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    before = model_state(model)
    with pytest.raises(ValueError, match="gate, such as a squeeze-and-excitation block's fc layers"):
        explain.ConceptRelevance(model, "features.1.block.1.fc1").explain(x)
    assert_state_equal(before, model_state(model))
    e = explain.ConceptRelevance(model, "features.1.block.1", batch_size=64).explain(x, concepts=None, bypass=False)
    reference = explain.LRP(model).explain(x).attributions[:, 0]
    assert float((e.attributions.sum(1) - reference).abs().max()) <= 1e-4 * float(reference.abs().max())
    assert_state_equal(before, model_state(model))


# ------------------------------------------------------------------ TCAV


def sets(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(3, 3, 12, 12, generator=generator) for _ in range(count)]


def test_tcav_refuses_an_alpha_outside_0_1_randoms_given_as_one_folder_and_concepts_not_a_mapping():
    """HEAD: alpha=5 (meant as 5 %) called every test significant; randoms="folder" was read character by character
    ("random set 0: / holds no image files"); concepts as a list raised AttributeError."""
    model = tiny_cnn_tcav()
    cls, concept, r0, r1 = sets(4, 4)
    tcav = TCAV(model, ["2"], cav="fastcav")
    for alpha in (5, 0, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match="alpha must be a significance level in \\(0, 1\\)"):
            tcav.test(cls, 1, {"c": concept}, [r0, r1], alpha=alpha)
    with pytest.raises(ValueError, match="randoms must be a list of random sets"):
        tcav.test(cls, 1, {"c": concept}, "/tmp/random")
    with pytest.raises(ValueError, match="randoms must be a list of random sets"):
        tcav.test(cls, 1, {"c": concept}, r0)
    with pytest.raises(ValueError, match="concepts must map each concept's name to its images"):
        tcav.test(cls, 1, [concept], [r0, r1])
    result = tcav.test(cls, 1, {"c": concept}, [r0, r1], alpha=0.05)
    assert result.tests[0].significant == (result.tests[0].p_value < 0.05)


def tiny_cnn_tcav() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()


class Summed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1)


class OneValueLayer(nn.Module):
    """A layer giving one value per image, (N,), that the logits read."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.total = Summed()
        self.head = nn.Linear(1, 3)
        self.skip = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        return self.head(torch.tanh(self.total(h))[:, None]) + self.skip(h)


def test_a_layer_with_one_value_per_image_is_scored_by_hand():
    """(N,) outputs were refused by HEAD with an IndexError ("Dimension out of range"); the activation is one value,
    FastCAV's CAV is ±1 (the sign of the concept's mean minus the mean of all), the score the share of images whose
    derivative has that sign."""
    model = OneValueLayer().eval()
    cls, concept, r0, r1 = sets(4, 5)
    result = TCAV(model, ["total"], cav="fastcav").test(cls, 2, {"c": concept}, [r0, r1])

    def value(images):
        with torch.no_grad():
            return model.total(model.features(images))

    images = cls.clone().requires_grad_(True)
    h = model.features(images).detach().requires_grad_(True)
    total = model.total(h)
    gradient = torch.autograd.grad((model.head(torch.tanh(total)[:, None]) + model.skip(h))[:, 2].sum(), total)[0]
    expected = []
    for random in (r0, r1):
        direction = torch.sign(value(concept).mean() - torch.cat([value(concept), value(random)]).mean())
        expected.append(float((gradient * direction > 0).double().mean()))
    assert result.tests[0].scores.tolist() == expected


class SequenceFirst(nn.Module):
    """A transformer layer without batch_first: its output is (T, N, D)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Conv2d(3, 8, 4, 4)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).permute(2, 0, 1)
        return self.head(self.encoder(tokens).mean(0))


def test_a_sequence_first_layer_is_refused_not_scored_over_tokens():
    """HEAD flattened (T, N, D) into T "images" of N·D values each: the scores counted tokens, not images."""
    model = SequenceFirst().eval()
    cls, concept, r0, r1 = sets(4, 6)
    before = model_state(model)
    with pytest.raises(ValueError, match="does not hold the 3 images of the batch along its first dimension"):
        TCAV(model, ["encoder"], cav="fastcav").test(cls, 1, {"c": concept}, [r0, r1])
    assert_state_equal(before, model_state(model))


def test_a_set_of_images_of_several_sizes_is_named_in_the_error(tmp_path):
    from PIL import Image

    folder = tmp_path / "striped"
    folder.mkdir()
    for index, size in enumerate([(12, 12), (16, 12)]):
        Image.fromarray(np.full((size[1], size[0], 3), 40 * index, np.uint8)).save(folder / f"{index}.png")
    cls, r0, r1 = sets(3, 7)
    with pytest.raises(ValueError, match="concept 'striped': the inputs have different sizes"):
        TCAV(tiny_cnn_tcav(), ["2"], cav="fastcav").test(cls, 1, {"striped": str(folder)}, [r0, r1])


# ------------------------------------------------------------------ CRAFT


def test_top_patches_refuses_a_count_below_1_and_a_fractional_concept():
    """HEAD: count=-1 returned every patch but one (a negative slice), concept=0.5 raised an IndexError."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=4).eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    craft = CRAFT(model, "layer3", concepts=2, patch_size=16, patch_stride=8).fit(x)
    for count in (-1, 0, 2.5, True):
        with pytest.raises(ValueError, match="count must be a whole number ≥ 1"):
            craft.top_patches(0, count=count)
    for concept in (0.5, -1, 2, True):
        with pytest.raises(ValueError, match="concept must be in 0 … 1"):
            craft.top_patches(concept)
    assert craft.patch_coefficients is not None and craft.patches is not None
    order = craft.patch_coefficients[:, 1].argsort(descending=True)[:3].numpy()
    np.testing.assert_array_equal(craft.top_patches(torch.tensor(1), count=np.int64(3)), craft.patches[order])


def test_the_total_sobol_index_of_a_single_concept_is_1_where_the_logit_varies():
    """With one variable all of the variance involves it: S_T = 1 exactly. HEAD returned Jansen's sampling noise
    (0.789 with 8 designs on a random ResNet-18's layer3; 0.5 to 1.5 for a linear function below)."""
    masks = sobol_masks(1, 8, seed=0)
    outputs = 3 * masks[:, 0] + 1
    assert jansen_total_indices(outputs, 8, 1).tolist() == [1.0]
    assert jansen_total_indices(torch.ones(3 * 8), 8, 1).tolist() == [0.0]  # a constant: no variance to share
    two = torch.stack([outputs, torch.full_like(outputs, 2.0)])  # several models at once
    assert jansen_total_indices(two, 8, 1).tolist() == [[1.0], [0.0]]
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=4).eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    craft = CRAFT(model, "layer3", concepts=1, patch_size=16, patch_stride=8).fit(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert craft.importance(x, 1, designs=8).tolist() == [1.0]


def dead_layer_model() -> nn.Module:
    """A ReLU that is zero on every image (its convolution's bias is -100), followed by a layer that is not."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        conv.bias.fill_(-100.0)
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 10 * 10, 3)).eval()


@pytest.mark.filterwarnings("ignore:Maximum number of iteration reached")  # sklearn, on the all-zero layer
def test_a_layer_that_is_zero_on_every_image_is_refused_by_both_cavs_naming_the_layer():
    """HEAD: the SGD classifier's weights on an all-zero layer are 0, so its CAV was 0 (0 / 1e-12) and every score 0
    with p = 1, silently; FastCAV refused without naming the layer. With the dead layer alone, the sets were called
    "the same images"."""
    model = dead_layer_model()
    cls, concept, r0, r1 = sets(4, 10)
    before = model_state(model)
    for cav in ("sgd", "fastcav"):
        with pytest.raises(ValueError, match="at layer 1, random set 0 against random set 1: .*constant, e.g. zero "
                                             "after a ReLU"):
            TCAV(model, ["1", "0"], cav=cav).test(cls, 1, {"c": concept}, [r0, r1])
        with pytest.raises(ValueError, match="the same images, or the layers give all images the same activations"):
            TCAV(model, ["1"], cav=cav).test(cls, 1, {"c": concept}, [r0, r1])
    assert_state_equal(before, model_state(model))
