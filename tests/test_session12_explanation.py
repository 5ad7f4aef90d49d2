"""The Explanation as a notebook user and a script writer use it: index tensors of every integer dtype, masks of
the wrong shape, the notebook display of a big batch, pickle and deepcopy with a preprocessing that cannot be
pickled. Each test checks the images, maps, classes and scores selected against the full tensors indexed by hand."""

from __future__ import annotations

import base64
import copy
import gc
import io
import pickle
import re
import warnings
import weakref

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from conftest import ConvGapLinear
from PIL import Image

import explain
from explain.io.explanation import NOTEBOOK_PANELS, NOTEBOOK_ROWS


def _explanation(count: int, topk: int, size: int = 8, **options) -> tuple[torch.nn.Module, explain.Explanation]:
    torch.manual_seed(0)
    model = ConvGapLinear(channels=4, classes=6).eval()
    return model, explain.GradCAM(model, "conv", **options).explain(torch.rand(count, 3, size, size), topk=topk)


def _assert_rows(part: explain.Explanation, whole: explain.Explanation, rows: list[int]) -> None:
    """``part`` holds images ``rows`` of ``whole``: maps, raw maps, classes, scores, probabilities and images."""
    assert len(part) == len(rows)
    torch.testing.assert_close(part.map_grid, whole.map_grid[rows], rtol=0, atol=0)
    torch.testing.assert_close(part.raw_map_grid, whole.raw_map_grid[rows], rtol=0, atol=0)
    assert torch.equal(part.class_indices, whole.class_indices[rows])
    torch.testing.assert_close(part.scores, whole.scores[rows], rtol=0, atol=0)
    torch.testing.assert_close(part.probabilities, whole.probabilities[rows], rtol=0, atol=0)
    torch.testing.assert_close(part.images, whole.images[rows], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_index_tensors_of_every_integer_dtype_select_those_images(dtype):
    _, whole = _explanation(count=5, topk=3)
    rows = [4, 0, 2]
    _assert_rows(whole[torch.tensor(rows, dtype=dtype)], whole, rows)  # uint8 was "image index 4 is out of range"
    _assert_rows(whole[torch.tensor(rows, dtype=dtype).numpy()], whole, rows)
    if dtype != torch.uint8:
        _assert_rows(whole[torch.tensor([-1, -5], dtype=dtype)], whole, [4, 0])
    with pytest.raises(IndexError, match="image index 5 is out of range for an explanation of 5 images"):
        whole[torch.tensor([0, 5], dtype=dtype)]


def test_masks_of_the_wrong_shape_and_indices_beyond_int64_are_index_errors_that_say_what_to_give():
    _, whole = _explanation(count=5, topk=3)
    _, single = _explanation(count=5, topk=1)
    # an (N, 1) mask, as e.scores > s gives for one target per image, still selects images
    mask = single.scores > single.scores[2, 0]
    rows = mask[:, 0].nonzero()[:, 0].tolist()
    assert mask.shape == (5, 1) and 0 < len(rows) < 5
    _assert_rows(single[mask], single, rows)
    # an (N, K) mask (topk) is one per image and target: refused, saying how to make one per image
    with pytest.raises(IndexError, match=r"shape \(5,\); it has shape \(5, 3\).*e\[mask.any\(1\)\]"):
        whole[whole.scores > 0]
    with pytest.raises(IndexError, match=r"shape \(5,\); it has shape \(\)"):
        whole[True]
    with pytest.raises(IndexError, match="out of range .* for an explanation of 5 images"):
        whole[[0, 2**70]]


def _table(page: str) -> list[list[str]]:
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", page)[1:]]


def test_the_notebook_display_of_64_images_by_5_targets_draws_the_first_images_and_says_so():
    _, whole = _explanation(count=64, topk=5)
    page = whole._repr_html_()
    shown = NOTEBOOK_PANELS // (5 + 1)  # an image and its 5 overlays per column
    figure = base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1))
    assert page.count("data:image/") == 1
    assert figure == whole[:shown].png()  # the first images' figure, not 64 columns (12283 px wide, 40 s)
    assert Image.open(io.BytesIO(figure)).size[0] < 1000  # 4 columns of 8 × 8 images
    assert f"images 0–{shown - 1} of 64, targets 0–4 of 5" in page
    table = _table(page)
    assert len(table) == NOTEBOOK_ROWS + 1 and table[-1] == [f"… {64 * 5 - NOTEBOOK_ROWS} more rows (e.scores, "
                                                            "e.targets and e.probabilities hold them all)"]
    for row, (image, target) in enumerate((image, target) for image in range(64) for target in range(5)):
        if row == NOTEBOOK_ROWS:
            break
        assert table[row] == [str(image), f"class {int(whole.class_indices[image, target])}",
                              f"{float(whole.scores[image, target]):.4g}",
                              f"{float(whole.probabilities[image, target]):.3f}"]


def _lambda_holding(model: torch.nn.Module):
    """A preprocessing that cannot be pickled (a lambda) and holds the model, as a user's wrapper may."""
    return lambda image: TF.to_tensor(image) * 2 - 1 + 0 * float(model.fc.bias[0].detach())


def test_a_pickled_or_deep_copied_explanation_with_a_lambda_preprocessing_keeps_its_images_and_no_model():
    torch.manual_seed(0)
    model = ConvGapLinear(channels=4, classes=6).eval()
    preprocess = _lambda_holding(model)
    pixels = list(np.random.default_rng(0).integers(0, 256, size=(3, 8, 8, 3), dtype=np.uint8))
    tensors = torch.stack([preprocess(Image.fromarray(one)) for one in pixels])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = explain.GradCAM(model, "conv", preprocess=preprocess).explain(tensors, topk=2)
        expected_images = explain.GradCAM(model, "conv", preprocess=preprocess).explain(tensors, topk=2).images
    assert whole.display._images is None  # whole's images are not made yet: made when pickled
    copies = [pickle.loads(pickle.dumps(whole)), copy.deepcopy(whole)]  # pickle raised PicklingError on the lambda
    for again in copies:
        torch.testing.assert_close(again.images, expected_images, atol=1e-6, rtol=0)
        for name in ("map_grid", "raw_map_grid", "scores", "class_indices", "probabilities"):
            torch.testing.assert_close(getattr(again, name), getattr(whole, name), rtol=0, atol=0)
        _assert_rows(again[[2, 0]], whole, [2, 0])
    model_alive = weakref.ref(model)
    del whole, model, preprocess
    gc.collect()
    assert model_alive() is None  # the copies hold the images, not the preprocessing that holds the model
