"""Showing an answer's explanation (explain.vlm.view), loading a vision-language model (explain.vlm.hf) and the
``explain vlm`` command.

The figure and the page are checked on explanations made by hand, each token's map one bright square at its own
place, so that what is drawn can be worked out without explain: the colour at a square is the blend of the image
and the colour map's top colour (taken from matplotlib), and the page is read back in headless Chromium (every
request that is not file:// aborted) by hovering, focusing, tapping and pinning tokens. The command is run end to
end on a tiny random-weight LLaVA saved to a folder, its answer compared with plain greedy ``model.generate``.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

import matplotlib
import numpy as np
import pytest
import torch
import transformers
import vlm_tiny
from conftest import offline_page
from PIL import Image

from explain.cli import main
from explain.io.explanation import Explanation
from explain.io.inputs import DisplayImages
from explain.models import WeightsUnavailableError
from explain.vlm.hf import load_vision_language_model
from explain.vlm.view import token_figure, token_html, visible_token, write_token_html

HOSTILE = "<script>window.__pwned = 1</script>"
QUOTED = 'a "quoted" & <img src=x onerror="window.__pwned = 2">'
TEXTS = ["A", " cat", HOSTILE, "\n", QUOTED, " "]
HEIGHT, WIDTH, CELL = 90, 120, 15  # squares of CELL pixels in a grid of 6 rows × 8 columns
PROMPT = "What is <b>this</b>?"


def square_of(k: int) -> tuple[int, int]:
    """(top, left) of token k's square: k-th cell of the grid, walking the columns 3 at a time so that
    neighbouring tokens are far apart."""
    columns = WIDTH // CELL
    position = (k * 3) % (columns * (HEIGHT // CELL)) + (k * 3) // (columns * (HEIGHT // CELL))
    row, column = divmod(position, columns)
    return row * CELL, column * CELL


def grey_image(height: int = HEIGHT, width: int = WIDTH) -> torch.Tensor:
    """(height, width, 3) in [0, 1]: red = blue (so that red − blue is 0 on the image), green a ramp."""
    ys, xs = torch.meshgrid(torch.linspace(0.3, 0.7, height), torch.linspace(0.2, 0.8, width), indexing="ij")
    return torch.stack([ys, xs, ys], dim=-1)


def hand_made(texts: list[str], *, signed: bool = False, image: Optional[torch.Tensor] = None,
              maps: Optional[torch.Tensor] = None, probabilities: bool = True) -> Explanation:
    """An Explanation as GenerationExplainer.explain returns it: 1 image × K tokens, token k's map 1 on its
    square and 0 elsewhere (signed: also −1 on the next token's square)."""
    count = len(texts)
    image = grey_image() if image is None else image
    height, width = image.shape[:2]
    if maps is None:
        maps = torch.zeros(1, count, height, width)
        for k in range(count):
            top, left = square_of(k)
            maps[0, k, top:top + CELL, left:left + CELL] = 1.0
            if signed:
                top, left = square_of(k + 1)
                maps[0, k, top:top + CELL, left:left + CELL] = -1.0
    scores = torch.log(torch.linspace(0.9, 0.3, count))[None]
    return Explanation(
        map_grid=maps, raw_map_grid=maps.clone(), scores=scores, class_indices=torch.arange(count)[None],
        display=DisplayImages(image[None]), method="generation:input_x_gradient", keep_target_dim=True,
        probabilities=scores.exp() if probabilities else None,
        diagnostics={"token_ids": torch.arange(count)[None], "prompt": [PROMPT], "answer": ["".join(texts)]},
        class_names=list(texts))


def colour(cmap: str, value: float) -> np.ndarray:
    """matplotlib's colour of ``value`` in [0, 1], RGB in [0, 1]."""
    return np.asarray(matplotlib.colormaps[cmap](value))[:3]


# ---- Texts ----------------------------------------------------------------------------------------

def test_whitespace_and_control_characters_are_made_visible():
    assert visible_token(" cat") == "␣cat"
    assert visible_token("\n") == "⏎"
    assert visible_token("a\tb") == "a⇥b"
    assert visible_token("\r\n") == "\\r⏎"
    assert visible_token("\x07") == "\\x07"
    assert visible_token("") == "∅"
    assert visible_token(" a red cat ") == "␣a red cat␣"  # spaces between words stay
    assert visible_token("  ") == "␣␣"
    assert visible_token(HOSTILE) == HOSTILE  # visible already; escaping is the page's business


# ---- The figure -----------------------------------------------------------------------------------

def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a 1-d bool array."""
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return list(zip(np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]))


def figure_panels(figure) -> list[tuple[str, np.ndarray]]:
    """The figure's panels, row by row, each (caption, (h, w, 3) float pixels in [0, 1]): the blocks of the one
    image of its axes between white rows and columns (the test images never reach white)."""
    (axis,) = figure.axes
    mosaic = axis.images[0].get_array().astype(float) / 255.0
    white = (mosaic == 1.0).all(axis=-1)
    panels = []
    for top, bottom in runs(~white.all(axis=1)):
        for left, right in runs(~white[top:bottom].all(axis=0)):
            panels.append(mosaic[top:bottom, left:right])
    captions = [text.get_text() for text in axis.texts]
    assert len(captions) == len(panels)
    return list(zip(captions, panels))


def test_the_figure_shows_the_answer_then_each_token_over_the_image():
    explanation = hand_made(TEXTS)
    figure = token_figure(explanation, columns=4, alpha=0.5)
    written = "\n".join(text.get_text() for text in figure.texts)
    assert written.startswith("generation:input_x_gradient, 6 tokens\n")
    assert f"\nPrompt: {PROMPT}\n" in written
    assert written.endswith("\nAnswer: A cat" + HOSTILE + "\n" + QUOTED)  # the answer's newline starts a line
    drawn_texts = [text for axis in figure.axes for text in [*figure.texts, *axis.texts] if text.get_text()]
    assert all(not text.get_parse_math() for text in drawn_texts)  # "$x$" in a token is no formula
    panels = figure_panels(figure)
    assert len(panels) == 7  # the image and 6 tokens, in 2 rows of 4
    image = grey_image().numpy()
    assert panels[0][0] == "image" and np.abs(panels[0][1] - image).max() <= 0.5 / 255 + 1e-6
    probabilities = torch.linspace(0.9, 0.3, len(TEXTS))
    shown = ["A", "␣cat", HOSTILE[:15] + "…", "⏎", QUOTED[:15] + "…", "␣"]
    for k, (caption, drawn) in enumerate(panels[1:]):
        assert caption == f"{k}: {shown[k]}\np = {float(probabilities[k]):.3f}"
        top, left = square_of(k)
        inside = 0.5 * image[top + 7, left + 7] + 0.5 * colour("jet", 1.0)
        outside = 0.5 * image[HEIGHT - 1 - top, WIDTH - 1 - left] + 0.5 * colour("jet", 0.0)
        assert np.abs(drawn[top + 7, left + 7] - inside).max() < 1.5 / 255
        assert np.abs(drawn[HEIGHT - 1 - top, WIDTH - 1 - left] - outside).max() < 1.5 / 255
        rows, columns = np.nonzero((drawn[..., 0] - drawn[..., 2]) > 0)  # the image has red = blue: only the square
        assert (rows.min(), columns.min(), rows.max(), columns.max()) == (top, left, top + CELL - 1, left + CELL - 1)


def test_a_large_image_is_drawn_at_the_figure_resolution():
    image = torch.nn.functional.interpolate(grey_image().permute(2, 0, 1)[None], size=(HEIGHT * 4, WIDTH * 4),
                                            mode="nearest")[0].permute(1, 2, 0)
    maps = torch.nn.functional.interpolate(hand_made(TEXTS[:2]).map_grid, scale_factor=4, mode="nearest")
    figure = token_figure(hand_made(TEXTS[:2], image=image, maps=maps), panel_size=2.0, dpi=100)
    panels = figure_panels(figure)
    assert [drawn.shape for _, drawn in panels] == [(150, 200, 3)] * 3  # 2 inches × 100 dpi on the longer side
    for k, (_, drawn) in enumerate(panels[1:]):
        rows, columns = np.nonzero((drawn[..., 0] - drawn[..., 2]) > 0.1)
        top, left = square_of(k)
        scale = 200 / WIDTH
        assert abs(rows.min() - top * scale) <= 1 and abs(columns.min() - left * scale) <= 1
        assert abs(rows.max() + 1 - (top + CELL) * scale) <= 1 and abs(columns.max() + 1 - (left + CELL) * scale) <= 1


def test_signed_maps_are_drawn_in_the_diverging_colour_map():
    explanation = hand_made(TEXTS[:3], signed=True)
    for k, (_, drawn) in enumerate(figure_panels(token_figure(explanation, alpha=1.0, show_image=False))):
        (top, left), (below_top, below_left) = square_of(k), square_of(k + 1)
        assert np.abs(drawn[top + 7, left + 7] - colour("RdBu_r", 1.0)).max() < 1.5 / 255
        assert np.abs(drawn[below_top + 7, below_left + 7] - colour("RdBu_r", 0.0)).max() < 1.5 / 255
        assert np.abs(drawn[0, WIDTH - 1] - colour("RdBu_r", 128 / 255)).max() < 1.5 / 255  # 0 at the middle


def test_an_explanation_of_several_images_is_refused_with_the_fix():
    explanation = hand_made(TEXTS[:2])
    two = Explanation(map_grid=explanation.map_grid.repeat(2, 1, 1, 1),
                      raw_map_grid=explanation.raw_map_grid.repeat(2, 1, 1, 1),
                      scores=explanation.scores.repeat(2, 1), class_indices=None,
                      display=DisplayImages(grey_image()[None].repeat(2, 1, 1, 1)), method="m",
                      keep_target_dim=True, class_names=TEXTS[:2])
    with pytest.raises(ValueError, match=r"2 images: pass one of them, e.g. explanation\[0\]"):
        token_figure(two)
    with pytest.raises(ValueError, match="pass one of them"):
        token_html(two)
    wrong_names = hand_made(TEXTS[:2])
    wrong_names.class_names = ["only one"]
    with pytest.raises(ValueError, match="2 maps but 1 token texts"):
        token_html(wrong_names)


# ---- The page, as text ----------------------------------------------------------------------------

class Tokens(HTMLParser):
    """The answer's token elements of a page: (attributes, text) in document order; and every src/href."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[tuple[dict[str, Optional[str]], str]] = []
        self.addresses: list[str] = []
        self._open: Optional[dict[str, Optional[str]]] = None
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        attributes = dict(attrs)
        self.addresses += [value or "" for name, value in attrs if name in ("src", "href")]
        if "token" in (attributes.get("class") or "").split():
            self._open, self._text = attributes, ""

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and tag == "span":
            self.tokens.append((self._open, self._text))
            self._open = None


def test_the_page_holds_one_token_element_per_token_with_its_text_escaped(tmp_path):
    path = write_token_html(hand_made(TEXTS), tmp_path / "tokens.html")
    page = path.read_text(encoding="utf-8")
    parsed = Tokens()
    parsed.feed(page)
    assert [attributes["data-k"] for attributes, _ in parsed.tokens] == [str(k) for k in range(len(TEXTS))]
    assert [text for _, text in parsed.tokens] == ["A", " cat", HOSTILE, "⏎", QUOTED, "␣"]
    assert [attributes["tabindex"] for attributes, _ in parsed.tokens] == ["0"] + ["-1"] * (len(TEXTS) - 1)
    assert HOSTILE not in page.replace(html.escape(HOSTILE), "")  # only ever escaped
    assert "<img src=x" not in page and 'onerror="' not in page
    assert page.count("<script") == 2  # the data (JSON, not run) and the page's own script
    assert f"<p class=\"text\">{html.escape(PROMPT)}</p>" in page


def test_the_page_loads_nothing_and_allows_only_its_own_script_and_style(tmp_path):
    page = write_token_html(hand_made(TEXTS), tmp_path / "tokens.html").read_text(encoding="utf-8")
    parsed = Tokens()
    parsed.feed(page)
    assert parsed.addresses and all(address.startswith("data:image/") for address in parsed.addresses)
    assert "http://" not in page and "https://" not in page and "url(" not in page
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1)
    directives = dict(item.strip().split(" ", 1) for item in policy.split(";"))
    assert directives["default-src"] == "'none'" and directives["img-src"] == "data:"
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    for directive, text in (("script-src", script), ("style-src", style)):
        digest = base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")
        assert directives[directive] == f"'sha256-{digest}'"


