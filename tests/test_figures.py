"""Comparison grids, vector output, signed maps, overlay variants and notebook display."""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import pytest
import torch

import explain
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.io import render

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def grid_case():
    model = load_demo_model()
    images = list(make_dataset(3, seed=21).images)
    fig, explanations = explain.compare(model, images, methods=("gradcam", "integratedgradients", "scorecam"),
                                        layer="layer4", method_options={"class_names": CLASS_NAMES},
                                        colorbar=True)
    return fig, explanations


def test_grid_has_images_in_rows_methods_in_columns_with_titles(grid_case):
    fig, explanations = grid_case
    axes = fig.axes[:-1]  # the last axes is the colorbar
    assert len(axes) == 3 * 4
    titles = [axis.get_title() for axis in axes]
    assert titles[0] == "image" and titles[1].startswith("GradCAM @ layer4")
    assert any(name in titles[1] for name in CLASS_NAMES)
    assert fig.axes[-1].get_ylabel().startswith("relevance") or "relevance" in fig.axes[-1].yaxis.label.get_text()


def test_pdf_is_vector_with_one_embedded_image_per_panel(grid_case, tmp_path):
    fig, _ = grid_case
    path = tmp_path / "grid.pdf"
    fig.savefig(path)
    data = path.read_bytes()
    assert data.startswith(b"%PDF")
    assert data.count(b"/Subtype /Image") == 3 * 4 + 1  # twelve panels and the colorbar's gradient
    assert b"/Font" in data  # titles are text, not pixels
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    assert svg.count("<image") == 3 * 4 + 1 and "@ layer4" in svg and "GradCAM" in svg


def test_signed_maps_are_centred_on_zero_with_percentile_clipping():
    values = torch.linspace(-1, 1, 101).reshape(1, 1, 101)
    unit = render.signed_to_unit(values, clip_percentile=100)
    assert unit[0, 0, 50] == pytest.approx(0.5) and unit.min() == 0 and unit.max() == 1
    outlier = torch.cat([torch.full((1, 1, 99), 0.5), torch.tensor([[[100.0, -100.0]]])], dim=-1)
    clipped = render.signed_to_unit(outlier, clip_percentile=95)
    assert clipped[0, 0, 0] == pytest.approx(1.0)  # 0.5 is the 95th percentile of |values|: it saturates
    assert clipped[0, 0, -1] == 0.0


def test_overlay_variants():
    image = np.full((10, 10, 3), 200, np.uint8)
    heat = np.zeros((10, 10))
    heat[:2] = 1.0  # the top 20 % of pixels
    masked = render.overlay(image, heat, mode="mask", keep=0.2)
    assert (masked[:2] == 200).all() and (masked[2:] == 30).all()
    faded = render.overlay(image, heat, mode="alpha", alpha=0.8)
    assert (faded[2:] == 200).all() and not (faded[:2] == 200).all()  # zero relevance shows the image
    lines = render.overlay(image, heat, mode="contour", levels=(0.5,))
    assert (lines[5:] == 200).all() and (lines[:3] != 200).any()  # only the iso-line is drawn
    with pytest.raises(ValueError, match="mode must be one of"):
        render.overlay(image, heat, mode="hatch")


def test_notebook_display(grid_case):
    _, explanations = grid_case
    page = explanations[0]._repr_html_()
    assert "GradCAM @ layer4" in page and 'src="data:image/png;base64,' in page
    assert any(name in page for name in CLASS_NAMES) and "<table>" in page
    assert explanations[0].png().startswith(b"\x89PNG")
    assert not hasattr(explanations[0], "_repr_png_")  # the notebook stores the figure once, in the HTML
