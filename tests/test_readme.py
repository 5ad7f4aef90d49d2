"""The README, read as a new user reads it: its Python blocks run as written, in order, in one session
(run with the guide pages' in tests/test_docs.py), and every link it makes points to a file of the
repository. The helpers here read and run the code blocks and links of any page."""

from __future__ import annotations

import re
import socket
import warnings
from pathlib import Path
from typing import Any

import matplotlib
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MISSING_REPOSITORY = "github.com/explain-dev"
"""The repository address the pages once linked to; it does not exist: links are relative."""


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file, in page order."""
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


class NetworkUsed(AssertionError):
    """A documentation example tried to reach the network (a download of weights, a hub look-up)."""


_LOCAL_CONNECT = socket.socket.connect


def _no_network(*args: Any, **kwargs: Any) -> None:
    if args and isinstance(args[0], socket.socket) and args[0].family == getattr(socket, "AF_UNIX", None):
        return _LOCAL_CONNECT(*args, **kwargs)  # a socket file on this machine (DataLoader workers pass tensors so)
    raise NetworkUsed("a documentation example tried to use the network; the examples must run offline "
                      "(the shipped demo models, models built from configs with random weights)")


def run_page(page: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run every Python block of ``page`` in page order in one namespace, as a reader would type them
    into one session that starts empty, in the current folder, without network. Each block is compiled
    under the name "PAGE block I", so a failure names it. Warnings that a reader would see for a line of
    the page (the package's own point at the caller's line) are errors: an example must not make a map
    that warns (an empty map, a layer without gradient). Returns the namespace."""
    matplotlib.use("Agg")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for index, block in enumerate(python_blocks(page)):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", module=r"(__main__|explain(\..*)?)$")
            exec(compile(block, f"{page.name} block {index}", "exec"), namespace)
    return namespace


def links(page: Path) -> list[str]:
    """The targets of a page's Markdown links and images, ``[text](target)`` and ``![alt](target)``,
    outside code blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target.split(" ", 1)[0] for target in re.findall(r"\]\(([^)\s]+(?: \"[^\"]*\")?)\)", text)]


def relative_links(page: Path) -> list[str]:
    """A page's links that are not web addresses, mail addresses or anchors of the page itself."""
    return [target for target in links(page) if not re.match(r"^(https?:|mailto:|#)", target)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and MkDocs' toc with its default slugify) gives a Markdown heading."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(page: Path, generated: tuple[str, ...] = (), root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` whose file does not exist in the repository (``root``; ``generated``:
    names made by the site's build), or whose anchor is not a heading of the Markdown file it points to."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        if path in generated:
            continue
        file = (page.parent / path).resolve()
        if not file.is_file() or root.resolve() not in file.parents:
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    return broken


def test_every_relative_link_of_the_readme_points_to_a_file_of_the_repository():
    assert relative_links(README), "the README links to the manual and the benchmarks"
    assert broken_links(README) == []


def test_the_readme_links_to_no_address_of_a_repository_that_does_not_exist():
    assert MISSING_REPOSITORY not in README.read_text(encoding="utf-8")
    assert [target for target in links(README) if target.startswith(("http:", "https:"))] == []


def test_the_link_checker_finds_missing_files_anchors_and_files_outside_the_repository(tmp_path):
    repository = tmp_path / "repository"
    (repository / "docs").mkdir(parents=True)
    (repository / "README.md").write_text("# Title\n\n## The `manual`, read\n", encoding="utf-8")
    (tmp_path / "outside.md").write_text("# Outside\n", encoding="utf-8")
    page = repository / "docs" / "page.md"
    page.write_text("[a](../README.md#the-manual-read) [b](missing.md) [c](../README.md#no-such-heading) "
                    "![d](../../outside.md) `[e](inside-code.md)` [f](https://example.org) [g](#local)\n"
                    "[h](gallery.md)\n"
                    "```python\nx = '[i](in-a-block.md)'\n```\n", encoding="utf-8")
    assert broken_links(page, generated=("gallery.md",), root=repository) == [
        "missing.md", "../README.md#no-such-heading", "../../outside.md"]


def test_the_runner_runs_a_page_in_one_session_in_page_order_offline(tmp_path, monkeypatch):
    """What run_page promises: blocks share one namespace in page order, a block that uses a name no earlier
    block defined fails (as it would for a reader), the network is refused and the package's warnings are errors."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 2\n```\n\ntext\n\n```python\ny = x * 21\n```\n", encoding="utf-8")
    assert run_page(page, monkeypatch)["y"] == 42
    page.write_text("```python\ny = x * 21\n```\n\n```python\nx = 2\n```\n", encoding="utf-8")
    with pytest.raises(NameError, match="'x'"):
        run_page(page, monkeypatch)
    page.write_text("```python\nimport socket\nsocket.create_connection(('127.0.0.1', 9))\n```\n", encoding="utf-8")
    with pytest.raises(NetworkUsed, match="must run offline"):
        run_page(page, monkeypatch)
    page.write_text("```python\nimport socket\nsocket.socket().connect(('127.0.0.1', 9))\n```\n", encoding="utf-8")
    with pytest.raises(NetworkUsed, match="must run offline"):
        run_page(page, monkeypatch)
    page.write_text("```python\nimport torch, explain\n"
                    "head = torch.nn.Linear(2, 3)\n"
                    "torch.nn.init.zeros_(head.weight)   # no gradient reaches the layer\n"
                    "model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 1), torch.nn.AdaptiveAvgPool2d(1), "
                    "torch.nn.Flatten(), head)\n"
                    "explain.GradCAM(model, '0').explain(torch.ones(1, 3, 8, 8), target=0)\n```\n", encoding="utf-8")
    with pytest.raises(RuntimeWarning, match="zero everywhere"):
        run_page(page, monkeypatch)
