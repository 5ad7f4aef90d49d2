"""TCAV (Kim et al. 2018) and FastCAV (Schmalwasser et al. 2025) as specifications: the score is the share of the
class's images whose class-logit (or, with ``differentiate="log_probability"``, class log-probability) gradient at
the layer points along the CAV, computed here by hand; equal to Captum's TCAV given the same CAV classifier; the SGD
CAV is trained on the reference code's stratified 67 %; FastCAV's CAV is its closed form; the significance test is
Student's two-sided t-test (pooled variance) worked from its formula and separates a concept the model uses from
random sets; the model is left as found."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.tcav import _two_sided_t_test, fastcav, sgd_cav, training_split


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
    often than alpha (Student's p from 0.0003 to 0.73 over six such sets, image_set(20, 40..45), with either CAV:
    4 of 6 below 0.05 with SGD's); docs/concepts.md says so."""
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
        generator = torch.Generator().manual_seed(sum(map(ord, name)))  # each folder its own images
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
    for wrong in ("loss", "probability", "Logit", None):
        with pytest.raises(ValueError, match="differentiate must be 'logit'.*'log_probability'"):
            explain.TCAV(model, "features", differentiate=wrong)


# ---------------------------------------------------------------------------- the reference code's CAV training split


@pytest.mark.parametrize("concept_count, random_count", [(30, 30), (12, 21)])
def test_the_sgd_cav_is_trained_on_a_stratified_67_percent_as_tensorflow_tcav_and_captum(concept_count,
                                                                                          random_count):
    """tensorflow/tcav's cav.py trains on ``train_test_split(x, labels, test_size=0.33, stratify=labels)`` and
    Captum's default classifier holds out ``test_split_ratio=0.33``: the training set is n − ⌈0.33 n⌉ rows, each
    class in proportion, every row one of the activations with its own label; the CAV is SGDClassifier's normal on
    it. (Two sizes: an even split, and an uneven one.)"""
    import inspect

    from captum.concept._utils.classifier import DefaultClassifier
    from sklearn.linear_model import SGDClassifier

    assert inspect.signature(DefaultClassifier.train_and_eval).parameters["test_split_ratio"].default == 0.33
    generator = torch.Generator().manual_seed(concept_count)
    concept = torch.randn(concept_count, 6, generator=generator) + 0.5
    random = torch.randn(random_count, 6, generator=generator)
    features, labels = training_split(concept, random, seed=3)
    total = concept_count + random_count
    kept = total - math.ceil(0.33 * total)
    assert len(labels) == features.shape[0] == kept  # 40 of 60, 22 of 33
    assert int(labels.sum()) == round(concept_count * kept / total)  # stratified: 20 of 30, 8 of 12
    rows = {tuple(row): 1 for row in concept.double().numpy()} | {tuple(row): 0 for row in random.double().numpy()}
    assert all(rows[tuple(row)] == label for row, label in zip(features, labels))
    classifier = SGDClassifier(alpha=0.01, max_iter=1000, tol=1e-3, random_state=3).fit(features, labels)
    expected = torch.as_tensor(classifier.coef_[0], dtype=torch.float32)
    torch.testing.assert_close(sgd_cav(concept, random, seed=3), expected / expected.norm())


# ---------------------------------------------------------------------------- the significance test


def students_two_sided_p(first: np.ndarray, second: np.ndarray) -> float:
    """Student's two-sample t-test from its formula: t = (m₁ − m₂) / √(s²ₚ (1/n₁ + 1/n₂)) with the pooled variance
    s²ₚ = ((n₁ − 1) s₁² + (n₂ − 1) s₂²) / (n₁ + n₂ − 2), ν = n₁ + n₂ − 2 degrees of freedom, and the two-sided
    p = P(|T_ν| ≥ |t|) = I_{ν/(ν+t²)}(ν/2, 1/2) (the regularised incomplete beta function)."""
    from scipy.special import betainc

    n1, n2 = len(first), len(second)
    pooled = ((n1 - 1) * first.var(ddof=1) + (n2 - 1) * second.var(ddof=1)) / (n1 + n2 - 2)
    t = (first.mean() - second.mean()) / math.sqrt(pooled * (1 / n1 + 1 / n2))
    freedom = n1 + n2 - 2
    return float(betainc(freedom / 2, 0.5, freedom / (freedom + t * t)))