def blocky_maps(count: int, size: int, cells: int, seed: int = 0) -> torch.Tensor:
    """(1, count, size, size) maps constant over each of cells × cells image-token cells, as GenerationExplainer
    paints them; each scaled to a largest value of 1."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(1, count, cells, cells, generator=generator) ** 3
    maps = torch.nn.functional.interpolate(values, size=(size, size), mode="nearest")
    return maps / maps.amax(dim=(-2, -1), keepdim=True)


def test_the_page_of_64_tokens_over_a_336_pixel_image_is_small(tmp_path):
    texts = [f" w{k}" for k in range(64)]
    generator = torch.Generator().manual_seed(1)
    photo = torch.nn.functional.interpolate(torch.rand(1, 3, 42, 42, generator=generator), size=(336, 336),
                                            mode="bicubic").clamp(0, 1)[0].permute(1, 2, 0)
    explanation = hand_made(texts, image=photo, maps=blocky_maps(64, 336, 24))  # LLaVA-1.5: 24 × 24 tokens
    size = write_token_html(explanation, tmp_path / "tokens.html").stat().st_size
    print(f"page of 64 tokens over a 336-pixel image: {size / 1e3:.0f} kB")
    assert size < 400_000  # measured 263 kB: about 3 kB of PNG a map (in base64), 40 kB the image
    page = (tmp_path / "tokens.html").read_text(encoding="utf-8")
    assert page.count('class="token"') == 64
    assert page.count("data:image/png;base64,") == 64  # the maps lossless: PNG is the smaller


def page_data(page: str) -> dict:
    """The page's data: the JSON of its <script type="application/json"> element."""
    return json.loads(re.search(r'<script type="application/json" id="token-data">(.*?)</script>', page, re.S)
                      .group(1))


