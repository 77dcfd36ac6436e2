"""Experiment tracking: every run's per-round metrics, its resolved config and its files sent to
TensorBoard, MLflow or Weights & Biases (offline only), beside fedlore's own files.

fedlore's own record stays ``metrics.jsonl``, ``config.json`` and ``summary.json`` in each run
folder (:doc:`/reference/outputs`); a tracker is a view of that record in a tool researchers
already use, switched on with ``tracking: [tensorboard, mlflow, wandb]``
(:class:`fedlore.config.TrackingConfig`). Each tool is an optional extra
(``pip install 'fedlore[tracking]'``) imported only when a config names it.

One tracked run per method and seed, named ``<method>/seed-<seed>`` and grouped under the
experiment's ``name``:

* ``tensorboard``: event files in ``<run folder>/tensorboard/`` (scalars per round, the config as
  hyperparameters and text, the summary as text); ``tensorboard --logdir <output_dir>/<name>``
  shows every method and seed. The report's table and plots go to ``<name>/tensorboard-report/``.
* ``mlflow``: a run in the MLflow experiment ``<name>`` (per-round metrics with the round as
  step, the flattened config as parameters, ``config.json``, ``metrics.jsonl`` and
  ``summary.json`` as artifacts); the report and plots go to a run named ``report``. The store
  defaults to ``sqlite:///<output_dir>/<name>/mlflow.db`` with artifacts in
  ``<output_dir>/<name>/mlartifacts/``.
* ``wandb``: an offline W&B run in ``<run folder>/wandb/`` (``wandb sync`` uploads it later
  from a machine that may reach the network): the metrics with ``round`` as the step metric, the
  config, the summary, the run's files as an artifact; the report in ``<name>/wandb/``.

A resumed run's tracked record is made again from the rows of ``metrics.jsonl`` that survive the
resume (:func:`fedlore.engine.runstart.resume_point` drops the rows after the checkpoint), so a
killed and resumed run's record equals an uninterrupted one's, with no round logged twice; an
MLflow run left unfinished by the kill is deleted (MLflow's soft delete: ``mlflow runs restore``
brings it back) and so is the run a replacement takes the place of.
"""

from fedlore.tracking.base import (
    BACKENDS,
    Tracking,
    open_tracking,
    track_finished,
    track_report,
    tracking_problems,
)

__all__ = [
    "BACKENDS",
    "Tracking",
    "open_tracking",
    "track_finished",
    "track_report",
    "tracking_problems",
]
