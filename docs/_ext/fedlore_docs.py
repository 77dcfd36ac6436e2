"""fedlore's own Sphinx extension: the reference pages that are generated, never hand-written.

- ``.. fedlore-config:: [SECTION]``: every key of :class:`fedlore.config.Config` (no argument:
  the top-level keys; ``data``, ``dp``, ...: that section) as a ``confval`` entry with its type,
  constraints, default and meaning, read from the pydantic models (a field's attribute docstring
  is its description). A key without a description, or a key no page lists, fails the build.
- ``.. fedlore-method-settings:: NAME``: the ``method.NAME.*`` keys of a registered method, from
  its hyperparameter dataclass (the ``Attributes:`` of its docstrings) and the shared
  :class:`fedlore.settings.LocalTraining` model.
- ``{confval}`key``` (MyST) / ``:confval:`key``` (reST): a link to a key; an unknown key fails
  the build (``nitpicky``).
- ``{result}`path.json#a.b.0|fmt``` : a number quoted from a result file of the tree (JSON, a
  dotted path of keys and list indices, an optional format spec), so that docs never retype a
  measured number. A missing file or key fails the build.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

LOG = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]  # the repository


# ---------------------------------------------------------------- types, constraints, defaults
def describe_type(annotation: Any) -> str:
    """A reader's name for a field type: ``int``, ``float or null``, ``one of: a, b``."""
    if annotation is type(None):
        return "null"
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"``{json.dumps(a)}``" for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in get_args(annotation))
    if origin in (list, tuple):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        inner = describe_type(args[0]) if args else "any"
        if origin is tuple and len(args) > 1 and Ellipsis not in get_args(annotation):
            return f"list of {len(args)} × {inner}"
        return f"list of {inner}"
    if origin is dict:
        return "mapping"
    if origin is typing.Annotated:
        return describe_type(get_args(annotation)[0])
    if annotation is Any:
        return "any"
    return {"str": "text", "bool": "true or false"}.get(
        getattr(annotation, "__name__", ""), getattr(annotation, "__name__", str(annotation))
    )


_BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "length ≥"))


def describe_bounds(metadata: list[Any]) -> str:
    """``> 0, ≤ 1`` from pydantic's annotated-types constraints."""
    out = []
    for item in metadata:
        for attr, sign in _BOUNDS:
            if hasattr(item, attr):
                out.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(out)


def describe_default(value: Any) -> str:
    if dataclasses.is_dataclass(value) or hasattr(value, "model_dump"):
        return "(a section)"
    if isinstance(value, tuple):
        value = list(value)
    return f"``{json.dumps(value)}``"


def _paragraphs(text: str) -> list[str]:
    import inspect

    return inspect.cleandoc(text).splitlines()


# ---------------------------------------------------------------- the configuration reference
def config_sections() -> dict[str, type]:
    """``{"": Config, "data": DataConfig, ..., "dp.audit": DPAuditConfig}`` in the order the
    Config declares them, a section's own sections after it (dotted names)."""
    from pydantic import BaseModel

    from fedlore.config import Config

    out: dict[str, type] = {}

    def add(prefix: str, model: type) -> None:
        out[prefix] = model
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            kind = info.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                add(f"{prefix}.{name}" if prefix else name, kind)

    add("", Config)
    return out


def config_entries(section: str) -> list[tuple[str, str, str, str, str]]:
    """``(key, type, bounds, default, description)`` of every key of one section."""
    from pydantic import BaseModel

    model = config_sections()[section]
    rows = []
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            continue  # a section: its own directive lists it
        key = f"{section}.{name}" if section else name
        default = info.get_default(call_default_factory=True)
        rows.append(
            (
                key,
                describe_type(kind),
                describe_bounds(info.metadata),
                describe_default(default),
                info.description or "",
            )
        )
    return rows


