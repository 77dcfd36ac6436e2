"""Reading a configuration: YAML files with their ``base`` chain, ``key=value`` overrides, and
validation into a :class:`~fedlore.config_model.Config` with every problem named (import these
from :mod:`fedlore.config`)."""

from __future__ import annotations

import copy
import reprlib
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fedlore.config_model import Config
from fedlore.registry import did_you_mean
from fedlore.settings import STEP_PAIR, loc_path


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field and value."""


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, partner in STEP_PAIR.items():  # a layer that sizes rounds one way replaces the other
        if over.get(k) is not None and partner not in over:
            out.pop(partner, None)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


class EmptyConfigWarning(UserWarning):
    """A config file holds no setting (empty, or comments only): every default runs."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file, resolving its ``base`` chain (a path relative to the file).

    Raises:
        ConfigError: if the file is missing, is not a mapping, or its base chain loops.
    """
    path = Path(path)
    seen: list[Path] = []
    layers: list[dict[str, Any]] = []
    while True:
        path = path.resolve()
        if path in seen:
            raise ConfigError(f"config base chain loops at {path}")
        seen.append(path)
        if path.is_dir():
            raise ConfigError(f"{path} is a folder; give a config file (a .yaml) in it")
        if not path.is_file():
            hint = ""
            if path.suffix not in (".yaml", ".yml"):  # `rounds` for `rounds=5`, say
                hint = f" (a setting is written key=value, e.g. {path.name}=...)"
            named = f" (the base of {seen[-2]})" if len(seen) > 1 else ""
            raise ConfigError(f"config file not found: {path}{named}{hint}")
        try:
            raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
            if raw is None:  # empty, or comments only
                of = f" (the base of {seen[-2]})" if len(seen) > 1 else ""
                warnings.warn(
                    f"{path}{of} holds no settings (a wrong or unsaved file?)"
                    + ("" if of else ": every setting takes its default"),
                    EmptyConfigWarning,
                    stacklevel=2,
                )
                raw = {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}{_yaml_problem(e)}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: not a UTF-8 text file (byte {e.object[e.start]:#04x} at offset "
                f"{e.start}); save it as UTF-8"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
        base = raw.pop("base", None)
        layers.append(raw)
        if base is None:
            break
        path = path.parent / str(base)
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged = _deep_merge(merged, layer)
    return merged


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (the YAML spec forbids
    it; PyYAML keeps the last one silently, so ``rounds: 3`` ... ``rounds: 4`` ran 4 rounds)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    first: dict[Any, int] = {}  # key -> its first entry (an alias key is the same node)
    for index, (key_node, _) in enumerate(node.value):
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` merges a mapping; its keys may be overridden here
        key = loader.construct_object(key_node, deep=True)
        try:
            earlier = first.setdefault(key, index)
        except TypeError:  # an unhashable key: the constructor below reports it
            continue
        if earlier != index:
            prior = node.value[earlier][0]
            # an alias (*k) is its anchor's node, marked where the anchor is: name the mapping
            if key_node is prior or key_node.start_mark.index <= prior.start_mark.index:
                said, mark = "once more through an alias of an anchor", node.start_mark
            else:
                said, mark = f"first on line {prior.start_mark.line + 1}", key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice ({said})", mark
            )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """``, line L, column C: not valid YAML: <problem>`` on one line (PyYAML's own message
    spans several, with a pointer under a copy of the line)."""
    mark = getattr(e, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{where}: not valid YAML: {f'{context}: ' if context else ''}{problem}"


LIST_SHORTHANDS = {"tracking": "backends"}
"""Sections a list (or one name) may stand for, and the key it fills: an override
``tracking=[mlflow]`` sets ``tracking.backends`` and keeps the section's other keys, before or
after ``tracking.mlflow_uri=...``."""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides (dotted keys, YAML-parsed values) to a raw config dict.

    Raises:
        ConfigError: when an override has no ``=``, a key with an empty part (``=3``,
            ``data..root=x``) or descends into a non-mapping.
    """
    out = copy.deepcopy(raw)
    given: set[tuple[str, ...]] = set()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, text = item.partition("=")
        try:
            value = yaml.load(text, Loader=_UniqueKeyLoader) if text != "" else None
        except yaml.YAMLError as e:
            said = " ".join(str(e).split())  # PyYAML's message spans lines
            hint = ""
            if any(c in text for c in "*&!%@`|>"):  # YAML's own marks (an alias, a tag, ...)
                hint = (
                    "; quote text holding YAML's marks inside the value, as in "
                    f"\"{key}=['*']\" (a list) or \"{key}='*.bias'\" (a string)"
                )
            raise ConfigError(
                f"override {item!r}: value is not valid YAML ({said}){hint}"
            ) from None
        node = out
        parts = key.strip().split(".")
        if "" in parts:  # '=3', '.rounds=3', 'data..root=x': the key names nothing
            raise ConfigError(f"override {item!r}: the key {key!r} has an empty part")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if p in LIST_SHORTHANDS and isinstance(nxt, list | str):  # tracking=[...] before
                nxt = node[p] = {LIST_SHORTHANDS[p]: nxt}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        last = parts[-1]
        shorthand = last in LIST_SHORTHANDS and isinstance(value, list | str)
        if shorthand and isinstance(node.get(last), dict):  # the section's other keys stay
            node[last] = {**node[last], LIST_SHORTHANDS[last]: value}
            given.add(tuple(parts))
            continue
        if last in STEP_PAIR and value is not None:  # local_epochs=E replaces local_steps
            partner = (*parts[:-1], STEP_PAIR[last])
            if partner in given:
                raise ConfigError(
                    f"override {item!r}: {'.'.join(partner)} is given too; a round is either "
                    "local_steps or local_epochs, set one"
                )
            node.pop(STEP_PAIR[last], None)
        node[last] = value
        given.add(tuple(parts))
    return out