def test_maps_are_embedded_lossless_and_at_most_map_size():
    explanation = hand_made(TEXTS[:3])
    maps = page_data(token_html(explanation, map_size=60))["maps"]
    assert len(maps) == 3
    for k, uri in enumerate(maps):
        assert uri.startswith("data:image/png;base64,")
        picture = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
        assert picture.size == (60, 45) and picture.mode == "L"  # 120 × 90 halved
        halved = explanation.maps[0, k].numpy().reshape(45, 2, 60, 2).mean(axis=(1, 3))  # 2 × 2 area means
        # each pixel the colour-table entry of its value, as matplotlib chooses it: floor(256 · v), 255 at 1
        assert np.array_equal(np.asarray(picture), np.minimum(np.floor(halved * 256), 255).astype(np.uint8))


def test_scores_that_are_not_log_probabilities_are_called_scores():
    explanation = hand_made(TEXTS[:2], probabilities=False)  # as "attnlrp" gives: logits, no probabilities
    page = token_html(explanation)
    data = page_data(page)
    assert data["scoreName"] == "score" and [token["p"] for token in data["tokens"]] == [None, None]
    assert [token["score"] for token in data["tokens"]] == pytest.approx(explanation.scores[0].tolist(), abs=1e-6)
    assert "probability" not in " ".join(re.findall(r'aria-label="([^"]*)"', page))
    assert [caption for caption, _ in figure_panels(token_figure(explanation))] == ["image", "0: A", "1: ␣cat"]


