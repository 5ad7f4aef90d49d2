"""Hostile use of ``explain.TCAV``: the caller's contexts (train mode, ``no_grad``, ``inference_mode``, frozen
parameters, bfloat16 autocast, threads), odd models (timm, torchvision, HuggingFace), odd layers (run twice, in-place
ops after them, tuple outputs, unused, given as modules or globs), odd sets (empty, duplicated, of other sizes,
folders with stray or corrupt files, fewer than 5 images) and odd targets. Every value is compared with a by-hand
computation (plain hooks and autograd, FastCAV's closed form, Student's t-test from its formula) and the model's state
with the state before the call."""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Callable

import numpy as np
import pytest
import torch
from conftest import SmallCNN, assert_state_equal, errors_in_threads, model_state
from test_tcav import RedDetector, image_set, small_cnn, students_two_sided_p
from torch import nn

import explain
from explain.methods.tcav import fastcav, training_split


def by_hand(model: nn.Module, layer: nn.Module, images: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations (N, D), ∂ logit_target / ∂ layer output (N, D)) with a plain hook on an eval-mode deep copy;
    the hook hands a clone on, so that an in-place op after the layer changes neither."""
    names = {id(module): name for name, module in model.named_modules()}
    twin = copy.deepcopy(model).eval()
    twin_layer = twin.get_submodule(names[id(layer)])
    store: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        store["a"] = output
        return output.clone()

    handle = twin_layer.register_forward_hook(keep)
    try:
        logits = twin(images)
        logits = logits.logits if hasattr(logits, "logits") else logits
        (gradient,) = torch.autograd.grad(logits[:, target].sum(), store["a"])
    finally:
        handle.remove()
    return store["a"].detach().flatten(1), gradient.flatten(1)


def share(gradients: torch.Tensor, cav: torch.Tensor) -> float:
    return float(((gradients @ cav) > 0).double().mean())


def fastcav_test_by_hand(model, layer, class_images, target, concept, randoms):
    """(scores, null scores, Student's p) of a FastCAV TCAV test worked by hand."""
    _, gradients = by_hand(model, layer, class_images, target)
    concept_acts = by_hand(model, layer, concept, target)[0]
    random_acts = [by_hand(model, layer, images, target)[0] for images in randoms]
    scores = [share(gradients, fastcav(concept_acts, acts)) for acts in random_acts]
    null = [share(gradients, fastcav(random_acts[i], random_acts[(i + 1) % len(randoms)])) for i in range(len(randoms))]
    return scores, null


# ---------------------------------------------------------------------------- the caller's contexts: right today


@pytest.mark.parametrize("layer", ["features.2", "features.5"])
def test_a_train_mode_model_is_scored_in_eval_mode_and_left_in_train_mode(layer):
    """SmallCNN in train mode (BatchNorm, dropout 0.5): the gradients and activations equal the eval-mode model's
    by hand (dropout off, running statistics used), so two calls agree; every flag, running statistic and
    requires_grad is as before."""
    model = SmallCNN().train()
    model.features[1].eval()  # mixed modes come back mixed
    before = model_state(model)
    images = image_set(6, 1)
    tcav = explain.TCAV(model, layer, cav="fastcav")
    gradients = tcav.gradients(images, 2)[layer]
    activations = tcav.activations(images)[layer]
    assert_state_equal(before, model_state(model))
    hand_activations, hand_gradients = by_hand(model, model.get_submodule(layer), images, 2)
    torch.testing.assert_close(gradients, hand_gradients)
    torch.testing.assert_close(activations, hand_activations)


def test_no_grad_inference_mode_and_frozen_parameters_change_nothing():
    """Inside ``torch.no_grad()``, ``torch.inference_mode()`` (with an input made there), and on a model whose
    parameters are all, or some, frozen: the same gradients as outside, the flags as they were."""
    model = small_cnn()
    images = image_set(7, 2)
    reference = explain.TCAV(model, "3").gradients(images, 1)["3"]
    with torch.no_grad():
        torch.testing.assert_close(explain.TCAV(model, "3").gradients(images, 1)["3"], reference)
        assert not torch.is_grad_enabled()
    with torch.inference_mode():
        inference_images = images.clone()
        torch.testing.assert_close(explain.TCAV(model, "3").gradients(inference_images, 1)["3"], reference)
        assert torch.is_inference_mode_enabled()
    torch.testing.assert_close(explain.TCAV(model, "3").gradients(inference_images, 1)["3"], reference)
    for frozen in (list(model.parameters()), list(model.parameters())[:2]):
        for parameter in frozen:
            parameter.requires_grad_(False)
        before = model_state(model)
        torch.testing.assert_close(explain.TCAV(model, "3").gradients(images, 1)["3"], reference)
        assert_state_equal(before, model_state(model))
        for parameter in frozen:
            parameter.requires_grad_(True)
    torch.testing.assert_close(by_hand(model, model[3], images, 1)[1], reference)


def gradients_in_threads(tcav: explain.TCAV, images: torch.Tensor, count: int) -> dict[int, torch.Tensor]:
    results: dict[int, torch.Tensor] = {}

    def work(index: int) -> None:
        results[index] = tcav.gradients(images, 1)[tcav.layer_names[0]]

    assert errors_in_threads(work, count) == []
    return results


def test_four_threads_on_one_eval_model_get_the_single_thread_result_and_leave_it_as_found():
    """docs/guarantees.md: one explainer serves several threads; serve from an eval-mode model. Three rounds."""
    model = SmallCNN().eval()
    before = model_state(model)
    tcav = explain.TCAV(model, "features.5", cav="fastcav")
    images = image_set(5, 3)
    expected = by_hand(model, model.features[5], images, 1)[1]
    for _ in range(3):
        results = gradients_in_threads(tcav, images, 4)
        for index in range(4):
            torch.testing.assert_close(results[index], expected)
    assert_state_equal(before, model_state(model))


class Gate(nn.Module):
    """Identity whose forward, in thread "first", waits until thread "second" is inside its own forward, and in
    thread "second" waits until "first" has finished its call: the two calls overlap in that order, every time."""

    def __init__(self):
        super().__init__()
        self.second_inside, self.first_done = threading.Event(), threading.Event()

    def forward(self, x):
        if threading.current_thread().name == "first":
            assert self.second_inside.wait(30)
        elif threading.current_thread().name == "second":
            self.second_inside.set()
            assert self.first_done.wait(30)
        return x


def overlapping_calls(gate: Gate, call: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``call()`` in threads "first" and "second", overlapping as ``gate`` orders them: "first" ends while "second" is
    inside its forward. Thread name → its result."""
    results: dict[str, torch.Tensor] = {}

    def work() -> None:
        results[threading.current_thread().name] = call()

    first, second = threading.Thread(target=work, name="first"), threading.Thread(target=work, name="second")
    first.start()
    second.start()
    first.join()
    gate.first_done.set()
    second.join()
    assert sorted(results) == ["first", "second"]
    return results


def test_two_overlapping_calls_on_a_train_mode_model_both_run_in_eval_mode_and_leave_it_as_found():
    torch.manual_seed(0)
    gate, network = Gate(), SmallCNN()
    model = nn.Sequential(gate, network).train()
    before = model_state(model)
    tcav = explain.TCAV(model, "1.features.5", cav="fastcav")
    images = image_set(5, 3)
    expected = by_hand(network, network.features[5], images, 1)[1]  # the gate's events cannot be deep-copied
    results = overlapping_calls(gate, lambda: tcav.gradients(images, 1)["1.features.5"])
    torch.testing.assert_close(results["first"], expected)
    torch.testing.assert_close(results["second"], expected)
    assert_state_equal(before, model_state(model))


# ---------------------------------------------------------------------------- odd models: right today


@pytest.mark.parametrize("name, layer", [("resnet18", "layer3"), ("vit_tiny_patch16_224", "blocks.0")])
def test_timm_models_scores_and_p_value_equal_the_by_hand_test(name, layer):
    """timm resnet18 and a ViT (random weights, 32 px): scores, null scores and p of ``test()`` equal the by-hand
    FastCAV test and Student's formula; the model is left as found."""
    timm = pytest.importorskip("timm")
    options = {"img_size": 32} if "vit" in name else {}
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4, **options).eval()
    before = model_state(model)
    generator = torch.Generator().manual_seed(1)
    class_images = torch.rand(8, 3, 32, 32, generator=generator)
    concept = torch.rand(6, 3, 32, 32, generator=generator) * 0.5 + 0.5
    randoms = [torch.rand(6, 3, 32, 32, generator=generator) for _ in range(3)]
    result = explain.TCAV(model, layer, cav="fastcav").test(class_images, 2, {"c": concept}, randoms)
    assert_state_equal(before, model_state(model))
    test = result.test("c", layer)
    scores, null = fastcav_test_by_hand(model, model.get_submodule(layer), class_images, 2, concept, randoms)
    assert test.scores.tolist() == scores and test.null_scores.tolist() == null
    if np.std(scores) + np.std(null) > 0:
        assert test.p_value == pytest.approx(students_two_sided_p(np.array(scores), np.array(null)), rel=1e-9)


# ---------------------------------------------------------------------------- bad input with a clear error: right today


def test_folders_stray_files_are_skipped_and_bad_ones_named(tmp_path):
    """A text file among the images is skipped (the activations are the images' own); a corrupt .png, an empty
    folder, a misspelt folder, images of two sizes without a resizing preprocess: errors naming the problem."""
    from PIL import Image

    model = RedDetector().eval()
    tcav = explain.TCAV(model, "features", cav="fastcav")
    generator = torch.Generator().manual_seed(0)
    pixels = [(torch.rand(8, 8, 3, generator=generator) * 255).byte() for _ in range(3)]
    folder = tmp_path / "concept"
    folder.mkdir()
    for index, image in enumerate(pixels):
        Image.fromarray(image.numpy()).save(folder / f"{index}.png")
    (folder / "notes.txt").write_text("not an image")
    unit_images = torch.stack([image.permute(2, 0, 1).float() / 255 for image in pixels])
    expected = by_hand(model, model.features, explain.Normalize()(unit_images), 1)[0]  # the default preprocess
    torch.testing.assert_close(tcav.activations(folder)["features"], expected)
    (folder / "3.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"3\.png' could not be read as an image"):
        tcav.activations(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty holds no image files"):
        tcav.activations(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no image file at .*conceptt"):
        tcav.activations(str(tmp_path / "conceptt"))
    sizes = tmp_path / "sizes"
    sizes.mkdir()
    Image.fromarray(pixels[0].numpy()).save(sizes / "a.png")
    Image.fromarray(np.zeros((9, 8, 3), np.uint8)).save(sizes / "b.png")
    with pytest.raises(ValueError, match=r"different sizes after preprocessing.*Pass a preprocess that resizes"):
        tcav.activations(sizes)


def test_nan_images_out_of_range_targets_and_one_random_set_are_refused():
    model = small_cnn()
    before = model_state(model)
    tcav = explain.TCAV(model, "3", cav="fastcav")
    images = image_set(4, 1)
    images[2, 1, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="the input contains NaN or inf values"):
        tcav.activations(images)
    with pytest.raises(ValueError, match="the input contains NaN or inf values"):
        tcav.gradients(images, 0)
    for target in (-1, 3):
        with pytest.raises(ValueError, match=f"target {target} is not a class of the model's 3 outputs"):
            tcav.gradients(image_set(4, 1), target)
    with pytest.raises(ValueError, match="at least 2 random sets"):
        tcav.test(image_set(4, 1), 0, {"c": image_set(4, 2)}, [image_set(4, 3)])
    assert_state_equal(before, model_state(model))
    reference = tcav.gradients(image_set(4, 1), 1)["3"]
    for same_class in (torch.tensor(1), np.int64(1)):  # an index of another integer type is the same class
        assert torch.equal(tcav.gradients(image_set(4, 1), same_class)["3"], reference)


@pytest.mark.parametrize("counts", [(3, 4), (4, 2)])
def test_fewer_than_5_images_train_the_sgd_cav_on_all_of_them(counts):
    """Below 5 images in a set there is no 33 % hold-out: SGD's CAV is trained on every row, and ``test()``'s scores
    are the shares of positive derivatives along it, by hand."""
    from sklearn.linear_model import SGDClassifier

    concept_count, random_count = counts
    model = RedDetector().eval()
    tcav = explain.TCAV(model, "features")
    class_images, concept = image_set(6, 1), image_set(concept_count, 2, red=0.8)
    randoms = [image_set(random_count, 3), image_set(random_count, 4)]
    concept_acts = by_hand(model, model.features, concept, 1)[0]
    random_acts = [by_hand(model, model.features, images, 1)[0] for images in randoms]
    features, labels = training_split(concept_acts, random_acts[0])
    assert len(labels) == concept_count + random_count
    gradients = by_hand(model, model.features, class_images, 1)[1]
    expected = []
    for acts in random_acts:
        features = torch.cat([concept_acts, acts]).double().numpy()
        labels = np.array([1] * concept_count + [0] * random_count)
        weights = torch.as_tensor(SGDClassifier(alpha=0.01, max_iter=1000, tol=1e-3, random_state=0)
                                  .fit(features, labels).coef_[0], dtype=torch.float32)
        expected.append(share(gradients, weights / weights.norm()))
    result = tcav.test(class_images, 1, {"c": concept}, randoms)
    assert result.test("c", "features").scores.tolist() == expected


def test_a_softmax_output_differentiated_as_a_logit_counts_the_log_probability_signs():
    """A model that already applies softmax, with the default ``differentiate="logit"``: ∇p_k = p_k ∇log p_k with
    p_k > 0, so each image's sign is the log-probability's (what ``"log_probability"`` counts on the logit model):
    the scores are tensorflow/tcav's, not the paper's logit's, which docs/concepts.md's "the model must return logits"
    warns of. Checked image by image along two directions, on RedDetector and on small_cnn."""
    for logits_model, layer in ((RedDetector().eval(), "features"), (small_cnn(), "3")):
        probabilities_model = nn.Sequential(logits_model, nn.Softmax(dim=1))
        images = image_set(20, 5)
        on_probabilities = explain.TCAV(probabilities_model, f"0.{layer}").gradients(images, 1)[f"0.{layer}"]
        log_probability = explain.TCAV(logits_model, layer, differentiate="log_probability").gradients(images, 1)
        for seed in (0, 1):
            direction = torch.randn(on_probabilities.shape[1], generator=torch.Generator().manual_seed(seed))
            assert torch.equal(on_probabilities @ direction > 0, log_probability[layer] @ direction > 0)


# ---------------------------------------------------------------------------- what the attacks found, fixed


@pytest.mark.parametrize("case", ["SmallCNN features.1 (BatchNorm before ReLU(inplace))",
                                  "torchvision resnet18 layer1.0.bn2 (before out += identity)"])
def test_an_in_place_op_after_the_layer_changes_neither_activations_nor_gradients(case):
    if case.startswith("SmallCNN"):
        torch.manual_seed(0)
        model, layer, images = SmallCNN().eval(), "features.1", image_set(4, 1)
    else:
        torchvision = pytest.importorskip("torchvision")
        torch.manual_seed(0)
        model, layer, images = torchvision.models.resnet18(weights=None, num_classes=4).eval(), "layer1.0.bn2", \
            torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    before = model_state(model)
    tcav = explain.TCAV(model, layer, cav="fastcav")
    activations, gradients = tcav.activations(images)[layer], tcav.gradients(images, 1)[layer]
    assert_state_equal(before, model_state(model))
    hand_activations, hand_gradients = by_hand(model, model.get_submodule(layer), images, 1)
    assert float(hand_activations.min()) < 0  # the true output has negative values that ReLU would zero
    torch.testing.assert_close(activations, hand_activations)
    torch.testing.assert_close(gradients, hand_gradients)


class RunsTwice(nn.Module):
    """x → f(tanh(f(x))) → head: layer "f" runs twice per forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.f, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.f(torch.tanh(self.f(x.flatten(1)))))


def shared_relu_cnn() -> nn.Module:
    """A CNN whose one ReLU module (named "1") runs after both convolutions."""
    torch.manual_seed(6)
    shared = nn.ReLU()
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), shared, nn.Conv2d(4, 4, 3, padding=1), shared,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()


@pytest.mark.parametrize("case", ["linear applied twice", "one ReLU module after two convolutions"])
def test_a_layer_that_runs_twice_per_forward_is_refused(case):
    if case == "linear applied twice":
        model, layer = RunsTwice().eval(), "f"
        images = torch.rand(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    else:
        model, layer, images = shared_relu_cnn(), "1", image_set(3, 0)
    before = model_state(model)
    tcav = explain.TCAV(model, layer, cav="fastcav")
    with pytest.raises(ValueError, match=f"'{layer}'.*(once|twice|2 times)"):
        tcav.activations(images)
    with pytest.raises(ValueError, match=f"'{layer}'.*(once|twice|2 times)"):
        tcav.gradients(images, 0)
    assert_state_equal(before, model_state(model))


class UnusedAndTupleLayers(nn.Module):
    """An LSTM layer "recurrent" (output: a tuple) feeds the head; "auxiliary" is never run in forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.recurrent, self.head, self.auxiliary = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3), nn.Linear(4, 2)

    def forward(self, x):
        output, _ = self.recurrent(x.flatten(2))
        return self.head(output[:, -1])


def test_a_layer_the_forward_never_runs_or_whose_output_is_a_tuple_is_named_in_a_clear_error():
    model = UnusedAndTupleLayers().eval()
    before = model_state(model)
    images = torch.rand(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    for method in ("activations", "gradients"):
        arguments = (images,) if method == "activations" else (images, 0)
        with pytest.raises(ValueError, match="'auxiliary'.*(not run|never ran|did not run)"):
            getattr(explain.TCAV(model, "auxiliary"), method)(*arguments)
        with pytest.raises((TypeError, ValueError), match="'recurrent'.*tuple"):
            getattr(explain.TCAV(model, "recurrent"), method)(*arguments)
    assert_state_equal(before, model_state(model))


@pytest.mark.parametrize("spec", ["Sequential module", "leaf module", "glob", "module type"])
def test_layers_given_as_modules_globs_or_types_are_the_named_layers(spec):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    given, expected = {"Sequential module": (model.features, ["features"]), "leaf module": (model.head, ["head"]),
                       "glob": ("features.[0-9]", [f"features.{i}" for i in range(9)]),
                       "module type": (nn.Conv2d, ["features.0", "features.3", "features.6"])}[spec]
    tcav = explain.TCAV(model, given, cav="fastcav")
    assert tcav.layer_names == expected
    images = image_set(3, 1)
    activations = tcav.activations(images)
    for name in expected:
        torch.testing.assert_close(activations[name], by_hand(model, model.get_submodule(name), images, 0)[0])


@pytest.mark.parametrize("target", [True, 1.0, "1"], ids=["bool", "float", "str"])
def test_a_target_that_is_not_a_class_index_is_refused(target):
    model = small_cnn()
    tcav = explain.TCAV(model, "3", cav="fastcav")
    with pytest.raises((TypeError, ValueError), match=f"target.*{target!r}"):
        tcav.gradients(image_set(4, 1), target)


@pytest.mark.parametrize("empty", [[], torch.zeros(0, 3, 12, 12)], ids=["list", "tensor"])
def test_an_empty_set_is_refused_with_an_error_that_says_so(empty):
    tcav = explain.TCAV(small_cnn(), "3", cav="fastcav")
    with pytest.raises(ValueError, match="(is empty|no images)"):  # not torch.cat's "expected a non-empty list"
        tcav.activations(empty)
    with pytest.raises(ValueError, match="(is empty|no images)"):
        tcav.gradients(empty, 0)
    with pytest.raises(ValueError, match="concept 'c'.*empty"):
        tcav.test(image_set(4, 1), 0, {"c": empty}, [image_set(4, 2), image_set(4, 3)])


@pytest.mark.parametrize("odd_one", ["concept", "class images"])
def test_sets_of_another_image_size_are_named_in_the_error(odd_one):
    tcav = explain.TCAV(small_cnn(), "3", cav="fastcav")
    large = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    class_images, concept = (image_set(5, 1), large) if odd_one == "concept" else (large, image_set(6, 1))
    with pytest.raises(ValueError, match="(size|width).*resiz"):
        tcav.test(class_images, 1, {"c": concept}, [image_set(6, 2), image_set(6, 3)])


@pytest.mark.parametrize("cav, case", [("fastcav", "random set listed twice"), ("sgd", "random set listed twice"),
                                       ("fastcav", "concept equal to a random set")])
def test_identical_sets_are_refused_not_scored(cav, case):
    model = small_cnn()
    tcav = explain.TCAV(model, "3", cav=cav)
    random, other = image_set(10, 3), image_set(10, 4)
    if case == "random set listed twice":
        concept, randoms = image_set(10, 5), [random, random.clone()]  # the "concept" is one more random set
    else:
        concept, randoms = random.clone(), [random, other]
    result = None
    with pytest.raises(ValueError, match="(same|identical|equal)"):
        result = tcav.test(image_set(12, 1), 1, {"c": concept}, randoms)
    assert result is None


def test_bfloat16_autocast_gives_the_float32_scores_or_says_it_does_not():
    model = small_cnn()
    tcav = explain.TCAV(model, "1")
    arguments = (image_set(40, 1), 1, {"c": image_set(20, 2, red=0.8)}, [image_set(20, 3 + i) for i in range(4)])
    reference = tcav.test(*arguments).tests[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reduced = tcav.test(*arguments).tests[0]
    said = any(issubclass(w.category, RuntimeWarning) and "bfloat16" in str(w.message) for w in caught)
    same = reduced.scores.tolist() == reference.scores.tolist() and \
        reduced.null_scores.tolist() == reference.null_scores.tolist()
    assert same or said


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_a_huggingface_classifiers_logits_are_differentiated(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "vit":
        config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=16, num_labels=3)
    else:
        config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = transformers.AutoModelForImageClassification.from_config(config).eval()
    layer = [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, nn.Conv2d))][1]
    before = model_state(model)
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    gradients = explain.TCAV(model, layer, cav="fastcav").gradients(images, 2)[layer]
    assert_state_equal(before, model_state(model))
    torch.testing.assert_close(gradients, by_hand(model, model.get_submodule(layer), images, 2)[1])


def test_two_overlapping_saliency_calls_on_a_train_mode_model_both_run_in_eval_mode_and_leave_it_as_found():
    """The same overlap with another explainer (the eval-mode switch is every call's, ``CallScope.eval_mode``): both
    saliency maps are the eval-mode network's gradient by hand, and no flag or BatchNorm statistic moved."""
    torch.manual_seed(1)
    gate, network = Gate(), SmallCNN()
    model = nn.Sequential(gate, network).train()
    before = model_state(model)
    images = image_set(3, 4)
    reference = copy.deepcopy(network).eval()
    leaf = images.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(reference(leaf)[:, 1].sum(), leaf)
    saliency = explain.Saliency(model, normalize=None)
    results = overlapping_calls(gate, lambda: saliency.explain(images, target=1).attributions[:, 0])
    torch.testing.assert_close(results["first"], expected)
    torch.testing.assert_close(results["second"], expected)
    assert_state_equal(before, model_state(model))


class InterruptOnce(nn.Module):
    """Identity that raises KeyboardInterrupt (a Ctrl-C mid-forward) the first time it runs, then passes through."""

    def __init__(self):
        super().__init__()
        self.fired = False

    def forward(self, x):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return x


@pytest.mark.parametrize("call", ["activations", "gradients"])
def test_an_interrupt_mid_call_on_a_train_mode_model_leaves_it_as_found_and_the_next_call_right(call):
    """Ctrl-C inside the forward of a call on a train-mode model: the KeyboardInterrupt reaches the caller, every
    hook, flag and BatchNorm statistic is as before, no module stays held in eval mode by the dead call, and the next
    call gives what a fresh model gives (by hand: plain hooks and autograd on an eval-mode copy)."""
    from explain.core import scope

    torch.manual_seed(2)
    network = SmallCNN()
    model = nn.Sequential(InterruptOnce(), network).train()
    before = model_state(model)
    tcav = explain.TCAV(model, "1.features.5", cav="fastcav")
    images = image_set(4, 6)
    run = (lambda: tcav.activations(images)) if call == "activations" else (lambda: tcav.gradients(images, 1))
    with pytest.raises(KeyboardInterrupt):
        run()
    assert_state_equal(before, model_state(model))
    assert not any(entry[1] is module for entry in scope._held_in_eval.values() for module in model.modules())
    activations, gradients = by_hand(network, network.features[5], images, 1)
    torch.testing.assert_close(run()["1.features.5"], activations if call == "activations" else gradients)
    assert_state_equal(before, model_state(model))
