"""The ``tracking`` section of :class:`fedlore.config_model.Config`: which experiment trackers
(:mod:`fedlore.tracking`) receive every run's metrics, config and files (import it from
:mod:`fedlore.config`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedlore.settings import StrictModel as _Strict


class TrackingConfig(_Strict):
    """Experiment tracking (:mod:`fedlore.tracking`): each run's per-round metrics as scalars,
    its resolved config as parameters, its files and the experiment's report and plots as
    artifacts, in TensorBoard, MLflow or Weights & Biases (offline only), one tracked run per
    method and seed. ``tracking: [tensorboard, mlflow]`` is short for ``tracking: {backends:
    [tensorboard, mlflow]}``. Each tool is the optional extra ``fedlore[tracking]``, imported
    only when named here. Tracking does not change a run's results: a finished run is kept
    whatever this section says."""

    backends: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)
    """The trackers: ``tensorboard`` (event files in each run folder's ``tensorboard/``),
    ``mlflow`` (one MLflow run per method and seed) and ``wandb`` (an offline W&B run in each
    run folder's ``wandb/``). Empty: no tracking (the default)."""
    experiment: str | None = None
    """The MLflow experiment and W&B project (default: the config's ``name``)."""
    mlflow_uri: str | None = None
    """The MLflow tracking store: a URI such as ``sqlite:///mlflow.db``, ``file:///...`` or
    ``http://host:5000`` (default: ``sqlite:///<output_dir>/<name>/mlflow.db``)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        """A list (or one name) is the list of backends."""
        if isinstance(v, str):
            return {"backends": [v]}
        if isinstance(v, (list, tuple)):
            return {"backends": list(v)}
        return v

    @field_validator("backends")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        twice = sorted({b for b in v if v.count(b) > 1})
        if twice:
            raise ValueError(f"tracker named twice: {', '.join(twice)}")
        return v