# ---- The page, in a browser -----------------------------------------------------------------------



@pytest.fixture
def open_page(chromium):
    """open_page(path, **context options) → the page at ``path`` under its own Content-Security-Policy, every
    request that is not file:// aborted; afterwards, no request was blocked, no error was logged and nothing
    injected ran."""
    opened = []

    def open_(path: Path, **options):
        context, page, blocked, errors = offline_page(chromium, **{"viewport": {"width": 1200, "height": 800},
                                                                   **options})
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready='true']")
        opened.append((context, page, blocked, errors))
        return page

    yield open_
    for context, page, blocked, errors in opened:
        assert page.evaluate("window.__pwned") is None
        assert blocked == [] and errors == []
        context.close()


def stage_pixels(page) -> np.ndarray:
    """What the image area shows, (h, w, 3) float in [0, 1], from a screenshot."""
    shot = page.locator(".stage").screenshot()
    return np.asarray(Image.open(io.BytesIO(shot)).convert("RGB"), dtype=float) / 255.0


def red_box(pixels: np.ndarray) -> tuple[float, float, float, float]:
    """(top, left, bottom, right) of where red exceeds blue (the image has red = blue), in image pixels."""
    scale = pixels.shape[1] / WIDTH
    rows, columns = np.nonzero(pixels[..., 0] - pixels[..., 2] > 0.1)
    assert rows.size, "no red anywhere"
    return rows.min() / scale, columns.min() / scale, (rows.max() + 1) / scale, (columns.max() + 1) / scale


