"""Layouts of LLaVA, LLaVA-NeXT and PaliGemma image tokens, checked against the models themselves.

The oracle does not use the layout code: with ``token_local=True`` every image token sees only its own patch of the
processed view, so perturbing a few pixels of the ORIGINAL image changes exactly the embeddings (captured where the
language model receives them) of the tokens whose patches those pixels reach through the processor's resize, crop,
padding and tiling. That set must be the set of tokens whose layout cell contains the point. Where the processor
resamples, a pixel reaches a couple of output pixels around it, so those probes keep a margin from every cell
border; where it does not resample (only pads and crops), every pixel is probed, up to the cell borders, which checks
the rounding of the padding and cropping exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from vlm_tiny import CHAT_TEMPLATE, image_token_embeddings, tiny_llava, tiny_llava_next, tiny_paligemma

import explain.vlm.families  # noqa: F401  (registers the layouts)
from explain.vlm.families import layout_for
from explain.vlm.layout import LAYOUTS, ImageLayout, paint

PATCH = 8
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def perturbed(image: Image.Image, top: int, left: int, block: int) -> Image.Image:
    """The image with a block × block square at (top, left) shifted by half the colour range."""
    pixels = np.array(image)
    pixels[top:top + block, left:left + block] = (pixels[top:top + block, left:left + block].astype(int) + 128) % 256
    return Image.fromarray(pixels)


def process(processor, images: list[Image.Image]) -> dict:
    text = [processor.apply_chat_template(MESSAGES, add_generation_prompt=True)] * len(images)
    return dict(processor(images=images, text=text, return_tensors="pt"))


def cells_at(layout: ImageLayout, y: float, x: float) -> set[int]:
    """Tokens whose layout cell contains the point (y, x) (original pixels)."""
    found = set()
    for grid in layout.grids:
        rows, cols = grid.tokens.shape
        left, top, right, bottom = grid.box
        row = math.floor((y - top) / ((bottom - top) / rows))
        col = math.floor((x - left) / ((right - left) / cols))
        if 0 <= row < rows and 0 <= col < cols and int(grid.tokens[row, col]) >= 0:
            found.add(int(grid.tokens[row, col]))
    return found


def clearance(grid, y: float, x: float, half: float) -> float:
    """How far (in processed pixels, PATCH per cell) a square of half-side ``half`` (original pixels) centred at
    (y, x) keeps from the grid's cell borders (from its box where the square is outside)."""
    rows, cols = grid.tokens.shape
    left, top, right, bottom = grid.box
    distances = []
    for value, start, cell, count in ((y, top, (bottom - top) / rows, rows), (x, left, (right - left) / cols, cols)):
        u = (value - start) / cell
        inside = 0 <= u <= count
        to_line = abs(u - round(u)) if inside else (-u if u < 0 else u - count)
        distances.append((inside, (to_line - half / cell) * PATCH))
    (inside_y, dy), (inside_x, dx) = distances
    if inside_y and inside_x:
        return min(dy, dx)
    if inside_x:
        return dy
    if inside_y:
        return dx
    return max(dy, dx)


def check_probes(model, processor, image: Image.Image, layout: ImageLayout, *, block: int, margin: float,
                 step: int) -> dict:
    """Perturb block × block squares on a lattice (every ``step`` pixels) of the original image. For each grid the
    square keeps at least ``margin`` processed pixels clear of, the grid's tokens that change must be exactly those
    whose cells hold the square's centre; tokens in no grid never change. Returns counts for coverage checks."""
    grid_tokens = [set(grid.tokens[grid.tokens >= 0].tolist()) for grid in layout.grids]
    unplaced = set(torch.nonzero(~layout.placed()).flatten().tolist())
    probes, checked = [], []
    for top in range(0, image.height - block + 1, step):
        for left in range(0, image.width - block + 1, step):
            centre = (top + block / 2, left + block / 2)
            grids = [index for index, grid in enumerate(layout.grids)
                     if clearance(grid, *centre, block / 2) >= margin]
            if grids:
                probes.append((top, left))
                checked.append(grids)
    assert probes, "no probe point keeps the margin"
    images = [image] + [perturbed(image, top, left, block) for top, left in probes]
    embeds = image_token_embeddings(model, process(processor, images))
    assert embeds.shape[1] == layout.token_count
    differs = (embeds[1:] - embeds[0]).abs().amax(dim=-1) > 1e-5
    mismatches, hit, empty = [], set(), 0
    for (top, left), grids, row in zip(probes, checked, differs):
        changed = set(torch.nonzero(row).flatten().tolist())
        expected = cells_at(layout, top + block / 2, left + block / 2)
        hit |= changed
        empty += not expected
        if changed & unplaced:
            mismatches.append(((top, left), "unplaced", changed & unplaced))
        for index in grids:
            want, got = expected & grid_tokens[index], changed & grid_tokens[index]
            if want != got:
                mismatches.append(((top, left), index, want, got))
    assert not mismatches, f"{len(mismatches)} of {len(probes)} probes disagree, e.g. (top, left), grid, layout, " \
                           f"model: {mismatches[:5]}"
    return {"probes": len(probes), "hit": len(hit), "empty": empty}


