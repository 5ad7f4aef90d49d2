"""Layouts of Qwen2-VL, Qwen2.5-VL, Idefics3 and SmolVLM checked against the models themselves.

The oracle: with token-local vision encoders (each image token sees only its own pixels), paint a 3×3 block of the
ORIGINAL image at a probe point, run the model's own path (processor, vision encoder, projector) up to the language
model's input, and see which image tokens' embeddings changed. They must be exactly the tokens whose layout cell
holds the point: one for Qwen, a tile token and a global-image token for Idefics3 / SmolVLM. Probe points lie
inside cells, away from cell borders by more than the processor's resampling spreads a pixel.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_tiny import image_token_embeddings
from vlm_tiny_more import tiny_idefics3, tiny_qwen2_5_vl, tiny_qwen2_vl, tiny_smolvlm

import explain.vlm.families.idefics3  # noqa: F401  registers the layouts
import explain.vlm.families.qwen2_vl  # noqa: F401
from explain.vlm.layout import LAYOUTS, ImageLayout, paint

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]


@functools.lru_cache(maxsize=None)
def built(name: str, token_local: bool = True, **settings) -> tuple[torch.nn.Module, object]:
    builders = dict(qwen2_vl=tiny_qwen2_vl, qwen2_5_vl=tiny_qwen2_5_vl, idefics3=tiny_idefics3, smolvlm=tiny_smolvlm)
    return builders[name](token_local=token_local, **settings)


def random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Dark random pixels (0..100), so a block painted white always changes."""
    return np.random.default_rng(seed).integers(0, 100, (height, width, 3), dtype=np.uint8)


def process(processor, image: np.ndarray, **kwargs):
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return processor(images=Image.fromarray(image), text=text, return_tensors="pt", **kwargs)


def changed_tokens(model, processor, image: np.ndarray, point: tuple[int, int], base: torch.Tensor, **kwargs
                   ) -> set[int]:
    y, x = point
    painted = image.copy()
    painted[y - 1:y + 2, x - 1:x + 2] = 255
    embeddings = image_token_embeddings(model, process(processor, painted, **kwargs))[0]
    difference = (embeddings - base).abs().amax(dim=1)
    return set(torch.nonzero(difference > 1e-5).flatten().tolist())


RESAMPLING = {"qwen2_vl": (1, 2), "qwen2_5_vl": (1, 2), "idefics3": (2, 3), "smolvlm": (2, 3)}
"""model_type → (resamplings before the finest view, kernel radius): Qwen's one bicubic smart resize; Idefics3's
Lanczos longest-edge resize, then the stretch to whole tiles."""


def token_pixels(model: torch.nn.Module) -> int:
    """Encoder input pixels per token side: the patch times Qwen's merge or Idefics3's pixel shuffle."""
    vision = model.config.vision_config
    if model.config.model_type.startswith("qwen"):
        return vision.patch_size * vision.spatial_merge_size
    return vision.patch_size * model.config.scale_factor