def assert_shows_square(page, k: int) -> None:
    page.wait_for_selector(f"body[data-shown='{k}']")
    top, left, bottom, right = red_box(stage_pixels(page))
    expected_top, expected_left = square_of(k)
    assert abs(top - expected_top) <= 1.5 and abs(left - expected_left) <= 1.5, (k, top, left)
    assert abs(bottom - expected_top - CELL) <= 1.5 and abs(right - expected_left - CELL) <= 1.5, (k, bottom, right)


def test_hovering_a_token_shows_its_map_where_its_square_is(open_page, tmp_path):
    page = open_page(write_token_html(hand_made(TEXTS), tmp_path / "tokens.html"))
    assert page.locator("#overlay").is_hidden()
    for k in range(len(TEXTS)):
        page.hover(f"#answer .token[data-k='{k}']")
        assert_shows_square(page, k)
        caption = page.inner_text("#caption")
        assert caption.startswith(f"Token {k + 1} of {len(TEXTS)}: {visible_token(TEXTS[k])}")
        assert f"probability {float(torch.linspace(0.9, 0.3, len(TEXTS))[k]):.3f}" in caption
    # the colours: opacity 1 shows the colour map itself, 0.5 the blend with the image
    page.hover("#answer .token[data-k='1']")
    page.wait_for_selector("body[data-shown='1']")
    image = grey_image().numpy()
    top, left = square_of(1)
    pixels = stage_pixels(page)
    scale = pixels.shape[1] / WIDTH

    def at(y: float, x: float) -> np.ndarray:
        return pixels[round(y * scale), round(x * scale)]

    assert np.abs(at(top + 7.5, left + 7.5) - (0.5 * image[top + 7, left + 7] + 0.5 * colour("jet", 1.0))).max() < 0.03
    assert np.abs(at(80, 110) - (0.5 * image[80, 110] + 0.5 * colour("jet", 0.0))).max() < 0.03
    page.locator("#opacity").fill("1")
    pixels = stage_pixels(page)
    assert np.abs(at(top + 7.5, left + 7.5) - colour("jet", 1.0)).max() < 0.03
    assert np.abs(at(80, 110) - colour("jet", 0.0)).max() < 0.03
    page.mouse.move(5, 5)  # off the tokens: the image alone
    page.wait_for_selector("body[data-shown='-1']")
    assert page.locator("#overlay").is_hidden()