def llava_variant(strategy: str, image_processor) -> tuple[torch.nn.Module, object]:
    """The tiny token-local LLaVA with another select strategy and image processor."""
    model, processor = tiny_llava(token_local=True)
    model.config.vision_feature_select_strategy = strategy
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=processor.tokenizer,
                                            patch_size=PATCH, num_additional_image_tokens=1,
                                            vision_feature_select_strategy=strategy, chat_template=CHAT_TEMPLATE)
    return model, processor


def clip_processor(fast: bool, shortest: int = 32, crop: int = 32):
    cls = transformers.CLIPImageProcessor if fast else transformers.CLIPImageProcessorPil
    return cls(size={"shortest_edge": shortest}, crop_size={"height": crop, "width": crop})


def llava_processor(fast: bool):
    cls = transformers.LlavaImageProcessor if fast else transformers.LlavaImageProcessorPil
    return cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_pad=True)


def layout_of(model, processor, image: Image.Image) -> ImageLayout:
    inputs = process(processor, [image])
    return layout_for(model)(model, processor, inputs, (image.height, image.width))


def test_families_are_registered():
    assert {"llava", "llava_next", "paligemma"} <= set(LAYOUTS)
    for build in (tiny_llava, tiny_llava_next, tiny_paligemma):
        model, _ = build()
        assert layout_for(model) is LAYOUTS[model.config.model_type]


# ---------------------------------------------------------------------------------------------------- LLaVA


@pytest.mark.parametrize("fast", [True, False], ids=["torchvision", "pil"])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_centre_crop(fast, strategy):
    """Shortest edge to 32 px, centre crop 32 × 32: 40×50, 50×40, 37×61 images; the cropped-off sides are in no
    cell (and change no token); with "full" token 0 is the class token, in no grid."""
    model, processor = llava_variant(strategy, clip_processor(fast))
    for size in [(40, 50), (50, 40), (37, 61)]:
        image = random_image(*size)
        layout = layout_of(model, processor, image)
        assert layout.token_count == 16 + (strategy == "full")
        class_token = [False] if strategy == "full" else []
        assert layout.placed().tolist() == class_token + [True] * 16
        counts = check_probes(model, processor, image, layout, block=2, margin=1.75, step=2)
        assert counts["hit"] == 16, counts  # every patch token was probed
        assert counts["empty"] > 0, counts  # and points the crop cut off


