"""TCAV and CRAFT attacked as a hostile user would: a model returning a dict (HuggingFace's ModelOutput), an enclosing
bfloat16 autocast, folders of images, patches that span fewer dimensions than the concepts asked, transformer tokens;
for TCAV sets that are the same images in another order, a layer the model computes without gradients, and files that
are no RGB image. Each value is checked against a computation by hand: CRAFT's importance against the closed-form
total Sobol indices of a logit linear in the concepts, TCAV's scores against the share of positive directional
derivatives along FastCAV's CAV."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from PIL import Image
from scipy.optimize import nnls
from test_craft import colour_images, colour_model
from torch import nn

import explain

# ------------------------------------------------------------------ CRAFT


class DictOutput(nn.Module):
    """A model returning {"logits": ..., "hidden": ...}, as a HuggingFace classifier's output reads."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.model(x), "hidden": x.mean(dim=(2, 3))}


def linear_importance_by_hand(craft: explain.CRAFT, model: nn.Module, image: torch.Tensor, target: int
                              ) -> torch.Tensor:
    """The total Sobol indices of a logit linear in the vector layer's activation a = Σ_j m_j u_j W_j: with m_j
    uniform and independent, S_T,j = c_j² / Σ c², c_j = u_j (W_j · w_target); u the NNLS coefficients of a in W."""
    bank = craft.concept_bank.double()
    activation = torch.relu(model[0](image[None])).mean(dim=(2, 3))[0].double()  # layer "4": the pooled vector
    coefficients = torch.tensor(nnls(bank.T.numpy(), activation.detach().numpy())[0])
    contribution = coefficients * (bank @ model[-1].weight[target].detach().double())
    return contribution ** 2 / (contribution ** 2).sum()


def test_craft_reads_the_logits_of_a_model_returning_a_dict_and_they_give_the_closed_form_importance():
    """HEAD: importance refused every model whose output is not a tensor ("got dict"), HuggingFace's classifiers
    included, though TCAV reads their logits."""
    plain = colour_model(vector_layer=True)
    wrapped = DictOutput(plain).eval()
    images = colour_images(4, seed=0)
    before = model_state(wrapped)
    craft = explain.CRAFT(wrapped, "model.4", concepts=3, patch_size=8, patch_stride=8).fit(images)
    importance = craft.importance(images[:1], target=2, designs=1024)
    torch.testing.assert_close(importance, linear_importance_by_hand(craft, plain, images[0], 2), atol=0.02, rtol=0)
    by_key = explain.CRAFT(wrapped, "model.4", concepts=3, patch_size=8, patch_stride=8, output="logits").fit(images)
    torch.testing.assert_close(by_key.importance(images[:1], target=2, designs=1024), importance, atol=0, rtol=0)
    with pytest.raises(ValueError, match="no key or attribute 'scores'"):
        explain.CRAFT(wrapped, "model.4", concepts=3, patch_size=8, output="scores").fit(images).importance(
            images[:1], target=0, designs=4)
    assert_state_equal(before, model_state(wrapped))


