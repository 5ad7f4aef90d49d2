"""Showing the explanation of a generated answer: one relevance map over the image per answer token.

``token_figure`` draws the prompt and the answer as text, then every token's map over the image, captioned with the
token and its probability (a matplotlib Figure, for papers and notebooks). ``write_token_html`` writes one static,
self-contained HTML page: the answer's tokens as text; hovering, focusing or tapping a token shows its map over the
image; clicking (or Enter) pins one. The page needs no server and no network: the image is a JPEG data URI and each
token's map an 8-bit grey picture (long side at most ``map_size``; lossless PNG, or JPEG where that is smaller),
coloured in the browser through the colour map. The maps of ``GenerationExplainer`` are constant over each image
token's cell, which PNG stores in a few kilobytes: 64 tokens over a 336-pixel image make a page of about 0.26 MB.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import textwrap
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from ..core.caller import warn_at_callers_line
from ..io import render
from ..io.explanation import Explanation
from ..io.page_text import escaped

if TYPE_CHECKING:
    from matplotlib.figure import Figure

VISIBLE_WHITESPACE = {"\n": "⏎", "\t": "⇥", "\r": "\\r"}
"""How ``visible_token`` writes these characters; other control characters become escapes such as ``\\x07``."""
VISIBLE_SPACE = "␣"
"""How ``visible_token`` writes a space that begins or ends a token."""
EMPTY_TOKEN = "∅"
"""How a token whose text is empty (a special token decoded to nothing) is shown by ``visible_token``; a map's label
(``token_labels``) names such a token by its piece of the vocabulary and its id instead."""
NO_TEXT = "∅ no text"
"""How ``token_labels`` shows a token with no text and no piece of the vocabulary (an id the tokenizer lacks)."""


# ---- What is shown ------------------------------------------------------------------------------

def visible_token(text: str) -> str:
    """A token's text with its whitespace made visible: a leading or trailing space → "␣" (spaces between words
    stay), newline → "⏎", tab → "⇥", carriage return and other control characters as escapes ("\\r", "\\x07");
    an empty token as "∅"."""
    if not text:
        return EMPTY_TOKEN
    shown = "".join(VISIBLE_WHITESPACE.get(character) or (character if character.isprintable() else
                    character.encode("unicode_escape").decode("ascii")) for character in text)
    core = shown.strip(" ")
    leading = len(shown) - len(shown.lstrip(" "))
    trailing = len(shown) - len(shown.rstrip(" ")) if core else 0
    return VISIBLE_SPACE * leading + core + VISIBLE_SPACE * trailing


def _one_answer(explanation: Explanation) -> None:
    """A ValueError unless ``explanation`` is of one image with one map per answer token (what
    GenerationExplainer.explain returns)."""
    if len(explanation) != 1:
        raise ValueError(f"an answer's tokens are shown for one image; this explanation has {len(explanation)} "
                         "images: pass one of them, e.g. explanation[0].")
    if explanation.map_grid.dim() != 4:
        raise ValueError(f"the maps must be (1, K, H, W); got {tuple(explanation.map_grid.shape)}.")
    count = explanation.map_grid.shape[1]
    if explanation.class_names is not None and len(explanation.class_names) != count:
        raise ValueError(f"the explanation has {count} maps but {len(explanation.class_names)} token texts "
                         "(class_names): one text per answer token is needed.")
    positions = explanation.diagnostics.get("target_positions")
    if isinstance(positions, Tensor) and tuple(positions.shape) != (1, count):
        raise ValueError(f"the explanation has {count} maps but diagnostics['target_positions'] of shape "
                         f"{tuple(positions.shape)}: one answer position per map, (1, {count}), is needed.")


def token_texts(explanation: Explanation) -> list[str]:
    """The K answer tokens' texts (``class_names``; "token k" where the explanation has none)."""
    count = explanation.map_grid.shape[1]
    if explanation.class_names is None:
        return [f"token {k}" for k in range(count)]
    return [str(text) for text in explanation.class_names]