def probe_points(layout: ImageLayout, model: torch.nn.Module, most: int = 16, extra: int = 2
                 ) -> dict[tuple[int, int], set[int]]:
    """Probe points on a 2-pixel lattice with room around them → {(y, x): tokens whose cell holds the point}: per
    distinct set of covering tokens the point deepest inside its cells (``most`` of them at most), plus ``extra``
    random roomy points.

    Room: each resampling of radius r spreads a pixel over ±r pixels of the larger image, at most ±r·max(1, shrink)
    original pixels, shrink = original pixels per encoder pixel of the finest view; the painted block reaches ±1
    more and 1 pixel is spare. A global view squeezed out of the tiled image (Idefics3) spreads it once more, by ±r
    of its own shrink. A point needs that much distance to every cell border inside the image."""
    stages, radius = RESAMPLING[model.config.model_type]
    height, width = layout.size
    ys, xs = np.meshgrid(np.arange(1, height - 1, 2), np.arange(1, width - 1, 2), indexing="ij")
    ys, xs = ys.ravel(), xs.ravel()
    cy, cx = ys + 0.5, xs + 0.5  # the painted block's centre
    cells = [((g.box[3] - g.box[1]) / g.tokens.shape[0], (g.box[2] - g.box[0]) / g.tokens.shape[1])
             for g in layout.grids]
    shrinks = [max(cell) / token_pixels(model) for cell in cells]
    spread = 2 + stages * radius * max(1.0, min(shrinks))
    slack = np.full(len(ys), np.inf)
    covering = []
    for grid, (cell_h, cell_w), shrink in zip(layout.grids, cells, shrinks):
        left, top = grid.box[:2]
        rows, cols = grid.tokens.shape
        row, col = np.floor((cy - top) / cell_h).astype(int), np.floor((cx - left) / cell_w).astype(int)
        inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
        covering.append(np.where(inside, grid.tokens.numpy()[row.clip(0, rows - 1), col.clip(0, cols - 1)], -1))
        squeezed = len(layout.grids) > 1 and grid.box == (0.0, 0.0, float(width), float(height))
        margin = spread + (radius * shrink if squeezed else 0.0)
        for centre, start, index, size, extent in ((cy, top, row, cell_h, height), (cx, left, col, cell_w, width)):
            for border in (start + index * size, start + (index + 1) * size):
                counts = inside & (border > 0.5) & (border < extent - 0.5)
                slack = np.minimum(slack, np.where(counts, np.abs(centre - border) - margin, np.inf))
    covering = np.stack(covering, axis=1)
    roomy = np.nonzero(slack >= 0)[0]
    best: dict[tuple[int, ...], int] = {}
    for index in roomy:
        key = tuple(covering[index])
        if key not in best or slack[index] > slack[best[key]]:
            best[key] = index
    deepest = [best[key] for key in sorted(best)]
    if len(deepest) > most:  # evenly over the sorted keys: every view (tile) keeps some
        deepest = [deepest[i] for i in np.linspace(0, len(deepest) - 1, most).round().astype(int)]
    chosen = set(deepest) | set(np.random.default_rng(1).choice(roomy, min(extra, len(roomy)), replace=False))
    return {(int(ys[i]), int(xs[i])): {int(t) for t in covering[i] if t >= 0} for i in sorted(chosen)}


def check_by_perturbation(name: str, size: tuple[int, int], settings: dict | None = None, call: dict | None = None,
                          tokens_per_point: int = 1, least_coverage: float = 0.3) -> ImageLayout:
    """Every probe point changes exactly the tokens the layout places there; the probes reach every grid (tile,
    global image) and at least ``least_coverage`` of the image tokens."""
    model, processor = built(name, **(settings or {}))
    image = random_image(*size)
    inputs = process(processor, image, **(call or {}))
    layout = LAYOUTS[model.config.model_type](model, processor, inputs, size)
    base = image_token_embeddings(model, inputs)[0]
    assert layout.token_count == base.shape[0]
    points = probe_points(layout, model)
    for point, expected in points.items():
        assert len(expected) == tokens_per_point
        assert changed_tokens(model, processor, image, point, base, **(call or {})) == expected, (size, point)
    probed = set().union(*points.values())
    assert all(any(int(t) in probed for t in grid.tokens.flatten()) for grid in layout.grids)
    assert len(probed) >= least_coverage * layout.token_count, (len(probed), layout.token_count)
    return layout


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("size, grid", [
    ((40, 50), (2, 3)),  # round(40/16) = 2 (half to even), round(50/16) = 3: 32 × 48 pixels
    ((50, 40), (3, 2)),
    ((37, 61), (2, 4)),
    ((90, 120), (3, 4)),  # 96 × 128 > max_pixels 64²: shrunk to 48 × 64
    ((20, 30), (2, 3)),  # 16 × 32 < min_pixels 32²: grown to 32 × 48
])
def test_qwen_tokens_see_their_cells(name, size, grid):
    layout = check_by_perturbation(name, size, least_coverage=1.0)
    assert [tuple(g.tokens.shape) for g in layout.grids] == [grid]
    assert layout.grids[0].box == (0.0, 0.0, float(size[1]), float(size[0]))


