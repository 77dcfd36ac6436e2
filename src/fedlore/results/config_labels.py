"""The row labels :func:`fedlore.results.store.split_by_config` gives the config groups of one
method: ``method [key=value, ...]``, named by the settings that differ, and never one label for
two groups (a shared label would keep one group's runs and silently drop the other's)."""

from __future__ import annotations

import json
from typing import Any

SHOWN = 4
"""How many differing settings a label names before it ends with ``...`` (while that keeps the
labels of one method's groups apart)."""


def differing(configs: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> set[str]:
    """The keys (outside ``skip``) whose values are not the same in all of ``configs``."""
    keys = {k for c in configs for k in c if k not in skip}
    return {k for k in keys if len({_text(c.get(k)) for c in configs}) > 1}


def _text(value: Any) -> str:
    """``value`` as JSON, keys sorted: equal settings give equal text."""
    return json.dumps(value, default=str, sort_keys=True)


def _label(method: str, cfg: dict[str, Any], keys: list[str], more: bool, exact: bool) -> str:
    def text(v: Any) -> str:
        return _text(v) if exact else str(v)

    shown = ", ".join(f"{k}={text(cfg.get(k))}" for k in keys)
    return f"{method} [{shown}{', ...' if more else ''}]"


def group_labels(
    method: str, configs: dict[str, dict[str, Any] | None], across: set[str]
) -> dict[str, str]:
    """The label of each of ``method``'s config groups (``configs``: group key -> its settings,
    None when unreadable): named by the settings that differ between its groups and by
    ``across`` (those that differ between methods), in sorted order; of more than
    :data:`SHOWN`, those that tell its own groups apart come first. When the first
    :data:`SHOWN` leave two groups one label, all are named (their values as JSON as a last
    resort), so no two groups share one."""
    known = [c for c in configs.values() if c is not None]
    own = differing(known)
    differ = sorted(own | across)
    picked = sorted(own)[:SHOWN]
    picked = sorted(picked + [k for k in differ if k not in own][: SHOWN - len(picked)])
    out: dict[str, str] = {}
    for keys, exact in ((picked, False), (differ, False), (differ, True)):
        more = len(keys) < len(differ)
        out = {
            key: f"{method} [config unknown]"
            if cfg is None
            else (_label(method, cfg, keys, more, exact) if differ else method)
            for key, cfg in configs.items()
        }
        if len(set(out.values())) == len(out):
            break
    return out