def _target_ids(explanation: Explanation) -> list[list[int]]:
    """Each map's token ids (a span's all): from ``diagnostics["target_tokens"]`` and ``["token_ids"]``, else
    ``["target_token_ids"]``; [] per map where the explanation has neither."""
    count = explanation.map_grid.shape[1]
    covered, ids = explanation.diagnostics.get("target_tokens"), explanation.diagnostics.get("token_ids")
    if isinstance(covered, Tensor) and isinstance(ids, Tensor) and covered.dim() == 3 and ids.dim() == 2 \
            and tuple(covered.shape) == (1, count, ids.shape[1]):
        return [[int(token) for token in ids[0][covered[0, k].to(ids.device)]] for k in range(count)]
    first = explanation.diagnostics.get("target_token_ids")
    if isinstance(first, Tensor) and tuple(first.shape) == (1, count):
        return [[int(token)] for token in first[0]]
    return [[] for _ in range(count)]


def token_names(explanation: Explanation) -> list[tuple[str, str]]:
    """Each map's token as (shown, note): a token with text, (its text with whitespace made visible, "");
    a token with no text (a special token or a space the tokenizer decodes to nothing, a byte that only begins a
    character), (its piece of the vocabulary, ``diagnostics["target_pieces"]``, e.g. "<|im_end|>" or "<0xE7>",
    "id 151645"); one with no piece either (an id the tokenizer lacks), ("∅ no text", "id 151700"). A warning where
    a map's token has no text and the explanation names no piece for it (GenerationExplainer.explain names the
    pieces, and warns itself of ids its tokenizer lacks)."""
    texts = token_texts(explanation)
    pieces = explanation.diagnostics.get("target_pieces")
    named = isinstance(pieces, list) and len(pieces) == len(texts)
    ids = _target_ids(explanation)
    names, unnamed = [], []
    for k, text in enumerate(texts):
        if text:
            names.append((visible_token(text), ""))
            continue
        piece = str(pieces[k]) if named and pieces is not None else ""
        note = f"id{'s' if len(ids[k]) > 1 else ''} {', '.join(str(token) for token in ids[k])}" if ids[k] else ""
        names.append((piece or NO_TEXT, note))
        if not named:
            unnamed.append(k)
    if unnamed:
        which = ", ".join(f"{k} ({names[k][1] or 'id unknown'})" for k in unnamed[:8]) + \
            (", ..." if len(unnamed) > 8 else "")
        warn_at_callers_line(f"{len(unnamed)} map(s) explain a token with no text, and the explanation names no "
                             f"piece of the vocabulary for them (diagnostics['target_pieces']): maps {which} are "
                             f"labelled {NO_TEXT!r}. Explanations of GenerationExplainer.explain name them.",
                             UserWarning)
    return names


def token_labels(explanation: Explanation) -> list[str]:
    """Each map's token as one label (``token_names``): its text with whitespace made visible, or for a token with
    no text its piece and id, "<|im_end|> (id 151645)"."""
    return [f"{shown} ({note})" if note else shown for shown, note in token_names(explanation)]


def token_positions(explanation: Explanation) -> list[int]:
    """Each map's answer position: the index into ``diagnostics["token_ids"]`` of the token map k explains (a
    span's first token), from ``diagnostics["target_positions"]``; 0..K−1 where the explanation has none. Map k is
    not token k where the answer has tokens that are not explained (end of sequence, Idefics3's ``<row_i_col_j>``)."""
    count = explanation.map_grid.shape[1]
    positions = explanation.diagnostics.get("target_positions")
    if not isinstance(positions, Tensor):
        return list(range(count))
    return [int(position) for position in positions.reshape(-1)]


def _diagnostic_text(explanation: Explanation, key: str) -> Optional[str]:
    value = explanation.diagnostics.get(key)
    if isinstance(value, list) and value:
        return str(value[0])
    return None


def answer_text(explanation: Explanation) -> str:
    """The answer: ``diagnostics["answer"]``, else the tokens' texts joined."""
    answer = _diagnostic_text(explanation, "answer")
    return answer if answer is not None else "".join(token_texts(explanation))