def _confval_lines(key: str, kind: str, bounds: str, default: str, text: str) -> list[str]:
    """One ``confval`` entry: the facts (type, bounds, default) open the first paragraph."""
    facts = f"{kind}" + (f", {bounds}" if bounds else "") + f" · default {default}"
    body = _paragraphs(text) or [""]
    body[0] = f"{facts} — {body[0]}".rstrip(" —")
    lines = [f".. confval:: {key}", ""]
    lines += ["   " + line if line else "" for line in body]
    lines.append("")
    return lines


class ConfigDirective(SphinxDirective):
    """``.. fedlore-config:: [SECTION]``."""

    optional_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        section = self.arguments[0] if self.arguments else ""
        sections = config_sections()
        if section not in sections:
            raise self.error(f"fedlore-config: no section {section!r}; known: {list(sections)}")
        lines: list[str] = []
        for key, kind, bounds, default, text in config_entries(section):
            if not text.strip():
                LOG.warning(
                    "configuration key %s has no description (a docstring under its field)",
                    key,
                    location=self.get_location(),
                )
            listed = self.env.fedlore_config_keys  # type: ignore[attr-defined]
            listed.add(key)
            lines += _confval_lines(key, kind, bounds, default, text)
        return self.parse_text_to_nodes("\n".join(lines))

    def parse_text_to_nodes(self, text: str) -> list[nodes.Node]:  # type: ignore[override]
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(StringList(text.splitlines(), source="fedlore-config"), 0, node)
        return list(node.children)


# ---------------------------------------------------------------- method settings
def _attribute_docs(cls: type) -> dict[str, str]:
    """``{name: description}`` from the ``Attributes:`` sections of ``cls`` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = klass.__dict__.get("__doc__") or ""
        import inspect

        doc = inspect.cleandoc(doc)
        match = re.search(r"^(?:Attributes|Args):\n(.*?)(?:\n\S|\Z)", doc, flags=re.S | re.M)
        if not match:
            continue
        current = None
        for line in match.group(1).splitlines():
            head = re.match(r"^    (\w+)(?: \([^)]*\))?: (.*)$", line)
            if head:
                current = head.group(1)
                out[current] = head.group(2)
            elif current and line.startswith("        "):
                out[current] += " " + line.strip()
            elif line.strip():
                current = None
    return out


def method_entries(name: str) -> list[tuple[str, str, str, str, str]]:
    """``(key, type, bounds, default, description)`` of ``method.NAME.*``."""
    from fedlore import registry
    from fedlore.settings import LocalTraining, config_paths, hyperparameter_names

    cls = registry.get("algorithm", name)
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls)
    own = {f.name: f for f in dataclasses.fields(cls)}
    paths = config_paths(cls)
    rows = []
    for key in hyperparameter_names(cls):
        if key in own:
            field = own[key]
            default = (
                field.default_factory()  # type: ignore[misc]
                if field.default_factory is not dataclasses.MISSING
                else field.default
            )
            kind = describe_type(hints.get(key, Any))
            text = docs.get(key, "")
            source = paths.get(key)
            bounds = ""
        else:
            info = LocalTraining.model_fields[key]
            default = info.get_default(call_default_factory=True)
            kind = describe_type(info.annotation)
            bounds = describe_bounds(info.metadata)
            text = info.description or ""
            extra = info.json_schema_extra
            source = extra.get("config") if isinstance(extra, dict) else None
        if source:
            text = f"{text} Defaults to the run's :confval:`{source}`." if text else ""
            default = "the run's"
        rows.append(
            (
                f"method.{name}.{key}",
                kind,
                bounds,
                default
                if isinstance(default, str) and default == "the run's"
                else describe_default(default),
                text,
            )
        )
    return rows


class MethodSettingsDirective(ConfigDirective):
    """``.. fedlore-method-settings:: NAME``."""

    required_arguments = 1
    optional_arguments = 0

    def run(self) -> list[nodes.Node]:
        from fedlore import registry
        from fedlore.settings import not_applicable

        name = self.arguments[0]
        if name not in registry.names("algorithm"):
            raise self.error(f"fedlore-method-settings: no method {name!r}")
        lines: list[str] = []
        for key, kind, bounds, default, text in method_entries(name):
            if not text.strip():
                LOG.warning(
                    "%s has no description (an Attributes: entry of the method's docstring)",
                    key,
                    location=self.get_location(),
                )
            self.env.fedlore_methods.add(name)  # type: ignore[attr-defined]
            lines += _confval_lines(key, kind, bounds, default, text)
        if not lines:
            lines = ["No settings of its own beyond the shared local-training ones.", ""]
            self.env.fedlore_methods.add(name)  # type: ignore[attr-defined]
        ignored = not_applicable(registry.get("algorithm", name))
        if ignored:
            lines += [
                f"Settings {name} does not read (a ``method.{name}`` override of one is refused):",
                "",
                *(f"* ``{key}``: {why}." for key, why in sorted(ignored.items())),
                "",
            ]
        return self.parse_text_to_nodes("\n".join(lines))


# ---------------------------------------------------------------- numbers from result files
def result_value(spec: str) -> str:
    """The text of ``path.json#a.b.0|fmt`` (see the module docstring)."""
    spec, _, fmt = spec.partition("|")
    path, _, keys = spec.partition("#")
    file = ROOT / path
    if not file.is_file():
        raise ValueError(f"result file {path} does not exist")
    value: Any = json.loads(file.read_text(encoding="utf-8"))
    for key in keys.split(".") if keys else []:
        if isinstance(value, list):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise ValueError(f"{path} has no {keys!r} (stopped at {key!r})")
    return format(value, fmt) if fmt else str(value)


