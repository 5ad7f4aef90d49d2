"""Session 13: the command line fed hostile text and file names. Class names from --class-names with a lone
surrogate (a JSON file's "\\udce9", a byte that is not UTF-8), a newline, a tab or HTML are written as escapes in
the run's files, the report and the printed lines (a terminal that takes no surrogate included), never ending the
run; a --prompt / --answer that is not UTF-8 is refused naming the byte; the report links each dataset image whose
name holds a newline, '#', '?', '%', a space, a byte that is not UTF-8 or a leading '-' to the very file, also when
it is written from another folder than the run."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Optional
from urllib.parse import unquote_to_bytes, urlsplit

import numpy as np
import pytest
from PIL import Image
from test_session12_html_names import Page, data_values
from vlm_tiny import picture, tiny_llava

from explain.cli import main
from explain.data import make_dataset
from explain.vlm.generation import GenerationExplainer

HOSTILE_NAMES = ["a\udce9", "<script>alert(1)</script>", "tab\there", "new\nline\ud800"]
"""Class names of the demo model's 4 classes; as escaped by hand (\\x for a control character and for a byte that
is not UTF-8, \\u for another lone surrogate):"""
ESCAPED_NAMES = ["a\\xe9", "<script>alert(1)</script>", "tab\\x09here", "new\\x0aline\\ud800"]


def demo_images(folder: Path, names: list[str]) -> list[Path]:
    """Demo-data images saved under ``names`` (str file names, bytes that are not UTF-8 as surrogates) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, image in zip(names, make_dataset(len(names), seed=3).images):
        path = folder / name
        Image.fromarray(image).save(path, format="PNG")
        paths.append(path)
    return paths


def run_quietly(arguments: list[str]) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(arguments)


# ---- 1. class names that UTF-8 cannot write, or that hold control characters and HTML ------------------------

