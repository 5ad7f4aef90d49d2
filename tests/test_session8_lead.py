"""Session 8's own fixes: SmoothGrad keeps a float64 model's precision; the advice for a baseline equal to the
image names the option the method takes."""

import warnings

import pytest
import torch
from torch import nn

from explain import XRAI, IntegratedGradients, Saliency, SmoothGrad


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3)).double().eval()


def test_smoothgrad_without_noise_equals_the_float64_gradient():
    """With zero noise every copy is the image, so SmoothGrad's mean is the input gradient itself: in float64 it
    must equal the by-hand gradient to float64 rounding (a float32 result is ~1e-8 off)."""
    model = small_net()
    image = torch.rand(1, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaf = image.clone().requires_grad_(True)
    model(leaf)[0, 2].backward()
    by_hand = leaf.grad
    explanation = SmoothGrad(Saliency(model), samples=3, noise_std=0.0).explain(image, target=2)
    assert explanation.attributions.dtype == torch.float64
    assert torch.allclose(explanation.attributions[0, 0], by_hand[0], rtol=0, atol=1e-15)


def test_smoothgrad_of_a_float32_model_stays_float32():
    model = small_net().float()
    explanation = SmoothGrad(Saliency(model), samples=2).explain(torch.rand(1, 3, 8, 8), target=0)
    assert explanation.attributions.dtype == torch.float32


def empty_path_warning(explainer, image) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explainer.explain(image, target=0)
    texts = [str(w.message) for w in caught if "baseline equals the image" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in caught]
    return texts[0]


def test_xrai_advice_names_its_baselines_option():
    pytest.importorskip("skimage")
    model = small_net().float()
    text = empty_path_warning(XRAI(model), torch.full((1, 3, 32, 32), 0.5))
    assert "baselines=[" in text and "baseline='zeros'" not in text


def test_integrated_gradients_advice_does_not_suggest_zeros_as_if_it_always_differed():
    model = small_net().float()
    text = empty_path_warning(IntegratedGradients(model, baseline="zeros"), torch.zeros(1, 3, 8, 8))
    assert "baseline='zeros' unless the image is black" in text


def test_explain_batch_confidence_and_probability_follow_probabilities_sigmoid(tmp_path):
    """A multi-label model's explainer given probabilities="sigmoid": explain batch's confidence column (the top-1
    class's probability) and probability column are the sigmoid of the logits, computed here by hand."""
    import csv

    import numpy as np
    from PIL import Image

    from explain import GradCAM, Normalize
    from explain.dataset_tools.batch import run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 5)).eval()
    folder = tmp_path / "images"
    folder.mkdir()
    generator = np.random.default_rng(0)
    for index in range(3):
        Image.fromarray(generator.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(folder / f"{index}.png")
    run(GradCAM(model, "0", probabilities="sigmoid"), folder, tmp_path / "out", progress=False)
    with open(tmp_path / "out" / "index.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3
    for row in rows:
        with torch.no_grad():
            logits = model(Normalize()(Image.open(folder / row["image"]).convert("RGB"))[None])[0]
        top = int(logits.argmax())
        assert int(row["predicted"]) == top
        assert float(row["confidence"]) == pytest.approx(float(logits[top].sigmoid()), abs=1e-5)
        assert float(row["probability"]) == pytest.approx(float(logits[int(row["target"])].sigmoid()), abs=1e-5)


def test_title_counts_negative_indices_from_the_end_and_refuses_others():
    from explain import GradCAM

    model = small_net().float()
    explanation = GradCAM(model, "0").explain(torch.rand(2, 3, 8, 8), topk=2)
    assert explanation.title(-1, -1) == explanation.title(1, 1)
    assert explanation.title(0, -2) == explanation.title(0, 0)
    for bad in [(2, 0), (0, 2), (-3, 0), (0, -3)]:
        with pytest.raises(IndexError, match=r"2 image\(s\) × 2 target\(s\)"):
            explanation.title(*bad)


def test_save_expands_the_home_folder(tmp_path, monkeypatch):
    from explain import GradCAM

    monkeypatch.setenv("HOME", str(tmp_path))
    explanation = GradCAM(small_net().float(), "0").explain(torch.rand(1, 3, 8, 8))
    written = explanation.save("~/cam.png")
    assert written == tmp_path / "cam.png" and written.is_file()
    figure_path = tmp_path / "figure.svg"
    explanation.save("~/figure.svg")
    assert figure_path.is_file() and b"<svg" in figure_path.read_bytes()[:500]
