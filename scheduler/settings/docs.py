"""Generate the configuration reference (docs/configuration.md) from the settings tree itself.

Every field's one-line docstring becomes its description, so the reference cannot drift from
the code: a test regenerates it and compares.
"""

from __future__ import annotations

import ast
import inspect
import json
from itertools import pairwise
from typing import Any

from pydantic import BaseModel


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after its annotated assignment in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, BaseModel) or not issubclass(klass, BaseModel):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _rows(model: type[BaseModel], env_prefix: str, toml_prefix: str) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    docs = _attribute_docstrings(model)
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(_rows(annotation, f"{env_prefix}{name.upper()}__", f"{toml_prefix}{name}."))
            continue
        default: Any = field.get_default(call_default_factory=True)
        shown = json.dumps(default, default=str)
        rows.append((f"`{env_prefix}{name.upper()}`", f"`{toml_prefix}{name}`", f"`{shown}`", docs.get(name, "")))
    return rows


def render_reference() -> str:
    """The configuration reference as Markdown."""
    from scheduler.settings import Settings

    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings tree by `undertow config docs`; do not edit by hand.",
        "Environment variables win over `undertow.toml` (keys as in the second column; nested",
        "sections are TOML tables).",
        "",
        "| environment variable | undertow.toml key | default | meaning |",
        "|---|---|---|---|",
    ]
    for env, key, default, doc in _rows(Settings, "UNDERTOW_", ""):
        cells = [env, key, default, doc]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
