"""Griffe extension for the API pages: docstrings as the package writes them, rendered readably.

The package's docstrings describe parameters and attributes as ``name: meaning`` lines (continued
by indented lines), which Markdown would join into one paragraph. Each run of such lines becomes a
Markdown list, one item per name, with the name as code. Attributes for which inspection finds only
the docstring of their value's type (``str(object='') -> str`` for ``name = "gradcam"``) get the
docstring written under them in the source (or under the same attribute of a base class), else
none where the type is a builtin one.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from typing import Any, Optional

import griffe

# "steps: ...", "forward_args, forward_kwargs: ...", "``Explanation.diagnostics``: ..." at column 0
_NAME = r"(?:[a-z_][a-z0-9_]*|``[^`]+``)"
PARAMETER_LINE = re.compile(rf"^(?P<names>{_NAME}(?:, {_NAME})*): (?P<meaning>\S.*)$")


def _as_code(names: str) -> str:
    return ", ".join(name if name.startswith("``") else f"``{name}``" for name in names.split(", "))


def parameter_lists(docstring: str) -> str:
    """The docstring with every run of ``name: meaning`` lines as a Markdown list (the summary line
    and indented code blocks are left alone)."""
    lines = docstring.splitlines()
    result: list[str] = []
    in_list = False
    for index, line in enumerate(lines):
        match = PARAMETER_LINE.match(line) if index > 0 else None
        if match:
            if not in_list and result and result[-1].strip():
                result.append("")  # a Markdown list needs a blank line before it
            result.append(f"- {_as_code(match['names'])}: {match['meaning']}")
            in_list = True
        elif in_list and line.strip():
            result.append("    " + line.strip())  # a continuation line of the item
        else:
            in_list = False  # a blank line ends the list
            result.append(line)
    return "\n".join(result)


@functools.lru_cache(maxsize=None)
def source_docstrings(owner: object) -> dict[str, str]:
    """The docstrings written under the attributes of a class or module's source
    (``name = value`` followed by a string), which inspection cannot see."""
    try:
        tree = ast.parse(inspect.getsource(owner))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError, IndentationError):
        return {}
    body = tree.body[0].body if inspect.isclass(owner) and isinstance(tree.body[0], ast.ClassDef) else tree.body
    found: dict[str, str] = {}
    for statement, following in zip(body, body[1:]):
        targets = ([statement.target] if isinstance(statement, ast.AnnAssign)
                   else statement.targets if isinstance(statement, ast.Assign) else [])
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = inspect.cleandoc(following.value.value)
    return found


def written_docstring(owner: object, name: str) -> Optional[str]:
    """The docstring written under attribute ``name`` in ``owner``'s source, or in its nearest base class's."""
    for source in inspect.getmro(owner) if inspect.isclass(owner) else (owner,):
        docstring = source_docstrings(source).get(name)
        if docstring is not None:
            return docstring
    return None


class ReadableDocstrings(griffe.Extension):
    """``name: meaning`` lines as lists; attributes' docstrings from the source, not from their value's type."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = parameter_lists(obj.docstring.value)

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is None or not hasattr(node, "obj"):
            return
        value = node.obj
        if inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value):
            return
        type_docstring = (inspect.getdoc(type(value)) or "").strip()
        if attr.docstring.value.strip() in (type_docstring, parameter_lists(type_docstring)):
            owner = getattr(getattr(node, "parent", None), "obj", None)
            written = written_docstring(owner, attr.name) if owner is not None else None
            if written is not None:
                attr.docstring.value = written
            elif type(value).__module__ == "builtins":  # shown with its value (``name = 'gradcam'``) and no text
                attr.docstring.value = " "
            # else the docstring of the package's own type (``REGISTRY``: a ``MethodRegistry``) says what it is