def welchs_two_sided_p(first: np.ndarray, second: np.ndarray) -> float:
    """Welch's test (separate variances, Welch–Satterthwaite ν; where one sample is constant, its limit: the other
    sample's one-sample test against that value), what the test was before: for contrast only."""
    from scipy.special import betainc

    a, b = first.var(ddof=1) / len(first), second.var(ddof=1) / len(second)
    t = (first.mean() - second.mean()) / math.sqrt(a + b)
    freedom = (a + b) ** 2 / (a * a / (len(first) - 1) + b * b / (len(second) - 1))
    return float(betainc(freedom / 2, 0.5, freedom / (freedom + t * t)))


@pytest.mark.parametrize("scores, null", [
    ([0.9, 0.95, 0.6, 1.0, 0.7, 0.98, 0.55, 0.9], [0.5, 0.52, 0.49, 0.51, 0.5, 0.48, 0.5, 0.53]),  # unequal variances
    ([0.9, 0.4, 1.0, 0.55, 0.95], [0.45, 0.5, 0.55, 0.5, 0.52, 0.48, 0.5, 0.47, 0.51, 0.49, 0.5, 0.53]),  # and sizes
    ([1.0] * 10, [0.3, 0.6, 0.8, 0.5, 0.9, 0.4, 0.7, 0.6, 0.5, 0.95]),  # a constant sample: the other's variance
])
def test_the_p_value_is_students_two_sided_t_test_with_the_pooled_variance(scores, null):
    """tensorflow/tcav's utils.py: ``ttest_ind(random_i_ups, i_ups)``, scipy's default ``equal_var=True``: Student's
    test, two-sided, here from its formula. Each case is one where Welch's test (the former choice) gives another
    p-value, so the test tells them apart."""
    first, second = np.array(scores), np.array(null)
    expected = students_two_sided_p(first, second)
    assert _two_sided_t_test(torch.tensor(scores, dtype=torch.float64), torch.tensor(null, dtype=torch.float64)
                             ) == pytest.approx(expected, rel=1e-9, abs=1e-300)
    welch = welchs_two_sided_p(first, second)
    assert abs(math.log10(welch) - math.log10(expected)) > 0.3  # Welch's p is another number here
    assert _two_sided_t_test(torch.ones(5, dtype=torch.float64), torch.ones(7, dtype=torch.float64)) == 1.0
    assert _two_sided_t_test(torch.ones(5, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)) == 0.0


def test_a_tcav_tests_p_value_and_significance_are_students_test_with_bonferroni_over_the_concepts():
    """End to end on RedDetector with two concepts: each test's p is Student's from its formula over its scores and
    null scores, and it is significant where p < alpha / 2 (Bonferroni over the 2 concepts)."""
    model = RedDetector().eval()
    tcav = explain.TCAV(model, "features", cav="fastcav")
    randoms = [image_set(20, 30 + i) for i in range(6)]
    concepts = {"red": image_set(20, 4, red=0.8), "faint red": image_set(20, 6, red=0.05)}
    result = tcav.test(image_set(20, 5), target=1, concepts=concepts, randoms=randoms, alpha=0.05)
    checked = 0
    for test in result.tests:
        scores, null = test.scores.numpy(), test.null_scores.numpy()
        if scores.std() == 0 and null.std() == 0:
            continue
        expected = students_two_sided_p(scores, null)
        assert test.p_value == pytest.approx(expected, rel=1e-9)
        assert test.significant == (expected < 0.05 / 2)
        checked += 1
    assert checked >= 1


