"""TCAV (Kim et al. 2018) and FastCAV (Schmalwasser et al. 2025) as specifications: the score is the share of the
class's images whose class-logit gradient at the layer points along the CAV, computed here by hand with autograd;
equal to Captum's TCAV given the same CAV classifier; FastCAV's CAV is its closed form; the significance test
separates a concept the model uses from random sets; the model is left as found."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.tcav import fastcav


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3)).eval()


def image_set(count: int, seed: int, red: float = 0.0) -> torch.Tensor:
    images = torch.rand(count, 3, 12, 12, generator=torch.Generator().manual_seed(seed))
    images[:, 0] += red  # a "red" concept
    return images


def test_fastcav_is_the_mean_of_the_centred_concept_activations_normalised():
    concept, random = torch.randn(7, 5) + 1, torch.randn(9, 5)
    centre = torch.cat([concept, random]).mean(0)
    expected = (concept - centre).mean(0)
    torch.testing.assert_close(fastcav(concept, random), expected / expected.norm())


def test_the_score_is_the_share_of_positive_directional_derivatives_worked_by_hand():
    model = small_cnn()
    before = model_state(model)
    tcav = explain.TCAV(model, ["2", "3"], cav="fastcav", batch_size=5)
    class_images, concept, random = image_set(11, 1), image_set(10, 2, red=0.8), image_set(10, 3)
    cavs = {layer: tcav.cav(tcav.activations(concept)[layer], tcav.activations(random)[layer]) for layer in ("2", "3")}
    gradients = tcav.gradients(class_images, target=1)
    assert_state_equal(before, model_state(model))
    for name, layer in (("2", model[2]), ("3", model[3])):
        store = {}
        handle = layer.register_forward_hook(lambda module, args, output, store=store: store.update(a=output))
        try:
            x = class_images.clone().requires_grad_(True)
            logits = model(x)
            (grad,) = torch.autograd.grad(logits[:, 1].sum(), store["a"])
        finally:
            handle.remove()
        torch.testing.assert_close(gradients[name], grad.flatten(1))
        expected = float(((grad.flatten(1) @ cavs[name]) > 0).double().mean())
        assert explain.TCAV.score(gradients[name], cavs[name]) == expected
        with torch.no_grad():
            acts = {}
            handle = layer.register_forward_hook(lambda module, args, output, acts=acts: acts.update(a=output))
            model(concept)
            handle.remove()
        torch.testing.assert_close(tcav.activations(concept)[name], acts["a"].flatten(1))


def test_scores_equal_captums_tcav_given_the_same_cav_classifier(tmp_path):
    """Captum's TCAV with a classifier that returns FastCAV's vectors: its sign_count for the concept equals our
    score, at each layer and for each random set. (Captum's default classifier trains scikit-learn's SGDClassifier
    on a random 67 % split with an unseeded shuffle, so its CAVs, and scores near 0.5, vary from run to run: the
    comparison takes the classifier out of the equation.)"""
    pytest.importorskip("captum")
    from captum.concept import TCAV as CaptumTCAV
    from captum.concept import Concept
    from captum.concept._utils.classifier import Classifier
    from torch.utils.data import DataLoader

    class FastCavClassifier(Classifier):
        def __init__(self):
            self.ids, self.rows = [], torch.zeros(0)

        def train_and_eval(self, dataloader, **kwargs):
            features, labels = zip(*dataloader)
            features, labels = torch.cat(features), torch.cat(labels)
            self.ids = sorted(set(labels.tolist()))
            first, second = (features[labels == identity] for identity in self.ids)
            self.rows = torch.stack([fastcav(first, second), fastcav(second, first)])
            return {"accs": torch.tensor(1.0)}

        def weights(self):
            return self.rows

        def classes(self):
            return self.ids

    model = small_cnn()
    class_images = image_set(9, 1)
    concept_images, randoms = image_set(10, 2, red=0.8), [image_set(10, 3 + i) for i in range(2)]

    def loader(images):
        return DataLoader(list(images), batch_size=4)

    concept = Concept(0, "red", loader(concept_images))
    random_concepts = [Concept(1 + i, f"random{i}", loader(images)) for i, images in enumerate(randoms)]
    captum_tcav = CaptumTCAV(model, ["2", "3"], classifier=FastCavClassifier(), save_path=str(tmp_path / "cav"))
    captum_scores = captum_tcav.interpret(class_images, [[concept, random] for random in random_concepts], target=1)
    ours = explain.TCAV(model, ["2", "3"], cav="fastcav")
    gradients = ours.gradients(class_images, target=1)
    for index, random in enumerate(randoms):
        key = f"0-{index + 1}"
        for layer in ("2", "3"):
            cav = ours.cav(ours.activations(concept_images)[layer], ours.activations(random)[layer])
            expected = float(captum_scores[key][layer]["sign_count"][0])
            assert ours.score(gradients[layer], cav) == pytest.approx(expected, abs=1e-6)


class RedDetector(nn.Module):
    """Class 1's logit is the mean over pixels of ReLU(red − green) at layer "features" (the image's colours), class
    0's of ReLU(blue − red): a concept "red" the model uses for class 1 and against class 0; each image's gradient
    at the layer depends on which of its pixels are red, so random directions score about half of them."""

    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(3, 3, 1, bias=False)
        with torch.no_grad():
            self.features.weight.copy_(torch.eye(3).view(3, 3, 1, 1))

    def forward(self, x):
        red, green, blue = self.features(x).unbind(1)
        return torch.stack([torch.relu(blue - red).mean((1, 2)), torch.relu(red - green).mean((1, 2)),
                            green.mean((1, 2))], dim=1)


@pytest.mark.parametrize("cav", ["fastcav", "sgd"])
def test_a_concept_the_class_uses_is_significant_in_the_direction_it_is_used(cav):
    """"red" raises class 1 on every image (score 1, significant) and lowers class 0 (score 0, significant: the
    test is two-sided). A fixed random "concept" set is not asserted non-significant: its CAVs against the random
    sets share its own mean's deviation, so their scores are correlated, and the paper's t-test then rejects more
    often than alpha (p from 0.001 to 0.98 over six such sets here); docs/concepts.md says so."""
    model = RedDetector().eval()
    tcav = explain.TCAV(model, "features", cav=cav)
    randoms = [image_set(20, 10 + i) for i in range(16)]
    result = tcav.test(image_set(20, 5), target=1, concepts={"red": image_set(20, 4, red=0.8)}, randoms=randoms)
    red = result.test("red", "features")
    assert red.mean == 1.0 and red.significant and 0.2 < float(red.null_scores.mean()) < 0.8
    assert "| red | features | 1.000 ± 0.000 |" in result.markdown()
    against = tcav.test(image_set(20, 5), target=0, concepts={"red": image_set(20, 4, red=0.8)}, randoms=randoms)
    assert against.test("red", "features").mean == 0.0 and against.test("red", "features").significant


def test_folders_of_images_are_concept_sets_and_bad_requests_are_refused(tmp_path):
    from PIL import Image

    model = RedDetector().eval()
    for name, red in (("red", 200), ("random0", 0), ("random1", 0)):
        folder = tmp_path / name
        folder.mkdir()
        generator = torch.Generator().manual_seed(len(name))
        for index in range(6):
            pixels = (torch.rand(12, 12, 3, generator=generator) * 55).byte()
            pixels[..., 0] += red
            Image.fromarray(pixels.numpy()).save(folder / f"{index}.png")
    tcav = explain.TCAV(model, "features")
    result = tcav.test(tmp_path / "red", target=1, concepts={"red": tmp_path / "red"},
                       randoms=[tmp_path / "random0", tmp_path / "random1"])
    assert result.test("red", "features").mean == 1.0
    with pytest.raises(ValueError, match="at least 2 random"):
        tcav.test(tmp_path / "red", 1, {"red": tmp_path / "red"}, [tmp_path / "random0"])
    with pytest.raises(ValueError, match="not a class"):
        tcav.gradients(tmp_path / "red", target=7)
    with pytest.raises(ValueError, match="no image files"):
        (tmp_path / "empty").mkdir()
        tcav.activations(tmp_path / "empty")
    with pytest.raises(ValueError, match="cav must be"):
        explain.TCAV(model, "features", cav="svm")