def result_role(
    name: str, rawtext: str, text: str, lineno: int, inliner: Any, options: Any = None,
    content: Any = None,
) -> tuple[list[nodes.Node], list[nodes.system_message]]:  # fmt: skip
    try:
        shown = result_value(text)
    except (ValueError, IndexError, TypeError, json.JSONDecodeError) as e:
        msg = inliner.reporter.error(f"result role: {e}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    return [nodes.Text(shown)], []


# ---------------------------------------------------------------- completeness checks
def _init_env(app: Sphinx) -> None:
    app.env.fedlore_config_keys = set()  # type: ignore[attr-defined]
    app.env.fedlore_methods = set()  # type: ignore[attr-defined]


def _merge(app: Sphinx, env: Any, docnames: Any, other: Any) -> None:
    env.fedlore_config_keys |= other.fedlore_config_keys
    env.fedlore_methods |= other.fedlore_methods


def _purge(app: Sphinx, env: Any, docname: str) -> None:
    pass  # the sets only grow within a build; a fresh build starts them empty


def _check_complete(app: Sphinx, env: Any) -> None:
    from fedlore import registry

    if not getattr(env, "fedlore_config_keys", None):
        return  # a partial build (sphinx -D or a single page)
    every = {row[0] for section in config_sections() for row in config_entries(section)}
    missing = sorted(every - env.fedlore_config_keys)
    if missing:
        LOG.warning("configuration keys on no reference page: %s", ", ".join(missing))
    methods = set(registry.names("algorithm")) - env.fedlore_methods
    if methods:
        LOG.warning("methods whose settings no reference page lists: %s", sorted(methods))


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_object_type(
        "confval",
        "confval",
        objname="configuration key",
        indextemplate="pair: %s; configuration key",
    )
    app.add_directive("fedlore-config", ConfigDirective)
    app.add_directive("fedlore-method-settings", MethodSettingsDirective)
    app.add_role("result", result_role)
    app.connect("builder-inited", _init_env)
    app.connect("env-merge-info", _merge)
    app.connect("env-purge-doc", _purge)
    app.connect("env-check-consistency", _check_complete)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