# ---------------------------------------------------------------------------- the differentiated quantity


class TinyHead(nn.Module):
    """x (N, 3, 2, 2) → a = tanh(W₁ vec(x) + b₁) at layer "hidden" (D = 6) → logits W₂ a + b₂ (4 classes; one class:
    a binary classifier's one logit, trained with a sigmoid)."""

    def __init__(self, classes: int = 4, seed: int = 7):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(12, 6)
        self.hidden = nn.Tanh()
        self.last = nn.Linear(6, classes)

    def forward(self, x):
        return self.last(self.hidden(self.first(x.flatten(1))))


def test_log_probability_counts_the_sign_of_the_log_softmax_directional_derivative_image_by_image():
    """With ``differentiate="log_probability"``, S(x) = ∇ₐ log softmax(W₂ a + b₂)_k · v = (W₂ᵀ (e_k − p)) · v, worked
    by hand from the weights (p = softmax of the logits), image by image; with "logit" it is W₂[k] · v, the same for
    every image. Scores of ``test()`` equal the shares of positive S(x) with FastCAV's CAVs of by-hand activations,
    and the two quantities give different scores here, so the option is what decides them."""
    model = TinyHead().eval()
    before = model_state(model)
    generator = torch.Generator().manual_seed(11)
    class_images = torch.randn(40, 3, 2, 2, generator=generator)
    concept = torch.randn(15, 3, 2, 2, generator=generator) + 0.7
    randoms = [torch.randn(15, 3, 2, 2, generator=generator) for _ in range(4)]
    weight_1, bias_1 = model.first.weight.detach().double(), model.first.bias.detach().double()
    weight_2, bias_2 = model.last.weight.detach().double(), model.last.bias.detach().double()

    def activation(images):
        return torch.tanh(images.flatten(1).double() @ weight_1.T + bias_1)

    def sensitivity(quantity, target, cav):  # (N,) S(x) by hand
        one_hot = torch.nn.functional.one_hot(torch.tensor(target), 4).double()
        if quantity == "logit":
            return (activation(class_images) * 0 + weight_2[target]) @ cav
        probabilities = torch.softmax(activation(class_images) @ weight_2.T + bias_2, dim=1)
        return ((one_hot - probabilities) @ weight_2) @ cav

    for target in (0, 2):
        shares = {}
        for quantity in ("logit", "log_probability"):
            tcav = explain.TCAV(model, "hidden", cav="fastcav", differentiate=quantity)
            gradients = tcav.gradients(class_images, target)["hidden"].double()
            for cav in (fastcav(activation(concept), activation(randoms[0])), torch.randn(6, dtype=torch.float64)):
                by_hand = sensitivity(quantity, target, cav)
                assert by_hand.abs().min() > 1e-6  # signs well defined
                assert torch.equal((gradients @ cav > 0), (by_hand > 0))  # image by image
            result = tcav.test(class_images, target, {"c": concept}, randoms)
            test = result.test("c", "hidden")
            acts = [activation(images) for images in randoms]
            expected = [float((sensitivity(quantity, target, fastcav(activation(concept), random)) > 0).double().mean())
                        for random in acts]
            expected_null = [float((sensitivity(quantity, target, fastcav(acts[i], acts[(i + 1) % 4])) > 0)
                                   .double().mean()) for i in range(4)]
            assert test.scores.tolist() == expected and test.null_scores.tolist() == expected_null
            shares[quantity] = expected + expected_null
        assert shares["logit"] != shares["log_probability"]
    assert_state_equal(before, model_state(model))