def effective_overrides(items: Sequence[str]) -> list[str]:
    """``items`` (a command line's words) with every ``key=value`` override that a later one
    replaces left out: one that sets the same key again, or a section holding it (the later
    value replaces the earlier whole, :func:`apply_overrides`), so a printed command names each
    key once, with the value it takes. The order of what stays, and every word that is no
    override (the config file, a flag), are kept. A later :data:`LIST_SHORTHANDS` list
    (``tracking=[mlflow]``) keeps the section's other keys, so only an earlier list of it goes;
    ``local_epochs`` replaces an earlier ``local_steps`` (:data:`~fedlore.settings.STEP_PAIR`)."""
    out: list[str] = []
    for i, item in enumerate(items):
        key, eq, text = item.partition("=")
        if not eq or item.startswith("-"):
            out.append(item)
            continue
        parts = key.strip().split(".")
        if not any(_replaces(later, parts, text) for later in items[i + 1 :]):
            out.append(item)
    return out


def _replaces(later: str, parts: list[str], text: str) -> bool:
    """Whether the override ``later`` replaces one of the key ``parts`` (value ``text``)."""
    key, eq, value = later.partition("=")
    if not eq or later.startswith("-"):
        return False
    over = key.strip().split(".")
    pair = parts[-1] in STEP_PAIR and over == [*parts[:-1], STEP_PAIR[parts[-1]]]
    if pair:  # local_epochs=E replaces local_steps (and the two together are refused)
        return value.strip() not in ("", "null", "~", "None")
    if over != parts[: len(over)]:
        return False
    if over[-1] in LIST_SHORTHANDS and _is_list(value):  # merged into the section: a list goes
        return over == parts and _is_list(text)
    return True


def _is_list(text: str) -> bool:
    """Whether an override's value is a list or one name (a :data:`LIST_SHORTHANDS` form)."""
    try:
        return isinstance(yaml.safe_load(text), list | str)
    except yaml.YAMLError:
        return False


def validate(raw: dict[str, Any]) -> Config:
    """Validate a raw dict into a :class:`Config`.

    Raises:
        ConfigError: listing every bad field as ``dotted.key: problem (got value)``.
    """
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = tuple(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            after = ""
            if err["type"] == "extra_forbidden":
                keys = _keys_at(where[:-1])
                msg = "unknown key" + did_you_mean(where[-1], keys)
                if keys and msg == "unknown key":  # no near miss: what the section admits
                    section = ".".join(where[:-1])
                    after = f"; {section + ' has' if section else 'the keys are'}: "
                    after += ", ".join(sorted(keys))
            if not where:  # a rule over several keys: its message names them
                lines.append(msg)
                continue
            at = loc_path(err["loc"]).removeprefix(".")
            lines.append(f"{at}: {msg} (got {_short(err.get('input'))}){after}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def _short(value: Any) -> str:
    """``repr(value)``, abbreviated where long but still a whole repr (``[1, 2, 3, 4, 5, 6,
    ...]``, ``{'a': 1, ...}``, ``'abc...xyz'``), not one cut mid-way."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 60
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
    return short.repr(value)


def _keys_at(where: tuple[str, ...]) -> list[str]:
    """The keys the config admits in the section at ``where`` (() the top level; [] when
    ``where`` is not a section of fixed keys)."""
    model: Any = Config
    for part in where:
        field = model.model_fields.get(part)
        if field is None:
            return []
        sections = [
            a
            for a in (field.annotation, *typing.get_args(field.annotation))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not sections:
            return []
        model = sections[0]
    return list(model.model_fields)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config. ``path=None`` starts from the defaults."""
    raw = read_yaml(path) if path is not None else {}
    return validate(apply_overrides(raw, overrides or []))
