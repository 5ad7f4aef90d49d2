"""Every static page explain writes, fed hostile names: the report of a batch run (explain report OUT), the concept
atlas page and the VLM token page. Class folders, file names and class names with HTML, quotes, '&', '#', '%', '?',
spaces, unicode and a leading '-' stay text (the page parsed with html.parser holds them literally, and no element
more); every src/href to a local file names an existing file once URL-decoded; bytes that are not UTF-8 (a command
line's --title, a JSON file's "\\udce9", a class name) are written as escapes instead of ending the run; a token's
control characters are shown as its label shows them."""

from __future__ import annotations

import json
import re
import warnings
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
import torch
from PIL import Image
from test_report import write_run
from test_vlm_cli import Tokens, hand_made
from torchvision import transforms

import explain
from explain.cli import main
from explain.dataset_tools.concept_atlas import build_atlas
from explain.dataset_tools.html_report import report
from explain.vlm.view import token_html

CLASS_NAMES = ["<script>alert(1)<\\script>", "a\"b'c&d", "h#sh 50%?", "é 中文 😀"]
FILE_NAMES = ["<img src=x onerror=alert(1)>.png", "a#b.png", "50%.png", "q?x=1.png", "sp ace.png", "é中😀.png",
              "-dash.png", "x" * 200 + ".png", "&amp;.png", "it's \"q\".png"]


class Page(HTMLParser):
    """A page's tags, src/href values and text, as a browser's parser reads them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.addresses: list[str] = []
        self.texts: list[str] = []
        self.attributes: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        self.tags.append(tag)
        self.addresses += [value or "" for name, value in attrs if name in ("src", "href")]
        self.attributes += [value or "" for _, value in attrs]

    def handle_data(self, data: str) -> None:
        self.texts.append(data)


def local_file(page: Path, address: str) -> Optional[Path]:
    """The file a relative address of ``page`` names, URL-decoded; None for an in-page link or a data: URI.
    Fails on an address to another site, or one with a query or fragment (an unencoded '?' or '#')."""
    parts = urlsplit(address)
    if address.startswith("#") or parts.scheme == "data":
        return None
    assert not parts.scheme and not parts.netloc and not parts.query and not parts.fragment, address
    return page.parent / unquote(parts.path)


def data_values(out: Path, keys: set[str]) -> list[Any]:
    """Every value under one of ``keys`` in the report's data files (each one call with JSON arguments)."""
    found: list[Any] = []

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                walk(item, name)
        elif isinstance(value, list):
            for item in value:
                walk(item, key)
        elif key in keys:
            found.append(value)

    for path in sorted((out / "report").glob("data-*/*.js")):
        call = re.fullmatch(r"explainReport\.\w+\((.*)\);\n", path.read_text(encoding="utf-8"), re.S)
        assert call is not None, path
        walk(json.loads(f"[{call.group(1)}]"))
    return found


# ---- The report ---------------------------------------------------------------------------------------

def test_the_report_of_hostile_class_folders_and_file_names_links_every_file_and_shows_the_names(tmp_path,
                                                                                                 monkeypatch):
    """explain batch --labels folders over class folders and files with hostile names (class names from a JSON
    file), explain strategies, explain report: the page has only its own elements, the class names are its text,
    and every thumbnail, overlay, source image and mean map address decodes to an existing file (the source
    images to the very files the run read)."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    sources = []
    for index, name in enumerate(CLASS_NAMES):
        (tmp_path / "data" / name).mkdir(parents=True)
        for file_name in (FILE_NAMES * 2)[3 * index: 3 * index + 3]:  # every name, in some folder
            path = tmp_path / "data" / name / file_name
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(path)
            sources.append(path.resolve())
    (tmp_path / "names.json").write_text(json.dumps(CLASS_NAMES), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["batch", "data", "--model", "demo", "--labels", "folders", "--class-names", "names.json",
                     "--out", "out", "--overlays", "--no-progress", "--workers", "0"]) == 0
        assert main(["strategies", "out", "--min-images", "3", "--clusters", "2", "--no-progress"]) == 0
        result = report("out")
    assert result.images == len(sources) == 12
    page_path = tmp_path / "out" / "report.html"
    text = page_path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.tags.count("script") == 2 and "img" not in page.tags  # the data, report.js: nothing injected
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", text) and "http://" not in text and "https://" not in text
    cells = {text.strip() for text in page.texts}
    assert {f"{name}" for name in CLASS_NAMES} <= cells  # the confusion matrix's headers: the names, literally
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', text, re.S).group(1))
    assert meta["classes"] == [[index, name] for index, name in enumerate(CLASS_NAMES)]
    addresses = page.addresses + data_values(tmp_path / "out", {"thumb", "overlay", "source", "meanMap"})
    files = [local_file(page_path, address) for address in addresses if address]
    assert len([file for file in files if file is not None]) > 2 * len(sources)
    assert all(file.is_file() for file in files if file is not None), [a for a, f in zip(addresses, files)
                                                                      if f is not None and not f.is_file()]
    linked_sources = sorted(local_file(page_path, address).resolve()
                            for address in data_values(tmp_path / "out", {"source"}))
    assert linked_sources == sorted(sources)
    assert sorted(set(data_values(tmp_path / "out", {"image"}))) == sorted(
        f"data/{path.parent.name}/{path.name}" for path in sources)


def test_a_title_method_or_strategies_file_with_text_utf8_cannot_write_gives_escapes_not_a_crash(tmp_path):
    """Before, `explain report OUT --title $'\\xff'` (a command line's byte that is not UTF-8, read as a lone
    surrogate) and a strategies.json holding "\\udce9" (valid JSON) ended the report with "'utf-8' codec can't
    encode character". They are now written as \\x / \\u escapes, the rest of the text as it is."""
    out = tmp_path / "out"
    truths = write_run(out, 6)
    strategies = {"method": "gradcam", "classes": [
        {"class": 0, "class_name": "bad \udce9 <u>name</u>", "images": 2, "clusters": [
            {"cluster": 0, "size": 2, "examples": [truths[0].id], "flagged": True, "reason": "r \ud800 &"}]}],
        "skipped": [{"class": 1, "class_name": "c\udcff", "reason": "too few \udcfe"}], "notes": ["note \udcfd"]}
    (out / "strategies.json").write_text(json.dumps(strategies), encoding="utf-8")  # ASCII: "\udce9" escapes
    with pytest.warns(UserWarning, match="leaves things out"):
        result = report(out, title="t\udcff <u>&", method="m\udcff")
    text = result.page.read_text(encoding="utf-8")
    page = Page(text)
    assert page.tags.count("script") == 2 and "u" not in page.tags
    assert "t\\xff <u>&" in page.texts  # the title, and the heading
    assert "strategies: note \\xfd" in page.texts
    assert any("c\\xff (1): too few \\xfe" in text for text in page.texts)
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', text, re.S).group(1))
    assert meta["method"] == "m\\xff"
    assert {"bad \\xe9 <u>name</u>", "c\\xff"} <= set(data_values(out, {"name"}))
    assert "r \\ud800 &" in data_values(out, {"reason"})