def test_log_probability_sign_matches_a_finite_difference_on_a_conv_net_image_by_image():
    """The same rule on another model, a CNN's (4, 6, 6) feature map (layer "3" of small_cnn), checked without
    autograd: the directional derivative of the class's log softmax along v is a central finite difference in
    float64 through the rest of the network, (g(a + εv) − g(a − εv)) / 2ε, image by image."""
    import copy

    model = small_cnn()
    before = model_state(model)
    class_images = image_set(16, 21)
    tcav = explain.TCAV(model, "3", differentiate="log_probability")
    head = copy.deepcopy(model[4:]).double()
    with torch.no_grad():
        layer_output = model[:4](class_images).double()  # the layer's activations a, (16, 4, 6, 6)
    directions = [fastcav(tcav.activations(image_set(10, 2, red=0.8))["3"], tcav.activations(image_set(10, 3))["3"]),
                  torch.randn(144, generator=torch.Generator().manual_seed(5))]
    logit_signs, log_probability_signs = [], []
    for target in range(3):
        gradients = tcav.gradients(class_images, target)["3"]
        logit_gradients = explain.TCAV(model, "3").gradients(class_images, target)["3"]
        for direction in directions:
            step = 1e-4 * direction.double().view(1, 4, 6, 6)
            with torch.no_grad():
                ahead = torch.log_softmax(head(layer_output + step), dim=1)[:, target]
                behind = torch.log_softmax(head(layer_output - step), dim=1)[:, target]
            finite_difference = (ahead - behind) / 2e-4
            assert finite_difference.abs().min() > 1e-5  # signs well defined
            assert torch.equal(gradients @ direction > 0, finite_difference > 0)
            log_probability_signs.append(finite_difference > 0)
            logit_signs.append(logit_gradients @ direction > 0)
    assert not torch.equal(torch.stack(logit_signs), torch.stack(log_probability_signs))
    assert_state_equal(before, model_state(model))


@pytest.mark.parametrize("model", [TinyHead(classes=1, seed=8), nn.Sequential(small_cnn()[:-1], nn.LazyLinear(1))],
                         ids=["one-logit head", "one-logit cnn"])
def test_log_probability_of_a_one_logit_model_is_its_log_sigmoid_not_a_log_softmax_over_one_column(model):
    """A one-column output is a binary classifier's logit z: its positive class's log-probability is log σ(z), whose
    gradient is (1 − σ(z)) ∇z, so every image's directional derivative has the logit's sign, worked by hand as
    (1 − σ(z)) · (∇z · v) against autograd's ∇z. A log softmax over the one column would be 0 for every input: every
    derivative 0 and every score 0, a silently empty test."""
    generator = torch.Generator().manual_seed(3)
    size = 2 if isinstance(model, TinyHead) else 8
    class_images, concept = torch.rand(20, 3, size, size, generator=generator), torch.rand(12, 3, size, size,
                                                                                          generator=generator) + 0.5
    randoms = [torch.rand(12, 3, size, size, generator=generator) for _ in range(3)]
    model = model.eval()
    model(class_images)  # a lazy layer takes its shape
    layer = "hidden" if isinstance(model, TinyHead) else "0.3"
    before = model_state(model)
    logit, log_probability = (explain.TCAV(model, layer, cav="fastcav", differentiate=quantity)
                              for quantity in ("logit", "log_probability"))
    gradient_of_logit = logit.gradients(class_images, 0)[layer].double()
    gradient_of_log_probability = log_probability.gradients(class_images, 0)[layer].double()
    with torch.no_grad():
        sigmoid = torch.sigmoid(model(class_images)[:, 0]).double()
    torch.testing.assert_close(gradient_of_log_probability, (1 - sigmoid)[:, None] * gradient_of_logit)
    direction = fastcav(logit.activations(concept)[layer], logit.activations(randoms[0])[layer]).double()
    assert (gradient_of_log_probability @ direction).abs().min() > 0  # not the zeros of a one-column log softmax
    assert torch.equal(gradient_of_log_probability @ direction > 0, gradient_of_logit @ direction > 0)
    scores = [result.test("c", layer).scores.tolist() for result in
              (tcav.test(class_images, 0, {"c": concept}, randoms) for tcav in (logit, log_probability))]
    assert scores[0] == scores[1]
    assert_state_equal(before, model_state(model))