def test_the_keyboard_steps_through_the_tokens_and_pins_one(open_page, tmp_path):
    page = open_page(write_token_html(hand_made(TEXTS), tmp_path / "tokens.html"))
    page.mouse.move(5, 5)
    page.keyboard.press("Tab")  # the answer is one stop: its current token
    assert page.evaluate("document.activeElement.dataset.k") == "0"
    assert_shows_square(page, 0)
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.k") == "2"
    assert_shows_square(page, 2)
    page.keyboard.press("Enter")
    page.wait_for_selector("body[data-pinned='2']")
    assert page.get_attribute(".token[data-k='2']", "aria-pressed") == "true"
    page.keyboard.press("End")
    assert_shows_square(page, len(TEXTS) - 1)
    page.keyboard.press("Tab")  # focus leaves the answer: the pinned token stays shown
    assert_shows_square(page, 2)
    page.keyboard.press("Escape")
    page.wait_for_selector("body[data-pinned='-1']")
    page.wait_for_selector("body[data-shown='-1']")


def test_a_pinned_token_stays_shown_when_the_pointer_leaves(open_page, tmp_path):
    page = open_page(write_token_html(hand_made(TEXTS), tmp_path / "tokens.html"))
    page.click("#answer .token[data-k='4']")
    page.wait_for_selector("body[data-pinned='4']")
    page.click("h1")  # the pointer and the focus elsewhere
    assert_shows_square(page, 4)
    assert page.inner_text("#caption").endswith("(pinned)")
    page.hover("#answer .token[data-k='1']")
    assert_shows_square(page, 1)
    page.mouse.move(5, 5)
    assert_shows_square(page, 4)
    page.click("#unpin")
    page.wait_for_selector("body[data-shown='-1']")
    assert page.is_disabled("#unpin")


def test_tapping_a_token_shows_and_pins_it(open_page, tmp_path):
    page = open_page(write_token_html(hand_made(TEXTS), tmp_path / "tokens.html"), has_touch=True, is_mobile=True,
                     viewport={"width": 390, "height": 844})
    page.tap("#answer .token[data-k='3']")
    page.wait_for_selector("body[data-pinned='3']")
    page.locator(".stage").scroll_into_view_if_needed()
    assert_shows_square(page, 3)
    page.tap("#answer .token[data-k='3']")  # tapping it again unpins
    page.wait_for_selector("body[data-pinned='-1']")


def test_each_of_many_tokens_shows_its_own_map(open_page, tmp_path):
    texts = [f" w{k}" for k in range(40)]
    page = open_page(write_token_html(hand_made(texts), tmp_path / "tokens.html"))
    for k in (0, 17, 39):
        page.hover(f"#answer .token[data-k='{k}']")
        assert_shows_square(page, k)


# ---- Loading a model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_llava(tmp_path_factory) -> tuple[Path, torch.nn.Module, object]:
    """A tiny random-weight LLaVA and its processor, saved as save_pretrained writes them."""
    folder = tmp_path_factory.mktemp("tiny-llava")
    model, processor = vlm_tiny.tiny_llava(seed=3)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, model, processor