@pytest.mark.parametrize("name, size, tiles", [
    ("idefics3", (200, 260), (3, 3)),  # longest edge to 192: 148 × 192, edges up to multiples of 64: 192 × 192
    ("idefics3", (260, 120), (3, 2)),  # 192 × 88 → 192 × 128
    ("idefics3", (111, 183), (2, 3)),  # grown: 116 × 192 → 128 × 192
    ("idefics3", (150, 170), (3, 3)),  # 170 × 192 → 192 × 192
    ("smolvlm", (260, 120), (3, 2)),
    ("smolvlm", (111, 183), (2, 3)),
])
def test_idefics3_tokens_see_their_tile_and_global_cells(name, size, tiles):
    layout = check_by_perturbation(name, size, tokens_per_point=2)
    rows, cols = tiles
    assert len(layout.grids) == rows * cols + 1
    tops = sorted({g.box[1] for g in layout.grids[:-1]})
    lefts = sorted({g.box[0] for g in layout.grids[:-1]})
    assert (len(tops), len(lefts)) == tiles
    assert layout.grids[-1].box == (0.0, 0.0, float(size[1]), float(size[0]))


def test_idefics3_without_splitting_has_only_the_global_image():
    layout = check_by_perturbation("idefics3", (50, 70), call=dict(do_image_splitting=False), least_coverage=1.0)
    assert len(layout.grids) == 1 and layout.grids[0].tokens.shape == (2, 2)


def test_idefics3_small_image_fits_one_tile():
    layout = check_by_perturbation("idefics3", (45, 60), settings=dict(longest_edge=64), least_coverage=1.0)
    assert len(layout.grids) == 1 and layout.token_count == 4


def test_idefics3_four_by_four_tokens_per_tile():
    """Tiles of 128 pixels, 8 × 8 patches of 16 shuffled 2×2: 4 × 4 tokens per tile, in row order."""
    layout = check_by_perturbation("idefics3", (300, 220), settings=dict(tile=128, longest_edge=256),
                                   tokens_per_point=2)
    assert len(layout.grids) == 5 and all(g.tokens.shape == (4, 4) for g in layout.grids)


def test_idefics3_pixel_shuffle_by_four():
    """scale_factor 4: 8 × 8 patches of 8 pixels in a 64-pixel tile give 2 × 2 tokens of 4 × 4 patches each."""
    layout = check_by_perturbation("idefics3", (200, 260), settings=dict(patch_size=8, scale_factor=4),
                                   tokens_per_point=2)
    assert all(g.tokens.shape == (2, 2) for g in layout.grids)


@pytest.mark.parametrize("name", ["idefics3", "smolvlm"])
def test_idefics3_tiles_match_the_row_col_tokens_of_the_prompt(name):
    """Over many sizes the layout's tile rows × columns are those the processor wrote as <row_r_col_c>."""
    model, processor = built(name)
    tokenizer = processor.tokenizer
    row_col = {tokenizer.convert_tokens_to_ids(f"<row_{r}_col_{c}>"): (r, c) for r in range(1, 7) for c in range(1, 7)}
    rng = np.random.default_rng(2)
    for _ in range(25):
        size = (int(rng.integers(8, 400)), int(rng.integers(8, 400)))
        inputs = process(processor, random_image(*size))
        layout = LAYOUTS[model.config.model_type](model, processor, inputs, size)
        written = [row_col[i] for i in inputs["input_ids"][0].tolist() if i in row_col]
        tiles = layout.grids[:-1]
        assert len(tiles) == len(written), size
        if written:
            rows, cols = max(r for r, _ in written), max(c for _, c in written)
            for (row, col), grid in zip(written, tiles):  # written in sequence order, as the grids
                assert grid.box[:2] == pytest.approx(((col - 1) * size[1] / cols, (row - 1) * size[0] / rows))
        assert layout.grids[-1].tokens.min() == layout.token_count - 4


