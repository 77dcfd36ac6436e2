"""The refusals of upload compression (``compression.*``, ``method.<name>.compression*``): a
kind a method cannot honour, and a setting no method of the run reads (see
:mod:`fedlore.checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fedlore.config import Config, ConfigError
from fedlore.config_federation import CompressionConfig

if TYPE_CHECKING:
    from fedlore.algorithm import Capabilities


class Declares(Protocol):
    """A method class: it holds its :class:`~fedlore.algorithm.Capabilities` record."""

    capabilities: ClassVar[Capabilities]


COMPRESSING = (
    "offer upload compression: only fedfull, fedavg and fedprox encode their dense deltas "
    "(top-k, QSGD) and decode them on the server"
)
"""Why a method without the ``compress_uploads`` capability refuses ``compression``."""

NO_PRIVATE_COMPRESSION = {
    "topk": (
        "each client's top-k indices differ, so the masked or clipped-and-noised sum of the "
        "uploads (values and indices) is not the sum of the sparse deltas"
    ),
    "qsgd": (
        "QSGD's integer codes and per-client norms are not offered under secure aggregation "
        "and DP (no test covers it there)"
    ),
}
"""Why ``compression`` is refused under secure aggregation and DP (``upload_increments``)."""

_DEFAULT = {k: CompressionConfig.model_fields[k].default for k in ("fraction", "levels")}
"""The section's defaults of ``fraction`` and ``levels``: a value other than these was given."""

_CODEC = {"fraction": "topk", "levels": "qsgd"}
"""The codec each of the section's settings belongs to."""


def check_compression(cls: type[Declares], compression: str, upload_increments: bool) -> None:
    """Refuse, when method class ``cls`` is instantiated, a ``compression`` it cannot honour:
    any for a method without the ``compress_uploads`` capability, and any with
    ``upload_increments`` (secure aggregation and DP).

    Raises:
        ValueError: naming the class, the setting and the reason.
    """
    if compression == "none":
        return
    if not cls.capabilities.compress_uploads:
        raise ValueError(
            f"{cls.__name__}: invalid compression={compression!r}: it does not {COMPRESSING}"
        )
    if upload_increments:
        raise ValueError(
            f"{cls.__name__}: invalid compression={compression!r} with upload_increments=True "
            f"(secure aggregation or DP): {NO_PRIVATE_COMPRESSION[compression]}; use "
            "compression=none"
        )


def check_compression_settings(
    name: str, caps: Capabilities, cfg: Config, overrides: dict[str, Any]
) -> None:
    """Refuse, for method ``name`` (its capabilities ``caps``, its ``method.<name>``
    ``overrides``), a compression kind it cannot honour, and a compression setting that would
    change nothing: one given without a kind, or one of the other codec (a top-k fraction
    under QSGD, QSGD's levels under top-k) that no method of the run reads.

    Raises:
        ConfigError: naming the settings and what to do.
    """
    kind = overrides.get("compression", cfg.compression.kind)
    key = f"method.{name}.compression" if "compression" in overrides else "compression.kind"
    if kind != "none" and not caps.compress_uploads:
        raise ConfigError(
            f"{key}={kind}: method {name!r} does not {COMPRESSING}; to compress one method's "
            "uploads set method.<name>.compression for one of those"
        )
    if kind == "none" and caps.compress_uploads:  # a compression that does not run: no kind
        sec = cfg.compression
        idle = {
            f"method.{name}.compression_fraction": overrides.get("compression_fraction"),
            f"method.{name}.compression_levels": overrides.get("compression_levels"),
            f"method.{name}.error_feedback": overrides.get("error_feedback"),
            "compression.fraction": sec.fraction if sec.fraction != _DEFAULT["fraction"] else None,
            "compression.levels": sec.levels if sec.levels != _DEFAULT["levels"] else None,
            "compression.error_feedback": sec.error_feedback,
        }
        given = [f"{k}={v}" for k, v in idle.items() if v is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)}: {key}=none, so method {name!r} uploads dense deltas and "
                "the setting would change nothing; set compression.kind=topk or qsgd (or "
                f"method.{name}.compression), or leave it out"
            )
    if kind in ("topk", "qsgd") and caps.compress_uploads:  # the other codec's setting
        other = next(k for k, codec in _CODEC.items() if codec != kind)
        set_own, value = overrides.get(f"compression_{other}"), getattr(cfg.compression, other)
        given = [f"method.{name}.compression_{other}={set_own}"] if set_own is not None else []
        if value != _DEFAULT[other] and not _section_read(cfg, other):
            given.append(f"compression.{other}={value}")
        if given:
            codec = "QSGD" if kind == "topk" else "top-k"
            raise ConfigError(
                f"{', '.join(given)}: a {codec} setting that no method of the run reads "
                f"({key}={kind} for {name!r}), so it would change nothing; set the kind it "
                f"belongs to (or method.{name}.compression), or leave it out"
            )


def _section_read(cfg: Config, setting: str) -> bool:
    """Whether a method of the run reads ``compression.<setting>`` (``fraction`` or
    ``levels``): its codec (its own ``compression`` or the section's ``kind``) is the one the
    setting belongs to, and it does not set ``compression_<setting>`` itself."""
    owns = [cfg.method.get(name, {}) for name in cfg.algorithms]
    return any(
        own.get("compression", cfg.compression.kind) == _CODEC[setting]
        and f"compression_{setting}" not in own
        for own in owns
    )