def test_a_saved_model_loads_in_eval_mode_with_its_processor(saved_llava):
    folder, model, processor = saved_llava
    loaded, loaded_processor = load_vision_language_model(f"hf:{folder}")
    assert type(loaded) is type(model) and not loaded.training
    saved = model.state_dict()
    assert saved.keys() == loaded.state_dict().keys()
    assert all(torch.equal(saved[name], value) for name, value in loaded.state_dict().items())
    picture = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 50, 3)).astype(np.uint8))
    ours = processor(images=[picture], text=["<image>\nhi"], return_tensors="pt")
    theirs = loaded_processor(images=[picture], text=["<image>\nhi"], return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    half, _ = load_vision_language_model(f"hf:{folder}", dtype="bfloat16", device="cpu")
    assert {parameter.dtype for parameter in half.parameters()} == {torch.bfloat16}


def test_a_folder_without_a_model_says_how_to_save_one(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=r"holds no HuggingFace model: there is no config.json \(it holds notes.txt\)"
                       r".*model.save_pretrained\(DIR\) and processor.save_pretrained\(DIR\)"):
        load_vision_language_model(f"hf:{tmp_path}")


def test_a_config_without_weights_says_to_save_again(tmp_path, saved_llava):
    folder, model, _ = saved_llava
    model.config.save_pretrained(tmp_path)
    with pytest.raises(WeightsUnavailableError, match=r"should hold what model.save_pretrained\(DIR\) writes"):
        load_vision_language_model(f"hf:{tmp_path}")


def test_a_text_only_model_is_not_a_vision_language_model(tmp_path):
    config = vlm_tiny.tiny_llama_config(vocab_size=80)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"is not a vision-language model: its config is a LlamaConfig \(model type "
                       r"'llama'; LlamaForCausalLM\)"):
        load_vision_language_model(f"hf:{tmp_path}")


def test_a_model_without_its_processor_says_to_save_the_processor(tmp_path, saved_llava):
    _, model, _ = saved_llava
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has the model but .*processor.save_pretrained\(DIR\)"):
        load_vision_language_model(f"hf:{tmp_path}")


def test_a_hub_id_that_cannot_be_fetched_says_to_download_it_first(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as without network, at once
    with pytest.raises(WeightsUnavailableError, match=r"could not fetch 'nobody/no-such-vlm' from the HuggingFace hub"
                       r".*Download it first.*pass hf:DIR \(a local directory\)"):
        load_vision_language_model("hf:nobody/no-such-vlm")


def test_sources_that_are_not_hf_or_not_there_are_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"got '{re.escape(str(tmp_path))}' \(write hf:"):
        load_vision_language_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"there is no directory '/.*/no/such/folder'"):
        load_vision_language_model("hf:./no/such/folder")
    with pytest.raises(ValueError, match="dtype 'float8' is not one of float32, float16, bfloat16"):
        load_vision_language_model("hf:x", dtype="float8")


# ---- The command ----------------------------------------------------------------------------------

def fails_with(capsys, arguments: list[str], *patterns: str) -> str:
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(arguments))
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    line = [line for line in error.splitlines() if line.startswith("explain: error:")]
    assert len(line) == 1, error
    for pattern in patterns:
        assert pattern in line[0], (pattern, line[0])
    return line[0]


@pytest.fixture
def image_file(tmp_path) -> Path:
    path = tmp_path / "photo.png"
    Image.fromarray(np.random.RandomState(1).randint(0, 256, (40, 56, 3)).astype(np.uint8)).save(path)
    return path


def test_the_command_says_what_is_wrong(capsys, tmp_path, image_file, saved_llava):
    folder = saved_llava[0]
    fails_with(capsys, ["vlm", str(image_file), "--model", f"hf:{folder}"],
               "the following arguments are required: --prompt")
    fails_with(capsys, ["vlm", str(image_file), "--model", f"hf:{folder}", "--prompt", "hi", "--method", "gradcam"],
               "argument --method: invalid choice: 'gradcam'", "input_x_gradient")
    fails_with(capsys, ["vlm", str(image_file), "--model", str(folder), "--prompt", "hi"],
               "loaded from hf:DIRECTORY or hf:HUB_ID", "(write hf:")
    fails_with(capsys, ["vlm", str(tmp_path / "missing.png"), "--model", f"hf:{folder}", "--prompt", "hi"],
               "no image file at")
    fails_with(capsys, ["vlm", str(image_file), "--model", f"hf:{folder}", "--prompt", "hi", "--out",
                        str(image_file)], "is a file; give a folder")
    fails_with(capsys, ["vlm", str(image_file), "--model", f"hf:{folder}", "--prompt", "hi", "--alpha", "2"],
               "--alpha must lie in [0, 1]")
    fails_with(capsys, ["vlm", str(image_file), "--model", f"hf:{folder}", "--prompt", "hi", "--max-new-tokens", "0"],
               "must be at least 1")