def test_craft_under_a_bfloat16_autocast_gives_the_full_precision_bank_and_importance():
    """HEAD: an enclosing autocast ran the model in bfloat16 during fit and importance, silently giving another bank
    and other importances (TCAV turns it off)."""
    model = colour_model()
    images = colour_images(4, seed=1) * 0.987  # strengths whose bfloat16 rounding shows
    reference = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(images)
    expected = reference.importance(images[:2], target=2, designs=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        craft = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(images)
        importance = craft.importance(images[:2], target=2, designs=16)
    torch.testing.assert_close(craft.patch_activations, reference.patch_activations, atol=0, rtol=0)
    torch.testing.assert_close(importance, expected, atol=1e-12, rtol=0)


def save_images(folder, images: torch.Tensor) -> list:
    folder.mkdir()
    paths = []
    for index, image in enumerate(images):
        path = folder / f"{index:02d}.png"
        Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(path)
        paths.append(path)
    return paths


def test_craft_takes_a_folder_of_images_as_its_files(tmp_path):
    """HEAD: a folder was refused (IsADirectoryError) by fit, importance and concept_maps, though TCAV takes one."""
    model = colour_model()
    paths = save_images(tmp_path / "class", colour_images(3, seed=2))
    (tmp_path / "class" / "notes.txt").write_text("not an image")
    from_files = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(paths)
    from_folder = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(tmp_path / "class")
    torch.testing.assert_close(from_folder.concept_bank, from_files.concept_bank, atol=0, rtol=0)
    torch.testing.assert_close(from_folder.concept_maps(str(tmp_path / "class")), from_files.concept_maps(paths),
                               atol=0, rtol=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty holds no image files"):
        from_folder.importance(tmp_path / "empty", target=0, designs=4)


def test_craft_warns_at_the_callers_line_when_the_patches_span_fewer_dimensions_than_concepts():
    """Constant images: every patch has the same activation (rank 1), so a bank of 3 concepts splits one direction
    arbitrarily. HEAD fitted it silently; the warning names the rank, and a varied set fits without one."""
    model = colour_model()
    constant = torch.zeros(2, 3, 16, 16)
    constant[:, 0] = 0.8  # all red
    with pytest.warns(UserWarning, match="span only 1 dimension, fewer than the 3 concepts.*concepts ≤ 1") as caught:
        craft = explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(constant)
    assert caught[0].filename == __file__
    reconstruction = craft.patch_coefficients @ craft.concept_bank  # still a factorisation of the activations
    torch.testing.assert_close(reconstruction, craft.patch_activations, atol=1e-4, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain.CRAFT(model, "1", concepts=3, patch_size=8, patch_stride=4).fit(colour_images(4, seed=0))


class Tokens(nn.Module):
    """Patches to (N, 4, 8) tokens, then a GELU MLP block and a head on the mean token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block, self.head = nn.Conv2d(3, 8, 8, stride=8), nn.Sequential(nn.Linear(8, 8), nn.GELU()), \
            nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x).flatten(2).transpose(1, 2)).mean(dim=1))


def test_craft_on_transformer_tokens_says_why_not_and_what_to_use():
    model = Tokens().eval()
    before = model_state(model)
    with pytest.raises(explain.core.capture.LayerOutputError,
                       match=r"gives \(\d+, 4, 8\).*Tokens \(N, tokens, D\).*negative.*TCAV"):
        explain.CRAFT(model, "block", concepts=2, patch_size=8).fit(torch.rand(2, 3, 16, 16))
    assert_state_equal(before, model_state(model))


# ------------------------------------------------------------------ TCAV


class SquaredMeans(nn.Module):
    """Layer "flat": each channel's mean minus 0.5 (N, 3); logit k = Σ_d A[k, d] f_d², so ∂logit_k/∂f = 2 A[k] ⊙ f.
    Layer "side" (a ReLU, or a view of the input: torch marks it as requiring gradients but none flow) is computed
    without gradients and added to the logits."""

    def __init__(self, side: Optional[nn.Module] = None):
        super().__init__()
        self.pool, self.flat, self.side = nn.AdaptiveAvgPool2d(1), nn.Flatten(), side or nn.ReLU()
        self.weights = nn.Parameter(torch.tensor([[1.0, -2.0, 0.5], [0.3, 1.0, -1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.flat(self.pool(x) - 0.5)
        with torch.no_grad():
            side = self.side(x[:, 0, 0, :1])
        return features ** 2 @ self.weights.T + side


def fastcav_scores_by_hand(class_images, target, concept, randoms, weights) -> list[float]:
    """The share of class images whose directional derivative 2 A[target] ⊙ f along FastCAV's CAV is positive."""
    def features(x):
        return x.mean(dim=(2, 3)) - 0.5
    gradients = 2 * weights[target] * features(class_images)
    scores = []
    for random in randoms:
        both = torch.cat([features(concept), features(random)])
        direction = (features(concept) - both.mean(dim=0)).mean(dim=0)
        scores.append(float(((gradients @ (direction / direction.norm())) > 0).double().mean()))
    return scores


@pytest.mark.parametrize("cav", ["fastcav", "sgd"])
def test_a_concept_or_random_set_that_is_another_set_in_another_order_is_refused(cav):
    """HEAD compared sets row by row: the same images in another order passed, and FastCAV's CAV between them, the
    rounding of two equal means, was scored as a concept."""
    model = SquaredMeans().eval()
    generator = torch.Generator().manual_seed(3)
    class_images, concept = torch.rand(20, 3, 8, 8, generator=generator), torch.rand(10, 3, 8, 8, generator=generator)
    randoms = [torch.rand(10, 3, 8, 8, generator=generator) for _ in range(2)]
    before = model_state(model)
    with pytest.raises(ValueError, match="concept 'c' and random set 0 have equal activations"):
        explain.TCAV(model, ["flat"], cav=cav).test(class_images, 0, {"c": randoms[0].flip(0)}, randoms)
    with pytest.raises(ValueError, match="random set 0 and random set 1 have equal activations"):
        reordered = randoms[0][[2, 0, 1, *range(3, 10)]]
        explain.TCAV(model, ["flat"], cav=cav).test(class_images, 0, {"c": concept}, [randoms[0], reordered])
    assert_state_equal(before, model_state(model))
    if cav == "fastcav":  # distinct sets: the by-hand scores
        result = explain.TCAV(model, ["flat"], cav=cav).test(class_images, 0, {"c": concept}, randoms)
        expected = fastcav_scores_by_hand(class_images, 0, concept, randoms, model.weights.detach())
        assert result.tests[0].scores.tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("side", [nn.ReLU(), nn.Flatten()])
def test_a_layer_computed_without_gradients_is_named_in_a_clear_error(side):
    """HEAD: torch's "One of the differentiated Tensors does not require grad", naming no layer (ReLU); for a view,
    "does not depend on layer side", not saying why."""
    model = SquaredMeans(side).eval()
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    before = model_state(model)
    with pytest.raises(ValueError, match="layer side.*torch.no_grad"):
        explain.TCAV(model, ["flat", "side"]).gradients(images, 0)
    assert_state_equal(before, model_state(model))
    gradients = explain.TCAV(model, ["flat"]).gradients(images, 1)["flat"]
    torch.testing.assert_close(gradients, 2 * model.weights[1].detach() * (images.mean(dim=(2, 3)) - 0.5))


@pytest.mark.parametrize("pixels", ["RGBA", "I;16"])
def test_a_file_that_is_no_rgb_image_is_named_with_its_set(tmp_path, pixels):
    """HEAD named the set for unreadable files and mixed sizes only; an RGBA or 16-bit file's error did not say which
    of the sets (concept, random, class) holds it."""
    model = SquaredMeans().eval()
    generator = np.random.default_rng(0)
    folders = {}
    for name in ("class", "concept", "r0", "r1"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        for index in range(3):
            pixels_of = (generator.random((8, 8, 3)) * 255).astype(np.uint8)
            Image.fromarray(pixels_of).save(folders[name] / f"{index}.png")
    odd = (generator.random((8, 8, 4)) * 255).astype(np.uint8) if pixels == "RGBA" else \
        (generator.random((8, 8)) * 65535).astype(np.uint16)
    Image.fromarray(odd).save(folders["r1"] / "odd.png")
    with pytest.raises(ValueError, match="^random set 1: .*odd.png has"):
        explain.TCAV(model, ["flat"], cav="fastcav").test(folders["class"], 0, {"c": folders["concept"]},
                                                          [folders["r0"], folders["r1"]])