def covered(pixels: int, low: float, high: float) -> torch.Tensor:
    """(pixels,) the length of each pixel's extent [p, p + 1) inside [low, high)."""
    start = torch.arange(pixels, dtype=torch.float64)
    return (torch.clamp(start + 1, max=high) - torch.clamp(start, min=low)).clamp(min=0)


def test_paint_one_hot_relevance_fills_exactly_its_cells():
    """One-hot relevance on a Qwen token: each pixel gets the area it shares with the token's cell / the cell's area
    (2 × 3 cells of 20 × 50/3 pixels on a 40 × 50 image: pixel columns 16 and 33 are cut by cell edges); on an
    Idefics3 tile token plus its global token: both cells."""
    model, processor = built("qwen2_vl")
    layout = LAYOUTS["qwen2_vl"](model, processor, process(processor, random_image(40, 50)), (40, 50))
    relevance = torch.zeros(1, layout.token_count, dtype=torch.float64)
    relevance[0, 4] = 1.0  # row 1, column 1
    painted = paint(relevance, layout, (40, 50))[0]
    expected = torch.outer(covered(40, 20, 40), covered(50, 50 / 3, 100 / 3)) / (20 * 50 / 3)
    assert torch.allclose(painted, expected)
    assert float(painted.sum()) == pytest.approx(1.0)
    doubled = paint(relevance, layout, (80, 100))[0]  # a map twice the size: cells twice as long, density / 4
    expected = torch.outer(covered(80, 40, 80), covered(100, 100 / 3, 200 / 3)) / (40 * 100 / 3)
    assert torch.allclose(doubled, expected)

    model, processor = built("idefics3")
    layout = LAYOUTS["idefics3"](model, processor, process(processor, random_image(40, 70)), (40, 70))  # 2 × 3 tiles
    relevance = torch.zeros(1, layout.token_count, dtype=torch.float64)
    relevance[0, 5 * 4 + 0] = 1.0  # tile (row 1, col 2), its token (0, 0): pixels y ∈ [20, 30), x ∈ [140/3, 175/3)
    relevance[0, 6 * 4 + 3] = 2.0  # global token (1, 1): y ∈ [20, 40), x ∈ [35, 70)
    painted = paint(relevance, layout, (40, 70))[0]
    expected = (torch.outer(covered(40, 20, 30), covered(70, 140 / 3, 175 / 3)) / (10 * 35 / 3)
                + 2 * torch.outer(covered(40, 20, 40), covered(70, 35, 70)) / (20 * 35))
    assert torch.allclose(painted, expected)


def test_clear_errors():
    model, processor = built("qwen2_vl")
    inputs = process(processor, random_image(40, 50))
    layout = LAYOUTS["qwen2_vl"]
    with pytest.raises(ValueError, match="image_grid_thw"):
        layout(model, processor, {"input_ids": inputs["input_ids"]}, (40, 50))
    two = dict(inputs, image_grid_thw=inputs["image_grid_thw"].repeat(2, 1))
    with pytest.raises(ValueError, match="one image at a time"):
        layout(model, processor, two, (40, 50))
    with pytest.raises(ValueError, match="height, width"):
        layout(model, processor, inputs, (0, 50))

    model, processor = built("idefics3")
    inputs = process(processor, random_image(100, 130))  # 3 × 3 tiles
    with pytest.raises(ValueError, match="image_size"):
        LAYOUTS["idefics3"](model, processor, inputs, (10, 100))  # would be 1 × 3 tiles
    fewer = dict(inputs, input_ids=inputs["input_ids"][:, :20])
    with pytest.raises(ValueError, match="image tokens"):
        LAYOUTS["idefics3"](model, processor, fewer, (100, 130))


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm"])
def test_builders_generate(name):
    model, processor = built(name, token_local=False)
    inputs = process(processor, random_image(37, 61))
    output = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert output.shape == (1, inputs["input_ids"].shape[1] + 3)