@pytest.mark.parametrize("fast", [True, False], ids=["torchvision", "pil"])
def test_llava_pad_to_square(fast):
    """LlavaImageProcessor with do_pad: the image padded to a square (centred) before the resize; the grid reaches
    outside the image on the short side."""
    model, processor = llava_variant("default", llava_processor(fast))
    for size in [(40, 50), (61, 37)]:
        image = random_image(*size, seed=1)
        layout = layout_of(model, processor, image)
        left, top, right, bottom = layout.grids[0].box
        side = max(size)
        assert (right - left, bottom - top) == pytest.approx((side, side))
        assert (top, left) == pytest.approx((-((side - size[0]) // 2), -((side - size[1]) // 2)))
        counts = check_probes(model, processor, image, layout, block=2, margin=1.75, step=2)
        assert counts["hit"] >= 8, counts


@pytest.mark.parametrize("fast", [True, False], ids=["torchvision", "pil"])
def test_llava_pad_to_square_exact(fast):
    """A 29×32 (and 32×27) image padded to 32×32 is not resampled: 1 (2) rows (columns) of padding before, 2 (3)
    after, in both backends. Every pixel is probed, up to the cell borders."""
    model, processor = llava_variant("full", llava_processor(fast))
    for size, (top, left) in [((29, 32), (-1, 0)), ((32, 27), (0, -2))]:
        image = random_image(*size, seed=9)
        layout = layout_of(model, processor, image)
        assert layout.grids[0].box == pytest.approx((left, top, left + 32, top + 32))
        counts = check_probes(model, processor, image, layout, block=1, margin=0.0, step=1)
        assert counts["probes"] == size[0] * size[1] and counts["hit"] == 16


@pytest.mark.parametrize("fast", [True, False], ids=["torchvision", "pil"])
@pytest.mark.parametrize("size", [(29, 45), (45, 29)])
def test_llava_crop_rounding_exact(fast, size):
    """Shortest edge 29 → no resampling (the image already has it); crop 32 × 32 pads the short side by 3 (the
    torchvision backend 1 before, the PIL backend 2) and crops 13 off the long side (6 before). Every pixel is
    probed, up to the cell borders: the layout's rounding must be the processor's, to the pixel."""
    model, processor = llava_variant("default", clip_processor(fast, shortest=29, crop=32))
    image = random_image(*size, seed=2)
    layout = layout_of(model, processor, image)
    pad_before = 1 if fast else 2
    left, top, right, bottom = layout.grids[0].box
    expected_top, expected_left = (-pad_before, 6) if size[0] == 29 else (6, -pad_before)
    assert (left, top, right, bottom) == pytest.approx((expected_left, expected_top, expected_left + 32,
                                                        expected_top + 32))
    counts = check_probes(model, processor, image, layout, block=1, margin=0.0, step=1)
    assert counts["probes"] == size[0] * size[1]
    assert counts["hit"] == 16  # every patch holds some of the image's pixels


# ---------------------------------------------------------------------------------------------------- LLaVA-NeXT


@pytest.fixture(scope="module")
def llava_next():
    return tiny_llava_next(token_local=True)


@pytest.mark.parametrize("size", [(40, 50), (50, 40), (37, 61), (30, 80)])
def test_llava_next_tiles_and_base(llava_next, size):
    """Every probe changes one base-view token and (where unpad kept its patch) one tile token; the newline at each
    row end (the model's image_newline embedding) is in no grid, every other token is."""
    model, processor = llava_next
    check_next(model, processor, random_image(*size, seed=3))


def check_next(model, processor, image: Image.Image) -> None:
    layout = layout_of(model, processor, image)
    counts = check_probes(model, processor, image, layout, block=2, margin=1.75, step=2)
    embeds = image_token_embeddings(model, process(processor, [image]))[0]
    newline = (embeds == model.model.image_newline.detach()).all(dim=-1)  # the model's row-end tokens
    assert int(newline.sum()) >= 2
    assert layout.placed().tolist() == (~newline).tolist()
    assert counts["hit"] >= 0.8 * int(layout.placed().sum()), counts


def test_llava_next_pil_backend():
    """The PIL image processor pads and tiles as the torchvision one."""
    model, processor = tiny_llava_next(token_local=True)
    fast = processor.image_processor
    processor.image_processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=fast.image_grid_pinpoints)
    check_next(model, processor, random_image(50, 40, seed=7))


def test_llava_next_siglip_full():
    """A SigLIP tower (no class token) with the "full" strategy: every base-view token is a patch."""
    model, processor = tiny_llava_next(token_local=True, vision="siglip")
    image = random_image(37, 61, seed=8)
    check_next(model, processor, image)
    assert layout_of(model, processor, image).grids[0].tokens.flatten().tolist() == list(range(16))


def test_llava_next_token_counts_many_sizes(llava_next):
    """Over many image sizes the layout's unpad agrees with the processor's token count (checked inside the layout
    function) and places every tile token but one newline per kept row; very wide images (9×85) keep no tile row
    at all."""
    model, processor = llava_next
    without_tiles = []
    for height in range(9, 130, 11):
        for width in range(7, 130, 13):
            layout = layout_of(model, processor, random_image(height, width))
            assert bool(layout.placed()[:16].all())
            tile_tokens = layout.token_count - 16
            newlines = tile_tokens - int(layout.placed()[16:].sum())
            kept_tile_cells = sum(int((grid.tokens >= 0).sum()) for grid in layout.grids[1:])
            assert kept_tile_cells == tile_tokens - newlines
            if newlines:
                assert tile_tokens % newlines == 0  # each kept row: its patches, then a newline
            else:
                assert tile_tokens == 0 and len(layout.grids) == 1
                without_tiles.append((height, width))
    assert without_tiles == [(9, 85), (9, 98), (9, 111), (9, 124)]


def test_llava_next_unpad_exact(llava_next):
    """A 32×50 image fits the 32×64 resolution without resampling (padded 7 px left and right, two tiles);
    unpad keeps feature columns 1–6, so the image's first and last pixel columns, which lie in the dropped
    columns 0 and 7, reach only the base view. Every pixel is probed for its tile token (exact), and away from the
    base view's borders for its base token."""
    model, processor = llava_next
    image = random_image(32, 50, seed=4)
    layout = layout_of(model, processor, image)
    assert layout.token_count == 16 + 4 * (6 + 1)
    newlines = [16 + row * 7 + 6 for row in range(4)]
    assert not layout.placed()[newlines].any() and int(layout.placed().sum()) == 16 + 24
    tile_grids = layout.grids[1:]
    assert [grid.box for grid in tile_grids] == [pytest.approx((-7, 0, 25, 32)), pytest.approx((25, 0, 57, 32))]
    probes = [(top, left) for top in range(32) for left in range(50)]
    images = [image] + [perturbed(image, top, left, 1) for top, left in probes]
    embeds = image_token_embeddings(model, process(processor, images))
    changed = (embeds[1:] - embeds[0]).abs().amax(dim=-1) > 1e-5
    for (top, left), row in zip(probes, changed):
        tile_changed = set(torch.nonzero(row[16:]).flatten().add(16).tolist())
        tile_expected = {token for token in cells_at(layout, top + 0.5, left + 0.5) if token >= 16}
        assert tile_changed == tile_expected, (top, left)
        assert (tile_changed == set()) == (left == 0 or left == 49)


# ---------------------------------------------------------------------------------------------------- PaliGemma


@pytest.mark.parametrize("size", [(40, 50), (50, 40), (37, 61)])
def test_paligemma_square_resize(size):
    model, processor = tiny_paligemma(token_local=True)
    image = random_image(*size, seed=5)
    layout = layout_of(model, processor, image)
    assert layout.token_count == 16 and len(layout.grids) == 1
    assert layout.grids[0].box == pytest.approx((0, 0, size[1], size[0]))
    counts = check_probes(model, processor, image, layout, block=2, margin=1.75, step=2)
    assert counts["hit"] == 16, counts


# ---------------------------------------------------------------------------------------------------- paint


def test_paint_one_hot_lights_its_cells(llava_next):
    """paint() of a one-hot relevance gives each pixel the share of that token's cells it covers divided by the
    cell's area (1 / area inside a cell; a tile cell and a base cell overlap for different tokens), 0 elsewhere."""
    model, processor = llava_next
    image = random_image(40, 50, seed=6)
    layout = layout_of(model, processor, image)
    placed = torch.nonzero(layout.placed()).flatten()
    maps = paint(torch.eye(layout.token_count, dtype=torch.float64)[placed], layout, (40, 50))
    ys, xs = torch.meshgrid(torch.arange(40, dtype=torch.float64), torch.arange(50, dtype=torch.float64),
                            indexing="ij")  # each pixel's top-left corner
    for token, painted in zip(placed.tolist(), maps):
        expected = torch.zeros(40, 50, dtype=torch.float64)
        for grid in layout.grids:
            rows, cols = grid.tokens.shape
            left, top, right, bottom = grid.box
            cell_h, cell_w = (bottom - top) / rows, (right - left) / cols
            for row, col in torch.nonzero(grid.tokens == token).tolist():
                down = (torch.minimum(ys + 1, torch.tensor(top + (row + 1) * cell_h))
                        - torch.maximum(ys, torch.tensor(top + row * cell_h))).clamp(min=0)
                across = (torch.minimum(xs + 1, torch.tensor(left + (col + 1) * cell_w))
                          - torch.maximum(xs, torch.tensor(left + col * cell_w))).clamp(min=0)
                expected += down * across / (cell_h * cell_w)
        torch.testing.assert_close(painted, expected)
        assert bool((painted > 0).any())


# ---------------------------------------------------------------------------------------------------- bad input


def test_clear_errors():
    """Inputs the layout cannot describe are refused with what was wrong and how to fix it."""
    model, processor = tiny_llava()
    image = random_image(40, 50)
    two = process(processor, [image, image])
    with pytest.raises(ValueError, match="one image"):
        LAYOUTS["llava"](model, processor, two, (40, 50))
    overridden = dict(processor(images=image, text="<image>hi", crop_size={"height": 24, "width": 24},
                                return_tensors="pt"))
    with pytest.raises(ValueError, match="pixel_values are 24×24"):
        LAYOUTS["llava"](model, processor, overridden, (40, 50))
    with pytest.raises(ValueError, match="no input_ids"):
        LAYOUTS["llava"](model, processor, {"pixel_values": two["pixel_values"][:1]}, (40, 50))

    next_model, next_processor = tiny_llava_next()
    inputs = process(next_processor, [image])
    with pytest.raises(ValueError, match="pass the original image's"):
        LAYOUTS["llava_next"](next_model, next_processor, inputs, (50, 40))
    next_model.config.image_grid_pinpoints = [[32, 64]]
    with pytest.raises(ValueError, match="pick different resolutions"):
        LAYOUTS["llava_next"](next_model, next_processor, inputs, (40, 50))

    pali_model, pali_processor = tiny_paligemma()
    inputs = process(pali_processor, [image])
    inputs["input_ids"] = inputs["input_ids"][:, 1:]  # one image token fewer
    with pytest.raises(ValueError, match="holds 15 image tokens, but a 4×4 patch grid gives 16"):
        LAYOUTS["paligemma"](pali_model, pali_processor, inputs, (40, 50))