def test_class_names_with_a_lone_surrogate_a_newline_and_html_are_escaped_in_the_run_and_its_report(tmp_path,
                                                                                                 monkeypatch):
    """Before, `explain batch --class-names names.json` holding "\\udce9" ended with "'utf-8' codec can't encode
    character" writing run.json. The names are now written escaped: run.json, index.csv, and the report's
    classes (the page holding them as text, no element injected)."""
    monkeypatch.chdir(tmp_path)
    demo_images(tmp_path / "data", [f"{index}.png" for index in range(4)])
    (tmp_path / "names.json").write_text(json.dumps(HOSTILE_NAMES), encoding="utf-8")  # ASCII: "\udce9" escapes
    assert run_quietly(["batch", "data", "--model", "demo", "--class-names", "names.json", "--out", "out",
                        "--no-progress", "--workers", "0"]) == 0
    record = json.loads((tmp_path / "out" / "run.json").read_text(encoding="utf-8"))
    assert record["class_names"] == ESCAPED_NAMES
    with open(tmp_path / "out" / "index.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 4  # one row per image: no name split a row
    assert all(row["class_name"] == ESCAPED_NAMES[int(row["target"])] for row in rows)
    assert run_quietly(["report", "out"]) == 0
    text = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    page = Page(text)
    assert page.tags.count("script") == 2  # the data and report.js: the name's <script> is text
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', text, re.S).group(1))
    assert meta["classes"] == [[index, name] for index, name in enumerate(ESCAPED_NAMES)]


def test_the_image_command_prints_class_names_escaped_on_a_terminal_that_takes_no_surrogate(tmp_path, capsys):
    """pytest's captured stdout is UTF-8 and strict, as a terminal with PYTHONIOENCODING=utf-8 or Windows' is.
    Before, the line printed for each image ended the command ("surrogates not allowed", status 2) after its
    overlay was written, and a tab or newline of a class name split it. Also a --target named by a name with no
    letter that a file name keeps (its digest names the file) ended each image with that error."""
    image = demo_images(tmp_path, ["shape.png"])[0]
    names = tmp_path / "names.json"
    names.write_text(json.dumps(["\udce9", *HOSTILE_NAMES[1:]]), encoding="utf-8")
    out = tmp_path / "out"
    assert main([str(image), "--model", "demo", "--class-names", str(names), "--target", "\udce9", "--out",
                 str(out)]) == 0
    digest = hashlib.sha1("\udce9".encode("utf-8", "surrogatepass")).hexdigest()[:6]
    written = out / f"shape_gradcam_demo_t{digest}.png"
    assert sorted(out.iterdir()) == [written]
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith(f"{image}: \\xe9 (0): ")
    assert printed[0].endswith(f" [GradCAM @ layer4] -> {written}")

    assert main([str(image), "--model", "demo", "--class-names", str(names), "--topk", "4", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1  # the tab and the newline of the names are escapes, the line one line
    assert all(f"{name} ({index}): " in printed[0] for index, name in enumerate(["\\xe9", *ESCAPED_NAMES[1:]]))


# ---- 2. a prompt or answer that is not UTF-8 ---------------------------------------------------------------

def test_a_prompt_or_answer_that_is_not_utf8_is_refused_naming_the_byte_before_the_model_is_loaded(tmp_path, capsys):
    """`explain vlm IMAGE --prompt $'\\xe9'` in a UTF-8 locale: Python reads the byte as "\\udce9". Before, the
    tokenizer refused it with "TextEncodeInput must be Union[TextInputSequence, ...]"."""
    image = demo_images(tmp_path, ["scene.png"])[0]
    for option, text, what, said in [
            ("--prompt", "what color is it \udce9 ?", "prompt", "the byte 0xE9 at character 17"),
            ("--answer", "re\ud800d", "answer", "half a character, U+D800, at character 2")]:
        prompt = text if option == "--prompt" else "what color is it ?"
        extra = ["--answer", text] if option == "--answer" else []
        assert main(["vlm", str(image), "--model", "hf:" + str(tmp_path / "no-model"), "--prompt", prompt, *extra,
                     "--out", str(tmp_path / "out")]) == 2  # the model folder is not read: the text is refused first
        error = capsys.readouterr().err
        assert error == (f"explain: error: the {what} ({option}) {text!r} holds {said}, which is not UTF-8 text (a "
                         "command line, terminal or file in another encoding gives such bytes): write the "
                         f"{what} ({option}) in UTF-8.\n")
    assert not (tmp_path / "out").exists()


def test_the_generation_explainer_refuses_a_prompt_or_answer_that_is_not_utf8():
    model, processor = tiny_llava()
    explainer = GenerationExplainer(model, processor)
    with pytest.raises(ValueError, match=r"^the prompt 'what \\udcff' holds the byte 0xFF at character 5, "):
        explainer.explain(picture(), "what \udcff", answer="red")
    with pytest.raises(ValueError, match=r"^the answer 'a\\udc80' holds the byte 0x80 at character 1, "):
        explainer.explain(picture(), "what", answer="a\udc80")


# ---- 3. the report links each source image by its real name -----------------------------------------------

FILE_NAMES = ["new\nline.png", "a#b.png", "q?x=1.png", "50%.png", "sp ace.png", os.fsdecode(b"caf\xe9.png"),
              "-dash.png", "tab\tx.png"]


def linked_file(page: Path, address: str) -> Optional[Path]:
    """The file a relative address of ``page`` names, percent-decoded to the bytes of its name (as a browser opens a
    file: URL); None for none. Fails on an address with a query or fragment (an unencoded '?' or '#')."""
    if not address:
        return None
    parts = urlsplit(address)
    assert not parts.scheme and not parts.netloc and not parts.query and not parts.fragment, address
    return Path(os.fsdecode(os.path.join(os.fsencode(page.parent), unquote_to_bytes(parts.path))))


@pytest.mark.parametrize("elsewhere", [False, True], ids=["from-the-run's-folder", "from-another-folder"])
def test_the_report_links_every_source_image_to_its_file_whatever_its_name(tmp_path, monkeypatch, elsewhere):
    """Before, the index's display form of a name holding a newline, a tab or a byte that is not UTF-8
    ("new\\x0aline.png", "caf\\xe9.png") named no file, and the report gave those images no source link (nor any
    image, written from another folder than the run's, whose relative path then named no file); a run's folder
    whose name holds a byte that is not UTF-8 ended the run writing run.json ("surrogates not allowed")."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "d\udcff #a ta%"  # the run's folder: a byte that is not UTF-8 (run.json names it), '#', '%'
    sources = demo_images(data, FILE_NAMES)
    assert run_quietly(["batch", data.name, "--model", "demo", "--out", "out", "--overlays", "--no-progress",
                        "--workers", "0"]) == 0
    if elsewhere:
        (tmp_path / "other").mkdir()
        monkeypatch.chdir(tmp_path / "other")
    out = tmp_path / "out"
    assert run_quietly(["report", str(out)]) == 0
    page_path = out / "report.html"
    links = [linked_file(page_path, address) for address in data_values(out, {"source"})]
    assert all(link is not None for link in links) and len(links) == len(sources)
    assert sorted(link.resolve() for link in links if link is not None) == sorted(path.resolve() for path in sources)
    overlays = [linked_file(page_path, address) for address in data_values(out, {"thumb", "overlay"})]
    assert len(overlays) == 2 * len(sources) and all(link is not None and link.is_file() for link in overlays)
    opened = [np.asarray(Image.open(link)) for link in links if link is not None]
    assert all(image.shape == (64, 64, 3) for image in opened)  # each link opens the image itself


def test_the_summary_of_a_batch_run_into_a_folder_with_a_newline_and_a_byte_that_is_not_utf8_is_one_line(
        tmp_path, monkeypatch, capsys):
    """Before, `explain batch DIR --out $'o\\nx\\xfe'` split its summary in two lines, and on a terminal that takes
    no surrogate (pytest's captured stdout) ended with "surrogates not allowed" after the run was done."""
    monkeypatch.chdir(tmp_path)
    demo_images(tmp_path / "data", ["a.png", "b.png"])
    out = "o\nx\udcfe"
    assert run_quietly(["batch", "data", "--model", "demo", "--out", out, "--no-progress", "--workers", "0"]) == 0
    assert (tmp_path / out / "index.csv").is_file()
    assert capsys.readouterr().out == ("2 image(s) explained, 0 already done; results in o\\x0ax\\xfe, index "
                                       "o\\x0ax\\xfe/index.csv\n")


def test_a_class_names_file_that_is_not_utf8_is_refused_naming_its_line(tmp_path):
    """Before, the message gave the byte's offset only."""
    from explain.models import read_class_names

    names = tmp_path / "names.txt"
    names.write_bytes(b"disc\nsquare\ntri\xe9ngle\ncross\n")
    with pytest.raises(ValueError, match=r"not UTF-8 text \(invalid continuation byte at byte 15, line 3\)"):
        read_class_names(names)
