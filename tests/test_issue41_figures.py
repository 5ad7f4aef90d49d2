"""Issue 41, points 2, 3 and 6: a paper figure (row, column and panel titles of one's own, a colour bar, vector
output) in one call; a loaded model passed as it is, keeping its class names and preprocessing; LRP's warning on a
transformer names AttnLRP and points at the caller's line."""

from __future__ import annotations

import re
import sys
import warnings

import matplotlib
import pytest
import torch

import explain
from explain.data import CLASS_NAMES, make_dataset

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def images():
    return list(make_dataset(2, seed=21).images)


def test_compare_takes_row_column_and_panel_titles_a_colour_bar_and_saves_vector_figures(images, tmp_path):
    comparison = explain.compare(explain.load_model("demo").model, images, methods=("gradcam", "saliency"),
                                 method_titles=["Grad-CAM", "Saliency"], image_titles=["first", "second"],
                                 panel_titles=[["a", "b"], ["c", "d"]], image_header="input", colorbar=True,
                                 colorbar_label="relevance")
    figure = comparison.figure
    grid = figure.axes[:6]  # 2 images × (image + 2 methods), row by row; the colour bar's axes after them
    assert [axis.get_title() for axis in grid] == ["input", "Grad-CAM\na", "Saliency\nb", "", "c", "d"]
    assert [axis.get_ylabel() for axis in grid[::3]] == ["first", "second"]
    bars = figure.axes[6:]
    assert len(bars) == 1 and bars[0].get_ylabel() == "relevance"

    comparison.save(tmp_path / "figure.svg")
    comparison.save(tmp_path / "figure.pdf")
    svg = (tmp_path / "figure.svg").read_text(encoding="utf-8")
    assert svg.count("<image") == 7  # each panel one embedded picture, and the colour bar's gradient
    assert "<path" in svg  # the colour bar's outline and ticks are vector paths
    for text in ("Grad-CAM", "Saliency", "first", "second", "input", "relevance"):
        assert f">{text}<" in svg or f"> {text} <" in svg or text in re.sub(r"<[^>]+>", "", svg), text
    assert (tmp_path / "figure.pdf").read_bytes().startswith(b"%PDF")


def test_figure_titles_follow_the_layout_with_methods_as_rows(images):
    model = explain.load_model("demo").model
    explanations = [explain.GradCAM(model).explain(images), explain.Saliency(model).explain(images)]
    figure = explain.figure(explanations, rows="methods", method_titles=["CAM", "grad"],
                            image_titles=["x", "y"], panel_titles=False)
    grid = figure.axes  # 3 rows (image, CAM, grad) × 2 images
    assert [axis.get_title() for axis in grid] == ["x", "y", "", "", "", ""]
    assert [grid[row * 2].get_ylabel() for row in range(3)] == ["image", "CAM", "grad"]
    with pytest.raises(ValueError, match=r"method_titles takes one text per explanation \(method\), 2 in all"):
        explain.figure(explanations, method_titles=["only one"])
    with pytest.raises(ValueError, match=r"panel_titles takes True .* one list per image \(2\) holding one text"):
        explain.figure(explanations, panel_titles=[["a", "b"]])


def test_an_explanations_own_figure_takes_its_titles(images):
    explanation = explain.GradCAM(explain.load_model("demo").model, "layer4").explain(images, topk=2)
    figure = explanation.figure(image_titles=["left", "right"], map_titles=[["1", "2"], ["3", "4"]], title="")
    assert figure._suptitle is None
    assert [axis.get_title() for axis in figure.axes] == ["left", "right", "1", "3", "2", "4"]


def test_a_loaded_model_is_taken_as_it_is_with_its_class_names_and_preprocessing(images):
    loaded = explain.load_model("demo")
    direct = explain.GradCAM(loaded, "layer4").explain(images[0])
    by_parts = explain.GradCAM(loaded.model, "layer4", preprocess=loaded.preprocess,
                               class_names=loaded.class_names).explain(images[0])
    assert direct.class_names is not None and list(direct.class_names) == list(CLASS_NAMES)
    shown = int(direct.targets[0])
    assert torch.equal(direct.maps, by_parts.maps) and direct.title(0).startswith(f"{CLASS_NAMES[shown]} ({shown})")
    assert explain.GradCAM(loaded, "layer4", class_names=["w", "x", "y", "z"]).explain(images[0]).class_names[0] == "w"

    # the rule on another model and method: the transformer's preprocessing and names reach the rollout
    vit = explain.load_model("demo-vit")
    rollout = explain.GradientAttentionRollout(vit).explain(images[1], topk=2)
    expected = explain.GradientAttentionRollout(vit.model, preprocess=vit.preprocess,
                                                class_names=vit.class_names).explain(images[1], topk=2)
    assert torch.equal(rollout.maps, expected.maps) and list(rollout.class_names) == list(vit.class_names)


def test_compare_takes_class_names_and_a_loaded_model(images):
    names = ["round", "boxy", "pointy", "crossed"]
    comparison = explain.compare(explain.load_model("demo").model, images, methods=["gradcam"], class_names=names)
    assert list(comparison.explanations[0].class_names) == names
    assert comparison.figure.axes[1].get_title().split("\n")[1].startswith(names[int(
        comparison.explanations[0].targets[0])])
    loaded = explain.compare(explain.load_model("demo"), images, methods=["saliency"])
    assert list(loaded.explanations[0].class_names) == list(CLASS_NAMES)
    with pytest.raises(TypeError, match="compare got the keyword.*clas_names"):
        explain.compare(explain.load_model("demo"), images, methods=["saliency"], clas_names=names)


def test_lrp_on_a_transformer_names_attnlrp_at_the_callers_line(images):
    vit = explain.load_model("demo-vit").model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        explain.LRP(vit).explain(images[0])
        compare_line = sys._getframe().f_lineno + 1
        explain.compare(vit, images[:1], methods=["lrp"])
    about_lrp = [warning for warning in caught if "map is not LRP" in str(warning.message)]
    assert len(about_lrp) == 2
    for warning, expected_line in zip(about_lrp, (line, compare_line)):
        assert "explain it with AttnLRP (explain.AttnLRP, --method attnlrp)" in str(warning.message)
        assert warning.filename == __file__ and warning.lineno == expected_line

    # the rule on a model without attention: a CNN's LRP has rules everywhere and does not name AttnLRP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain.LRP(explain.load_model("demo").model).explain(images[0])
    assert not [warning for warning in caught if "AttnLRP" in str(warning.message)]
