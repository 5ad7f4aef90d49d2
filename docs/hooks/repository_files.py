"""MkDocs hook: the guide pages' links to files of the repository outside docs/.

A guide page links to such a file by its relative path (``../benchmarks/RESULTS.md``), which works
where the repository is read as files (a checkout, a Git host). The site serves only what is under
docs/, so this hook copies each linked file into the site under ``repository/`` (a Markdown file
as a page outside the navigation, with the repository files that it links to in turn, such as its
pictures) and points the links there. A link to a file that does not exist is left as written, so
that the strict build reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SITE_FOLDER = "repository"
"""Where the copies go in the site: ``repository/benchmarks/RESULTS.md`` for ``benchmarks/RESULTS.md``."""

LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s#]+)(#[^)\s]*)?((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _outside_fences(markdown: str) -> list[tuple[bool, str]]:
    """The text cut into (is prose, part): links are read in prose only, never in code blocks."""
    parts, start = [], 0
    for fence in FENCE.finditer(markdown):
        parts += [(True, markdown[start:fence.start()]), (False, fence.group())]
        start = fence.end()
    return [*parts, (True, markdown[start:])]


def linked_repository_files(source: Path) -> list[Path]:
    """The files of the repository outside docs/ that a Markdown file links to by a relative path."""
    found = []
    for prose, part in _outside_fences(source.read_text(encoding="utf-8")):
        for match in LINK.finditer(part) if prose else ():
            target = match.group(2)
            if re.match(r"^[a-z]+:", target):
                continue
            file = (source.parent / target).resolve()
            if file.is_file() and ROOT in file.parents and DOCS not in file.parents:
                found.append(file)
    return found


def site_uri(file: Path) -> str:
    """Where a repository file is in the site: docs/ files where MkDocs puts them, others under ``repository/``."""
    if DOCS in file.parents:
        return file.relative_to(DOCS).as_posix()
    return f"{SITE_FOLDER}/{file.relative_to(ROOT).as_posix()}"


def on_files(files: Files, config) -> Files:  # noqa: ANN001 - MkDocs' hook signature
    pending = [linked for page in sorted(DOCS.glob("*.md")) for linked in linked_repository_files(page)]
    copied: set[Path] = set()
    while pending:
        file = pending.pop()
        if file in copied:
            continue
        copied.add(file)
        copy = File.generated(config, site_uri(file), abs_src_path=str(file), inclusion=InclusionLevel.NOT_IN_NAV)
        files.append(copy)
        if file.suffix == ".md":
            pending += linked_repository_files(file)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - MkDocs' hook signature
    """Links that leave docs/ (from a guide page, or from a copied page) point to the site's copies."""
    if page.file.abs_src_path is None:  # a page made by a hook from text (the gallery)
        return markdown
    source = Path(page.file.abs_src_path).resolve()
    here = posixpath.dirname(page.file.src_uri)

    def retarget(match: re.Match[str]) -> str:
        opening, target, anchor, closing = match.group(1), match.group(2), match.group(3) or "", match.group(4)
        file = (source.parent / target).resolve()
        if re.match(r"^[a-z]+:", target) or not file.is_file() or ROOT not in file.parents:
            return match.group()
        if DOCS in source.parents and DOCS in file.parents:
            return match.group()  # between guide pages: MkDocs resolves it
        return f"{opening}{posixpath.relpath(site_uri(file), here or '.')}{anchor}{closing}"

    return "".join(LINK.sub(retarget, part) if prose else part for prose, part in _outside_fences(markdown))
