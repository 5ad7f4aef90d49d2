"""Deep feature factorisation on the demo model's held-out images: non-negative concept maps that
reconstruct the layer's activations, a concept per class that peaks on the deciding object, and the
classes each concept scores through the classifier, checked by hand."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import SmallCNN, assert_state_equal, model_state

import explain
from explain import metrics
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.data.train import EVALUATION_SEED
from explain.methods.factorization import nmf

CONCEPTS = 4
IMAGES = 100


@pytest.fixture(scope="module")
def demo():
    model = load_demo_model()
    data = make_dataset(IMAGES, seed=EVALUATION_SEED)
    result = explain.DeepFeatureFactorization(model, "layer4", concepts=CONCEPTS,
                                              class_names=CLASS_NAMES).factorize(list(data.images))
    return model, data, result


def layer4_activations(model, images) -> torch.Tensor:
    """The demo model's layer4 output, by hand (no hooks): (N, 64, 16, 16)."""
    batch = explain.Normalize()  # the default preprocess
    x = torch.stack([batch(image) for image in images])
    with torch.no_grad():
        return model.layer4(model.layer3(model.layer2(model.layer1(model.stem(x)))))


def test_concept_maps_are_non_negative_and_reconstruct_the_activations(demo):
    model, data, result = demo
    assert result.maps.shape == (IMAGES, CONCEPTS, 64, 64) and result.low_res_maps.shape == (IMAGES, CONCEPTS, 16, 16)
    assert result.low_res_maps.min() >= 0 and result.concepts.min() >= 0
    assert result.maps.min() >= 0 and result.maps.max() <= 1
    activations = layer4_activations(model, data.images).double()
    reconstruction = torch.einsum("kc,nkhw->nchw", result.concepts.double(), result.low_res_maps.double())
    error = float((activations - reconstruction).norm() / activations.norm())
    assert error == pytest.approx(result.relative_error, rel=1e-4)
    print(f"relative reconstruction error with {CONCEPTS} concepts: {error:.3f}")
    assert error < 0.3


def test_the_concept_of_each_image_class_peaks_on_the_deciding_object(demo):
    model, data, result = demo
    masks = torch.from_numpy(data.masks)
    concept_of_class = result.concept_probabilities.argmax(dim=0)  # the concept each class is scored highest by
    chosen = concept_of_class[torch.from_numpy(data.labels)]
    class_concept = metrics.pointing_game(result.maps[torch.arange(IMAGES), chosen], masks, tolerance=3).mean()
    any_concept = torch.stack([metrics.pointing_game(result.maps[:, j], masks, tolerance=3)
                               for j in range(CONCEPTS)]).amax(0).mean()
    print(f"pointing within 3 px: the class's concept {class_concept:.2f}, any concept {any_concept:.2f}")
    assert class_concept >= 0.8 and any_concept >= 0.8
    assert sorted(concept_of_class.tolist()) == list(range(CONCEPTS))  # on this model: one concept per class


def test_concept_scores_are_the_classifier_applied_to_the_concept_profiles(demo):
    model, _, result = demo
    with torch.no_grad():
        expected = model.fc(result.concepts)
    torch.testing.assert_close(result.concept_scores, expected)
    assert result.top_classes(1)[0][0][0] == int(expected[0].argmax())
    assert result.labels()[0].startswith("concept 1: ")
    # each concept is scaled so that its maps peak at 1 over the batch
    torch.testing.assert_close(result.low_res_maps.amax(dim=(0, 2, 3)), torch.ones(CONCEPTS))


def test_nmf_reaches_scikit_learn_s_error():
    decomposition = pytest.importorskip("sklearn.decomposition")
    generator = torch.Generator().manual_seed(0)
    matrix = torch.rand(30, 4, generator=generator) @ torch.rand(4, 200, generator=generator)
    matrix += 0.05 * torch.rand(30, 200, generator=generator)
    left, right, error = nmf(matrix, 4, iterations=2000)
    assert left.min() >= 0 and right.min() >= 0
    assert error == pytest.approx(float((matrix.double() - left @ right).norm() / matrix.double().norm()))
    reference = decomposition.NMF(4, init="random", random_state=0, max_iter=2000, tol=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn's ConvergenceWarning at max_iter
        product = reference.fit_transform(matrix.numpy().astype(np.float64)) @ reference.components_
    reference_error = np.linalg.norm(matrix.numpy() - product) / np.linalg.norm(matrix.numpy())
    assert error <= reference_error + 1e-3


def test_figure_overlay_and_the_model_left_as_found(demo, tmp_path):
    _, data, result = demo
    overlays = result.overlay()
    assert overlays.shape == (IMAGES, 64, 64, 3) and overlays.dtype == np.uint8
    figure = result.figure(indices=[0, 1, 2])
    figure.savefig(tmp_path / "concepts.png")
    assert len(figure.axes) == 6 and (tmp_path / "concepts.png").stat().st_size > 0
    torch.manual_seed(0)
    model = SmallCNN().train()
    before = model_state(model)
    explain.DeepFeatureFactorization(model, "features.5", concepts=2).factorize(torch.randn(4, 3, 16, 16))
    assert_state_equal(before, model_state(model))


def test_a_layer_with_negative_activations_is_refused_and_results_are_reproducible():
    model = load_demo_model()
    images = list(make_dataset(6, seed=EVALUATION_SEED).images)
    with pytest.raises(ValueError, match="after a ReLU"):
        explain.DeepFeatureFactorization(model, "layer4.0", concepts=2).factorize(images)  # the conv, before BN
    first = explain.DeepFeatureFactorization(model, "layer4", concepts=3).factorize(images)
    second = explain.DeepFeatureFactorization(model, "layer4", concepts=3).factorize(images)
    torch.testing.assert_close(first.low_res_maps, second.low_res_maps)