def token_probabilities(explanation: Explanation) -> Optional[list[float]]:
    """Each token's probability in [0, 1] (``probabilities``); None where the explanation has none (then its
    ``scores`` are not log-probabilities, e.g. the logits of "attnlrp")."""
    if explanation.probabilities is None:
        return None
    return [float(value) for value in explanation.probabilities[0]]


def display_maps(explanation: Explanation, signed: Optional[bool] = None, cmap: str = "jet") -> tuple[Tensor, str]:
    """The K maps as (K, H, W) float values in [0, 1] to colour, and the colour map to colour them with.

    signed: draw the maps, in [-1, 1], with the diverging colour map ``render.DIVERGING_CMAP`` (0 at the middle,
    value (m + 1) / 2); None: when some map value is negative. Otherwise the maps, in [0, 1], with ``cmap``.
    The maps are those every drawing of the explanation shows (``Explanation.drawn_map_grid``): maps that are not
    normalised (``normalize=None``: raw values of 1e-5 would be drawn as nothing) scaled to their own largest
    |value|, with a warning at the caller's line.
    """
    maps = explanation.drawn_map_grid()[0]
    if signed is None:
        signed = bool((maps < 0).any())
    if signed:
        return (maps.clamp(-1, 1) + 1) / 2, render.DIVERGING_CMAP
    return maps.clamp(0, 1), cmap


# ---- The figure ----------------------------------------------------------------------------------

def _width(character: str) -> int:
    """A character's width in the columns of a Latin letter: 2 for East Asian wide ones (CJK, most emoji)."""
    return 2 if unicodedata.east_asian_width(character) in ("W", "F") else 1