def greedy_answer(model, processor, picture: Image.Image, prompt: str, max_new_tokens: int) -> tuple[str, list[int]]:
    """Plain transformers: the chat template, the processor and model.generate without sampling."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=[picture], text=[text], return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    new = output[0, inputs["input_ids"].shape[1]:].tolist()
    return processor.tokenizer.decode(new, skip_special_tokens=True), new


def printed(capsys) -> dict[str, str]:
    lines = capsys.readouterr().out
    answer = re.search(r"^answer: (.*?)\n\d+ answer token", lines, re.S | re.M).group(1)
    return {"answer": answer, "figure": re.search(r"^figure: (.*)$", lines, re.M).group(1),
            "page": re.search(r"^page: (.*) \(open file://", lines, re.M).group(1),
            "count": re.search(r"^(\d+) answer token\(s\) explained", lines, re.M).group(1)}


def test_the_command_explains_the_greedy_answer(capsys, tmp_path, image_file, saved_llava):
    folder, model, processor = saved_llava
    prompt = "what is this?"
    expected, ids = greedy_answer(model, processor, Image.open(image_file).convert("RGB"), prompt, 6)
    special = set(processor.tokenizer.all_special_ids)
    answer_tokens = [token for token in ids if token not in special]
    assert answer_tokens, "the tiny model should say something"
    out = tmp_path / "out"
    assert main(["vlm", str(image_file), "--model", f"hf:{folder}", "--prompt", prompt, "--max-new-tokens", "6",
                 "--out", str(out)]) == 0
    result = printed(capsys)
    assert result["answer"] == expected
    assert int(result["count"]) == len(answer_tokens)
    assert Path(result["figure"]) == out / "tokens.png" and Path(result["page"]) == out / "tokens.html"
    with Image.open(out / "tokens.png") as figure:
        assert figure.format == "PNG" and figure.width > 600
    parsed = Tokens()
    parsed.feed((out / "tokens.html").read_text(encoding="utf-8"))
    assert len(parsed.tokens) == len(answer_tokens)
    texts = [processor.tokenizer.decode(ids[:end]) for end in range(len(ids) + 1)]
    pieces = [after[len(before):] for before, after in zip(texts, texts[1:])]
    shown = [piece for piece, token in zip(pieces, ids) if token not in special]
    assert [text for _, text in parsed.tokens] == [
        visible_token(piece) if not piece.strip() else piece.replace("\n", "⏎") for piece in shown]


def test_the_command_explains_a_given_answer_and_each_token_shows_in_the_page(capsys, tmp_path, image_file,
                                                                               saved_llava, open_page):
    folder, _, processor = saved_llava
    out = tmp_path / "given"
    assert main(["vlm", str(image_file), "--model", f"hf:{folder}", "--prompt", "what?", "--answer", "a red cat",
                 "--method", "attention", "--out", str(out)]) == 0
    result = printed(capsys)
    assert result["answer"] == "a red cat" and result["count"] == "9"  # one token per character
    page = open_page(out / "tokens.html")
    assert page.locator("#answer .token").count() == 9
    assert page.inner_text("#answer") == "a␣red␣cat"
    for k in range(9):
        page.hover(f"#answer .token[data-k='{k}']")
        page.wait_for_selector(f"body[data-shown='{k}']")
        assert page.inner_text("#caption").startswith(f"Token {k + 1} of 9: {visible_token('a red cat'[k])}")
    assert page.locator("#overlay").is_visible()
    assert math.isfinite(float(page.inner_text("#caption").rsplit(" ", 1)[-1]))