# ---- The concept atlas ---------------------------------------------------------------------------------

def tiny_model(predicted: int) -> torch.nn.Module:
    """Two 4-channel convolutions and a head that predicts class ``predicted`` of 3 for every image."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        model[-1].weight.mul_(0.01)
        model[-1].bias.copy_(torch.tensor([0.0, 0.0, 0.0]))
        model[-1].bias[predicted] = 10.0
    return model.eval()


@pytest.mark.parametrize("names, predicted, shown", [
    ([10, 11, 12], 0, "10"),  # before: AttributeError: 'int' object has no attribute 'replace'
    (["a", "<b>\udce9 & \"x\"", "c"], 1, "<b>\\xe9 & \"x\""),  # before: 'utf-8' codec can't encode
], ids=["numbers", "not-utf8"])
def test_the_atlas_page_writes_class_names_that_are_numbers_or_not_utf8_as_text(tmp_path, names, predicted, shown):
    """Class names are whatever the explainer was given (numbers; a "\\udce9" of a JSON file read back): the atlas
    page shows each as text, and its file names with HTML, '#', '%', '?' as the alt text of patches that exist."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name in ("<img src=x onerror=alert(1)>.png", "a#b 50%?.png", "é中😀.png"):
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(data / name)
    model = tiny_model(predicted)
    lrp = explain.LRP(model, class_names=names, composite="epsilon_plus",
                      preprocess=transforms.Compose([transforms.Resize((16, 16)), transforms.ToTensor()]))
    atlas = build_atlas(model, "2", data, tmp_path / "atlas", method=lrp, top=3, batch_size=8, progress=False)
    assert {item["name"] for entry in atlas.entries["concepts"] for item in entry["classes"]} == {str(names[predicted])}
    page_path = tmp_path / "atlas" / "atlas.html"
    text = page_path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.tags.count("img") == 4 * 2 * 3 and "script" not in page.tags
    used = [text for text in page.texts if text.startswith("used most by: ")]
    assert len(used) == 4 and all(re.fullmatch(rf"used most by: {re.escape(shown)} \(\S+\)", text) for text in used)
    assert set(page.attributes) >= {"<img src=x onerror=alert(1)>.png", "a#b 50%?.png", "é中😀.png"}
    assert all(local_file(page_path, address).is_file() for address in page.addresses)
    assert "http:" not in text and "https:" not in text


# ---- The VLM token page --------------------------------------------------------------------------------

def test_a_tokens_control_characters_are_shown_as_its_label_shows_them_and_lone_surrogates_are_escaped():
    """Before, a token "a\\r\\nb" was written with its carriage return, which a browser reads as a line break of
    its own (two lines for one newline), and a NUL, which the browser drops; now the answer shows them as the
    token's label does ("\\r", "\\x00"), a newline still "⏎" and one line break. A title or prompt with a lone
    surrogate ended the page with "'utf-8' codec can't encode character"; now it is an escape."""
    texts = ["a\r\nb", "x\x00y\x07", "\t<i>&</i>", "é中😀"]
    explanation = hand_made(texts)
    explanation.diagnostics["prompt"] = ["what \udcff <b>is</b> it?"]
    text = token_html(explanation, title="t\udcfe & <x>")
    text.encode("utf-8")  # writable
    parsed = Tokens()
    parsed.feed(text)
    assert [token for _, token in parsed.tokens] == ["a\\r⏎b", "x\\x00y\\x07", "\t<i>&</i>", "é中😀"]
    answer = re.search(r'<p class="answer".*?</p>', text, re.S).group(0)
    assert "\r" not in answer and "\x00" not in answer and answer.count("<br>") == 1
    assert [attributes["aria-label"].split(",")[0] for attributes, _ in parsed.tokens] == [
        "token 1: a\\r⏎b", "token 2: x\\x00y\\x07", "token 3: ⇥<i>&</i>", "token 4: é中😀"]
    page = Page(text)
    assert "t\\xfe & <x>" in page.texts and "what \\xff <b>is</b> it?" in page.texts
    assert page.tags.count("script") == 2 and "b" not in page.tags and "x" not in page.tags