def _shortened(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` columns (``_width``: a CJK character or emoji is two), "…" at the end where cut."""
    if sum(_width(character) for character in text) <= limit:
        return text
    kept, used = [], 1  # the column of "…"
    for character in text:
        used += _width(character)
        if used > limit:
            break
        kept.append(character)
    return "".join(kept) + "…"


def token_figure(
    explanation: Explanation,
    *,
    columns: int = 8,
    alpha: float = 0.5,
    cmap: str = "jet",
    signed: Optional[bool] = None,
    show_image: bool = True,
    panel_size: float = 1.6,
    fontsize: float = 8.0,
    dpi: float = 120.0,
    colorbar: bool = False,
) -> "Figure":
    """A matplotlib Figure of an answer's explanation: the prompt and the answer as text, then a grid of
    ``columns`` panels a row: the image (``show_image``), then each answer token's map over the image, captioned
    with its position in the answer (``token_positions``), its text (whitespace made visible by ``visible_token``)
    and its probability.

    alpha / cmap: the overlay's opacity and colour map (``render.overlay``, blend mode); signed: see
    ``display_maps``. panel_size: a panel's longer side in inches; dpi: the figure's resolution (``savefig`` uses it
    unless given another): a panel of more than panel_size × dpi pixels is scaled down to that. The panels are one
    raster image (one axes, the captions text above each panel), so that 64 tokens draw and save in seconds. A
    notebook cell whose result it is shows it. colorbar: a colour bar beside the panels, in a second axes (the
    signed maps' from -1, against the token, to 1, for it: a blue or red patch over a red object is then read
    right); ``write_token_files`` draws it.
    """
    from matplotlib.figure import Figure

    _one_answer(explanation)
    if columns < 1:
        raise ValueError(f"columns must be at least 1; got {columns}.")
    values, colour_map = display_maps(explanation, signed, cmap)
    image = explanation.images[0]
    room = max(1, round(panel_size * dpi))  # a panel's longer side at the figure's resolution, in pixels
    if max(image.shape[:2]) > room:  # scaled down before drawing, as the figure shows it (faster than matplotlib)
        scale = room / max(image.shape[:2])
        size = (max(1, round(image.shape[1] * scale)), max(1, round(image.shape[0] * scale)))
        smaller = Image.fromarray((image.numpy() * 255).round().astype(np.uint8)).resize(size, Image.Resampling.LANCZOS)
        image = torch.from_numpy(np.array(smaller)) / 255.0
    overlays = render.overlay(image, values, alpha=alpha, cmap=colour_map)  # (K, h, w, 3), maps resized to image
    texts = token_texts(explanation)
    probabilities = token_probabilities(explanation)
    panels: list[tuple[str, np.ndarray]] = []
    if show_image:
        panels.append(("image", (image.numpy() * 255).round().astype(np.uint8)))
    positions = token_positions(explanation)
    for k, ((shown, note), picture) in enumerate(zip(token_names(explanation), overlays)):
        second = [note] if note else []
        second += [f"p = {probabilities[k]:.3f}"] if probabilities is not None else []
        caption = f"{positions[k]}: {_shortened(shown, 16)}" + (f"\n{' · '.join(second)}" if second else "")
        panels.append((caption, picture))
    columns = min(columns, len(panels))
    rows = math.ceil(len(panels) / columns)
    height, width = overlays.shape[1:3]
    inches = panel_size / max(height, width)  # of one panel pixel
    gap = round(0.1 / inches)  # pixels between panels
    band = round(2.6 * fontsize / 72 / inches)  # pixels above each panel for its caption
    mosaic = np.full((rows * (band + height), columns * width + (columns - 1) * gap, 3), 255, np.uint8)
    places = []
    for position, (_, picture) in enumerate(panels):
        row, column = divmod(position, columns)
        top, left = row * (band + height) + band, column * (width + gap)
        mosaic[top:top + height, left:left + width] = picture
        places.append((top, left))
    bar_width = 1.1 if colorbar else 0.0  # inches beside the panels for the colour bar and its label
    figure_width = mosaic.shape[1] * inches + 0.2 + bar_width
    characters = max(20, int(figure_width * 72 / (fontsize * 0.62)))  # a line's room in characters of this size
    lines = [f"{explanation.description()}, {len(texts)} token{'s' if len(texts) != 1 else ''}"]
    prompt = _diagnostic_text(explanation, "prompt")
    if prompt is not None:
        lines += textwrap.wrap(f"Prompt: {prompt}", characters) or ["Prompt:"]
    for number, paragraph in enumerate(answer_text(explanation).split("\n")):
        lines += textwrap.wrap(("Answer: " if number == 0 else "") + paragraph, characters) or [""]
    header = (len(lines) * 1.35 + 0.6) * fontsize / 72
    grid_height = mosaic.shape[0] * inches
    figure_height = header + grid_height + 0.1
    figure = render.shown_in_notebooks(Figure(figsize=(figure_width, figure_height), dpi=dpi))
    figure.text(0.1 / figure_width, 1 - 0.1 / figure_height, "\n".join(lines), fontsize=fontsize, va="top",
                ha="left", parse_math=False, linespacing=1.35)
    axis = figure.add_axes((0.1 / figure_width, 0.05 / figure_height, mosaic.shape[1] * inches / figure_width,
                            grid_height / figure_height))
    axis.imshow(mosaic, interpolation="antialiased", aspect="auto")
    axis.set_axis_off()
    for (caption, _), (top, left) in zip(panels, places):
        axis.text(left + width / 2, top - 0.1 * band, caption, fontsize=fontsize, ha="center", va="bottom",
                  parse_math=False, linespacing=1.2)
    if colorbar:
        import matplotlib
        from matplotlib.colors import Normalize

        signed_maps = signed if signed is not None else bool((explanation.map_grid[0].nan_to_num(0.0) < 0).any())
        left, bottom = (figure_width - bar_width + 0.15) / figure_width, (0.05 + 0.1 * grid_height) / figure_height
        bar_axis = figure.add_axes((left, bottom, 0.12 / figure_width, 0.8 * grid_height / figure_height))
        scalar = matplotlib.cm.ScalarMappable(norm=Normalize(-1 if signed_maps else 0, 1), cmap=colour_map)
        bar = figure.colorbar(scalar, cax=bar_axis)
        bar.set_label("relevance / largest |value|\nred: for the token, blue: against"
                      if signed_maps else "relevance / largest value", fontsize=fontsize)
        bar.ax.tick_params(labelsize=fontsize)
    return figure


# ---- The page -----------------------------------------------------------------------------------

def _encoded(picture: Image.Image, image_format: str, quality: int) -> bytes:
    buffer = io.BytesIO()
    if image_format == "PNG":
        picture.save(buffer, format="PNG")
    else:
        picture.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _data_uri(picture: Image.Image, quality: int, formats: tuple[str, ...] = ("JPEG",)) -> str:
    """``picture`` as a data URI in the smallest of ``formats`` ("PNG": lossless; "JPEG" at ``quality``)."""
    encoded = min(((_encoded(picture, name, quality), name) for name in formats), key=lambda pair: len(pair[0]))
    return f"data:image/{encoded[1].lower()};base64," + base64.b64encode(encoded[0]).decode("ascii")


def _map_pictures(values: Tensor, map_size: int) -> list[Image.Image]:
    """(K, H, W) values in [0, 1] → K grey pictures, long side at most ``map_size`` (area-averaged), each pixel
    the colour-table entry its value takes (``render.colour_indices``: the page colours it with the table)."""
    height, width = values.shape[-2:]
    scale = min(1.0, map_size / max(height, width))
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    small = values if scale == 1.0 else F.interpolate(values[:, None], size=size, mode="area")[:, 0]
    grey = render.colour_indices(small).to(torch.uint8).numpy()
    return [Image.fromarray(picture, mode="L") for picture in grey]


def _json_for_html(value: object) -> str:
    from ..dataset_tools.html_report import _json_for_html as json_for_html

    return json_for_html(value)


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def _inline_text(text: str) -> str:
    """A token's text as the answer shows it: a newline as "⏎" (a line break follows), and every other control
    character but the tab as ``visible_token`` writes it ("\\r", "\\x00"): a browser would read a carriage
    return as a line break of its own and drop a NUL."""
    return "".join("⏎" if character == "\n" else visible_token(character)
                   if unicodedata.category(character) == "Cc" and character != "\t" else character
                   for character in text)


def _token_span(k: int, text: str, name: tuple[str, str], probability: Optional[float]) -> str:
    """One token of the answer as an inline element: its own text, escaped; a newline as "⏎" and a line break;
    a token of whitespace only in its visible form, marked; a token with no text by its piece of the vocabulary
    (``name``, from ``token_names``), marked, its id in its label."""
    whitespace_only = not text.strip()
    inline = name[0] if whitespace_only else _inline_text(text)
    chance = f", probability {probability:.3f}" if probability is not None else ""
    label = f"token {k + 1}: {name[0]}{f' ({name[1]})' if name[1] else ''}{chance}"
    marks = (" ws" if text else " ws notext") if whitespace_only else ""
    span = (f'<span class="token{marks}" role="button" tabindex="{0 if k == 0 else -1}" aria-pressed="false" '
            f'data-k="{k}" aria-label="{escaped(label)}">{escaped(inline)}</span>')
    return span + ("<br>" * text.count("\n"))


def token_html(
    explanation: Explanation,
    *,
    title: Optional[str] = None,
    alpha: float = 0.5,
    cmap: str = "jet",
    signed: Optional[bool] = None,
    map_size: int = 512,
    quality: int = 90,
) -> str:
    """The page of ``write_token_html`` as text."""
    _one_answer(explanation)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha}.")
    if map_size < 8:
        raise ValueError(f"map_size must be at least 8 pixels; got {map_size}.")
    values, colour_map = display_maps(explanation, signed, cmap)
    image = (explanation.images[0].numpy() * 255).round().clip(0, 255).astype(np.uint8)
    height, width = image.shape[:2]
    texts = token_texts(explanation)
    probabilities = token_probabilities(explanation)
    scores = [float(value) for value in explanation.scores[0].detach().float().cpu()]
    positions = token_positions(explanation)
    names = token_names(explanation)
    labels = [f"{shown} ({note})" if note else shown for shown, note in names]
    tokens = [{"shown": labels[k], "position": positions[k],
               "p": None if probabilities is None else round(probabilities[k], 6),
               "score": round(scores[k], 6) if math.isfinite(scores[k]) else None}
              for k, text in enumerate(texts)]
    table = render.colour_table_uint8(colour_map).reshape(-1).tolist()
    data = {"tokens": tokens, "maps": [_data_uri(picture, quality, ("PNG", "JPEG"))
                                     for picture in _map_pictures(values, map_size)],
            "lut": table, "signed": colour_map == render.DIVERGING_CMAP, "alpha": alpha,
            "scoreName": "log-probability" if probabilities is not None else "score"}
    prompt = _diagnostic_text(explanation, "prompt")
    answer_spans = "".join(_token_span(k, text, names[k], None if probabilities is None else probabilities[k])
                           for k, text in enumerate(texts))
    low, high = ("−1", "+1") if data["signed"] else ("0", "1")
    heading = title or f"Explanation of an answer: {explanation.description()}"
    policy = (f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; img-src data:; "
              "base-uri 'none'; form-action 'none'")
    prompt_section = (f'<section class="prompt"><h2>Prompt</h2><p class="text">{escaped(prompt)}</p></section>'
                      if prompt is not None else "")
    subtitle = (f"{explanation.description()} · {len(texts)} answer token{'s' if len(texts) != 1 else ''} · "
                f"{width}×{height} image")
    plain = escaped(answer_text(explanation))
    image_uri = _data_uri(Image.fromarray(image), quality)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<meta name="generator" content="explain vlm">
<title>{escaped(heading)}</title>
<style>{STYLE}</style>
</head>
<body>
<header><h1>{escaped(heading)}</h1>
<div class="subtitle">{escaped(subtitle)}</div></header>
<main>
<div class="words">
{prompt_section}
<section class="answer-section"><h2>Answer</h2>
<p class="hint">Hover, focus or tap a token to see its map over the image; click it (or press Enter) to pin it,
Escape to unpin; ← and → step through the tokens.</p>
<noscript><p class="hint">The maps need JavaScript; tokens.png beside this page shows them all.</p></noscript>
<p class="answer" id="answer" role="group" aria-label="answer tokens">{answer_spans}</p>
<p class="plain"><span class="label">As text:</span> <span id="answer-text">{plain}</span></p>
</section>
</div>
<section class="viewer" aria-label="the image and the map of the token shown">
<figure>
<div class="stage"><img id="image" alt="the image" width="{width}" height="{height}" src="{image_uri}">
<canvas id="overlay" width="{width}" height="{height}" hidden></canvas></div>
<figcaption id="caption" aria-live="polite">The image. Hover a token to see its map.</figcaption>
</figure>
<div class="controls">
<label>Opacity <input type="range" id="opacity" min="0" max="1" step="0.05" value="{alpha}"></label>
<button type="button" id="unpin" disabled>Unpin</button>
<span class="legend"><span>{low}</span><canvas id="colorbar" width="256" height="1"></canvas><span>{high}</span></span>
</div>
</section>
</main>
<script type="application/json" id="token-data">{_json_for_html(data)}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""


def write_token_html(
    explanation: Explanation,
    path: Union[str, Path],
    *,
    title: Optional[str] = None,
    alpha: float = 0.5,
    cmap: str = "jet",
    signed: Optional[bool] = None,
    map_size: int = 512,
    quality: int = 90,
) -> Path:
    """Write one self-contained static HTML page of an answer's explanation (``GenerationExplainer.explain``'s
    Explanation of 1 image × K answer tokens) to ``path``: the prompt, the answer's tokens as text, and the image;
    hovering, focusing with the keyboard (← → step) or tapping a token shows its map over the image, clicking
    it or Enter pins it, Escape unpins; an opacity slider and the colour map's legend.

    The page loads nothing (no server, no network; its Content-Security-Policy allows only its own script and
    style and data: images). Every token text is escaped. alpha: the overlay's opacity at first, in [0, 1];
    cmap / signed: see ``display_maps``; map_size: the longest side, in pixels, at which each map is embedded (an 8-bit
    grey PNG, or a JPEG of ``quality`` where smaller; scaled to the image in the browser); the image is embedded at
    its own size, a JPEG of ``quality``.
    Returns the path.
    """
    from ..dataset_tools.run_folder import write_atomically

    path = Path(path)
    page = token_html(explanation, title=title, alpha=alpha, cmap=cmap, signed=signed, map_size=map_size,
                      quality=quality)
    write_atomically(path, lambda temporary: temporary.write_text(page, encoding="utf-8"))
    return path


def write_token_files(explanation: Explanation, out: Union[str, Path], *, title: Optional[str] = None,
                      alpha: float = 0.5, cmap: str = "jet", columns: int = 8) -> tuple[Path, Path]:
    """Write OUT/tokens.png (``token_figure``, with its colour bar) and OUT/tokens.html (``write_token_html``);
    returns both paths."""
    from ..dataset_tools.run_folder import write_atomically

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figure = token_figure(explanation, columns=columns, alpha=alpha, cmap=cmap, colorbar=True)
    picture = out / "tokens.png"
    write_atomically(picture, lambda temporary: figure.savefig(temporary, format="png"))
    page = write_token_html(explanation, out / "tokens.html", title=title, alpha=alpha, cmap=cmap)
    return picture, page


STYLE = """
:root { color-scheme: light dark; --accent: #2563eb; --muted: #6b7280; --line: #d1d5db; --shown: #fde68a; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 system-ui, sans-serif; }
header { padding: 12px 20px; border-bottom: 1px solid var(--line); }
h1 { font-size: 18px; margin: 0; }
h2 { font-size: 14px; margin: 12px 0 4px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
.subtitle, .hint, .plain .label { color: var(--muted); font-size: 13px; }
main { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 24px; padding: 0 20px 20px; }
@media (max-width: 800px) { main { grid-template-columns: 1fr; } }
.prompt .text, .plain { white-space: pre-wrap; overflow-wrap: anywhere; }
.answer { font-size: 18px; line-height: 2; white-space: pre-wrap; overflow-wrap: anywhere; margin: 8px 0; }
.token { border-bottom: 2px solid var(--line); border-radius: 3px; cursor: pointer; padding: 1px 0; }
.token:nth-child(even) { border-bottom-color: #9ca3af; }
.token.ws { color: var(--muted); }
.token:hover, .token:focus, .token.shown { background: var(--shown); color: #111; outline: none; }
.token:focus-visible { outline: 2px solid var(--accent); outline-offset: 1px; }
.token.pinned { background: var(--accent); color: #fff; }
.viewer { position: sticky; top: 0; align-self: start; padding-top: 12px; }
figure { margin: 0; }
.stage { position: relative; width: min(100%, 640px); line-height: 0; }
.stage img { display: block; width: 100%; height: auto; }
.stage canvas { position: absolute; left: 0; top: 0; width: 100%; height: 100%; }
.stage canvas[hidden] { display: none; }
figcaption { margin-top: 6px; min-height: 3em; white-space: pre-wrap; overflow-wrap: anywhere; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin-top: 6px; font-size: 13px; }
.legend { display: inline-flex; gap: 4px; align-items: center; }
#colorbar { width: 128px; height: 12px; border: 1px solid var(--line); }
"""
"""The page's style (allowed by its hash in the page's Content-Security-Policy)."""

SCRIPT = """
(() => {
  "use strict";
  const data = JSON.parse(document.getElementById("token-data").textContent);
  const image = document.getElementById("image");
  const overlay = document.getElementById("overlay");
  const drawing = overlay.getContext("2d");
  const caption = document.getElementById("caption");
  const opacity = document.getElementById("opacity");
  const unpin = document.getElementById("unpin");
  const tokens = Array.from(document.querySelectorAll("#answer .token"));
  const coloured = new Map();  // token → ImageData of its coloured map at the image's size
  let pinned = -1, hovered = -1, focused = -1, shown = -1;

  function colour(k) {  // the grey map of token k, scaled to the image and coloured through the colour table
    if (coloured.has(k)) return Promise.resolve(coloured.get(k));
    const picture = new Image();
    picture.src = data.maps[k];
    return picture.decode().then(() => {
      const canvas = document.createElement("canvas");
      canvas.width = overlay.width;
      canvas.height = overlay.height;
      const context = canvas.getContext("2d", { willReadFrequently: true });
      context.imageSmoothingEnabled = true;
      context.imageSmoothingQuality = "high";
      context.drawImage(picture, 0, 0, canvas.width, canvas.height);
      const pixels = context.getImageData(0, 0, canvas.width, canvas.height);
      const values = pixels.data;
      for (let i = 0; i < values.length; i += 4) {
        const entry = 3 * values[i];
        values[i] = data.lut[entry];
        values[i + 1] = data.lut[entry + 1];
        values[i + 2] = data.lut[entry + 2];
        values[i + 3] = 255;
      }
      coloured.set(k, pixels);
      return pixels;
    });
  }

  function describe(k) {
    const token = data.tokens[k];
    const parts = [`Token ${k + 1} of ${tokens.length}: ${token.shown}`];
    if (token.p !== null) parts.push(`probability ${token.p.toFixed(3)}`);
    if (token.score !== null) parts.push(`${data.scoreName} ${token.score.toFixed(3)}`);
    return parts.join(" · ") + (k === pinned ? " (pinned)" : "");
  }

  function show(k) {
    shown = k;
    tokens.forEach((token, index) => token.classList.toggle("shown", index === k));
    if (k < 0) {
      overlay.hidden = true;
      caption.textContent = "The image. Hover a token to see its map.";
      document.body.dataset.shown = "-1";
      return;
    }
    caption.textContent = describe(k);
    colour(k).then((pixels) => {
      if (shown !== k) return;  // another token was asked for meanwhile
      drawing.putImageData(pixels, 0, 0);
      overlay.hidden = false;
      document.body.dataset.shown = String(k);
    });
  }

  function update() {  // the hovered token, else the focused one, else the pinned one, else the image alone
    show(hovered >= 0 ? hovered : focused >= 0 ? focused : pinned);
  }

  function pin(k) {
    pinned = pinned === k ? -1 : k;
    tokens.forEach((token, index) => {
      token.classList.toggle("pinned", index === pinned);
      token.setAttribute("aria-pressed", String(index === pinned));
    });
    unpin.disabled = pinned < 0;
    document.body.dataset.pinned = String(pinned);
    if (shown >= 0) caption.textContent = describe(shown);
    update();
  }

  function moveFocus(k) {
    const next = Math.max(0, Math.min(tokens.length - 1, k));
    tokens.forEach((token, index) => token.setAttribute("tabindex", index === next ? "0" : "-1"));
    tokens[next].focus();
  }

  tokens.forEach((token, k) => {
    token.addEventListener("mouseenter", () => { hovered = k; update(); });
    token.addEventListener("mouseleave", () => { hovered = -1; update(); });
    token.addEventListener("focus", () => { focused = k; update(); });
    token.addEventListener("blur", () => { focused = -1; update(); });
    token.addEventListener("click", () => pin(k));
    token.addEventListener("keydown", (event) => {
      const moves = { ArrowRight: k + 1, ArrowDown: k + 1, ArrowLeft: k - 1, ArrowUp: k - 1,
                      Home: 0, End: tokens.length - 1 };
      if (event.key in moves) { moveFocus(moves[event.key]); event.preventDefault(); }
      else if (event.key === "Enter" || event.key === " ") { pin(k); event.preventDefault(); }
    });
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape" && pinned >= 0) pin(pinned); });
  unpin.addEventListener("click", () => { if (pinned >= 0) pin(pinned); });
  opacity.addEventListener("input", () => { overlay.style.opacity = opacity.value; });
  overlay.style.opacity = String(data.alpha);

  const bar = document.getElementById("colorbar");
  const barPixels = bar.getContext("2d").createImageData(256, 1);
  for (let i = 0; i < 256; i += 1) {
    barPixels.data.set([data.lut[3 * i], data.lut[3 * i + 1], data.lut[3 * i + 2], 255], 4 * i);
  }
  bar.getContext("2d").putImageData(barPixels, 0, 0);
  document.body.dataset.shown = "-1";
  document.body.dataset.pinned = "-1";
  document.body.dataset.ready = "true";
})();
"""
"""The page's script (allowed by its hash in the page's Content-Security-Policy): no network, no eval."""
