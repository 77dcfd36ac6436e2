"""``eval.metrics``: each built-in metric equals scikit-learn's independent computation, also on
test splits that lack a class (the non-IID client's case); names are checked before a run
starts; the metrics reach the rows, ``summary.json`` and the report; a metric of the user's
own, registered in a module of ``imports``, runs like a built-in one; with ``eval.local`` each
client scores its own model with them and the round pools them weighted by test size."""

from __future__ import annotations

import contextlib
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score, top_k_accuracy_score

from fedlore import registry
from fedlore.cli import main
from fedlore.config import ConfigError, load_config
from fedlore.experiment import run_experiment
from fedlore.results.report import report
from fedlore.train import metrics as M

K = 10


def _predictive(seed: int, n: int = 300, drop: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(3 * torch.randn(n, K, generator=g, dtype=torch.float64), -1)
    y = torch.randint(0, K, (n,), generator=g)
    for c in drop:  # a client's test split without these classes
        y[y == c] = (c + 1) % K
    return log_probs, y


@pytest.mark.parametrize("drop", [(), (3,), (0, 7, 8)])
def test_built_ins_equal_scikit_learn(drop: tuple[int, ...]) -> None:
    log_probs, y = _predictive(len(drop), drop=drop)
    p, t = log_probs.exp().numpy(), y.numpy()
    pred = p.argmax(1)
    assert M.balanced_accuracy(log_probs, y) == pytest.approx(balanced_accuracy_score(t, pred))
    assert M.f1_macro(log_probs, y) == pytest.approx(f1_score(t, pred, average="macro"), abs=1e-6)
    want = top_k_accuracy_score(t, p, k=5, labels=range(K))
    assert M.top5_accuracy(log_probs, y) == pytest.approx(want, abs=1e-6)
    present = sorted(set(t.tolist()))
    ovr = [roc_auc_score(t == c, p[:, c]) for c in present]
    assert M.auroc_macro(log_probs, y) == pytest.approx(float(np.mean(ovr)), abs=1e-6)
    brier = ((p - np.eye(K)[t]) ** 2).sum(1).mean()
    assert M.brier(log_probs, y) == pytest.approx(brier, rel=1e-12)


def test_edge_cases() -> None:
    log_probs, y = _predictive(5)
    perfect = torch.log(torch.nn.functional.one_hot(y, K).double().clamp_min(1e-300))
    assert M.balanced_accuracy(perfect, y) == 1.0
    assert M.brier(perfect, y) == pytest.approx(0.0, abs=1e-12)
    assert M.auroc_macro(log_probs, torch.zeros_like(y)) != M.auroc_macro(
        log_probs, torch.zeros_like(y)
    )  # NaN
    with pytest.raises(ValueError, match="more than 5 classes"):
        M.top5_accuracy(log_probs[:, :5].log_softmax(-1), y % 5)
    diverged = M.extra_metrics(torch.full_like(log_probs, float("nan")), y, ["brier", "f1_macro"])
    assert all(v != v for v in diverged.values())  # NaN, never a score read from NaN


def test_names_are_checked() -> None:
    problems = M.check_names(["balanced_acc", "loss", "Brier", "brier", "brier"])
    text = "\n".join(problems)
    assert "unknown metric 'balanced_acc' (did you mean 'balanced_accuracy'?)" in text
    assert "'loss' is recorded in every evaluation already" in text
    assert "'Brier' cannot name a metric (lower-case" in text and "did you mean 'brier'" in text
    assert "['brier'] named twice" in text
    assert M.check_names(["brier", "f1_macro"]) == []
    # a name fedlore writes itself, or one it would make of the name, is refused
    # n, clients, mse: P-local's local_n, local_clients, local_mse
    for name in (
        "round",
        "train_loss",
        "wall_s",
        "eval_s",
        "accuracy_min",
        "client_accuracy",
        "n",
        "clients",
        "mse",
    ):
        assert "fedlore writes a key of that name" in "".join(M.check_names([name])), name
    for name in ("selection_accuracy", "local_x", "final_y", "diag.rho2", "lr_chosen"):
        assert M.check_names([name]), name


def test_the_reserved_names_cover_the_round_loops_keys() -> None:
    from fedlore.engine.loop import LOOP_KEYS

    uncovered = [
        k for k in LOOP_KEYS if k not in M.RESERVED and not k.startswith(M.RESERVED_PREFIXES)
    ]
    assert not uncovered, f"add to fedlore.train.metrics.RESERVED: {uncovered}"


def test_a_metric_gets_copies_and_must_return_one_real_number() -> None:
    log_probs, y = _predictive(7)
    seen = log_probs.clone()

    def vandal(lp: torch.Tensor, t: torch.Tensor) -> float:
        lp.zero_()
        t.zero_()
        return 0.0

    with _registered("vandal", vandal):
        got = M.classification_metrics(log_probs, y, ["vandal", "balanced_accuracy"])
    assert torch.equal(log_probs, seen)  # the caller's predictive is untouched
    assert got["balanced_accuracy"] == M.balanced_accuracy(seen, y) and got["vandal"] == 0.0
    assert got["accuracy"] == pytest.approx(float((seen.argmax(-1) == y).double().mean()))
    for name, value in (("nothing", None), ("text", "0.5"), ("yes", True), ("many", torch.ones(3))):
        with _registered(name, lambda lp, t, v=value: v), pytest.raises(ValueError) as e:
            M.extra_metrics(log_probs, y, [name])
        assert f"metric {name!r} returned" in str(e.value) and "one real number" in str(e.value)
    boom = pytest.raises(ValueError, match="metric 'boom' failed: ZeroDivisionError")
    with _registered("boom", lambda lp, t: 1 / 0), boom:
        M.extra_metrics(log_probs, y, ["boom"])
    for fine in (0.25, np.float32(0.25), torch.tensor(0.25), np.array([0.25])):
        with _registered("fine", lambda lp, t, v=fine: v):
            assert M.extra_metrics(log_probs, y, ["fine"]) == {"fine": 0.25}


@contextlib.contextmanager
def _registered(name: str, fn: Any) -> Iterator[None]:
    """``fn`` registered as metric ``name`` while the block runs."""
    table = registry._TABLES["metric"]
    registry.register_metric(name)(fn)
    try:
        yield
    finally:
        table.pop(name, None)


def _cfg(out: Path, *extra: str):
    return load_config(
        None,
        [
            "name=metrics",
            "num_clients=3",
            "rounds=2",
            "local_steps=2",
            "batch_size=16",
            "algorithms=[fedavg]",
            "seeds=[0, 1]",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "eval.clients=true",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def test_metrics_reach_rows_summary_and_report(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "eval.metrics=[balanced_accuracy, brier]")
    run_experiment(cfg)
    run = tmp_path / "metrics" / "fedavg" / "seed-0"
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("balanced_accuracy", "brier", "client_balanced_accuracy", "client_brier"):
        assert isinstance(last[key], float), key
    assert 0 <= last["balanced_accuracy"] <= 1 and 0 <= last["brier"] <= 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_metrics"] == ["balanced_accuracy", "brier"]
    assert summary["final_brier"] == last["brier"]
    assert summary["final_client_balanced_accuracy"] == last["client_balanced_accuracy"]
    text = report(tmp_path / "metrics", write=False)
    section = text.split("## Evaluation metrics")[1]
    assert (
        "| method | balanced_accuracy | brier | client_balanced_accuracy | client_brier |"
        in section
    )
    seeds = [json.loads((run.parent / f"seed-{s}" / "summary.json").read_text()) for s in (0, 1)]
    mean = np.mean([s["final_brier"] for s in seeds])
    assert f"{mean:.4f} ± " in section.split("\n")[4]


def test_a_metric_of_ones_own_through_imports(tmp_path: Path) -> None:
    plugin = tmp_path / "my_metrics.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from fedlore.registry import register_metric

            @register_metric("worst_class_recall")
            def worst_class_recall(log_probs, y):
                hits = log_probs.argmax(-1) == y
                return min(float(hits[y == c].float().mean()) for c in y.unique())
            """
        )
    )
    cfg = _cfg(tmp_path, f"imports=[{plugin}]", "eval.metrics=[worst_class_recall]", "seeds=[0]")
    run_experiment(cfg)
    summary = json.loads((tmp_path / "metrics" / "fedavg" / "seed-0" / "summary.json").read_text())
    assert 0 <= summary["final_worst_class_recall"] <= summary["final_accuracy"]


def test_refusals_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="did you mean 'f1_macro'"):
        run_experiment(_cfg(tmp_path, "eval.metrics=[f1_marco]"))
    quickstart = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
    args = ["run", str(quickstart), f"output_dir={tmp_path}", "algorithms=[fedfull]"]
    assert main([*args, "data.name=diabetes", "eval.metrics=[brier]"]) != 0
    assert "eval.metrics ['brier'] score classifiers; 'diabetes' is a regression task" in (
        capsys.readouterr().err
    )
    data = tmp_path.parent / f"{tmp_path.name}-npz"  # three classes
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 300), ("test", 60)):
        x, y = rng.normal(size=(n, 4)).astype("float32"), np.arange(n) % 3
        np.savez(data / f"{split}.npz", x=x, y=y)
    plugin = tmp_path.parent / f"{tmp_path.name}-broken.py"
    plugin.write_text(
        "from fedlore.registry import register_metric\n"
        "register_metric('per_example')(lambda log_probs, y: log_probs.max(-1).values)\n"
    )
    bad = [f"imports=[{plugin}]", "eval.metrics=[per_example]"]
    assert main([*args, *bad]) != 0
    err = capsys.readouterr().err
    assert "metric 'per_example' returned a torch.float32 tensor of shape [64]" in err
    assert "before training" in err and not any(tmp_path.iterdir())
    more = ["data.name=npz", f"data.root={data}", "eval.metrics=[top5_accuracy]"]
    assert main([*args, *more]) != 0
    assert "top5_accuracy needs more than 5 classes; 'npz' has 3" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_metric_named_like_a_methods_own_row_key_stops_the_run(tmp_path: Path) -> None:
    """FedAvg's rows hold ``aggregated``; a metric of that name would replace it: the round
    loop refuses it rather than let one value silently overwrite the other."""
    with _registered("aggregated", lambda lp, t: 0.5), pytest.raises(ValueError) as e:
        run_experiment(_cfg(tmp_path, "eval.metrics=[aggregated]", "seeds=[0]"))
    assert "['aggregated'] have the name of a key the round's row holds already" in str(e.value)


def test_p_local_metrics_are_each_clients_own_weighted_by_test_size(tmp_path: Path) -> None:
    from fedlore.algorithms.base import local_scores
    from fedlore.data.client_data import ClientData, TensorSplit
    from fedlore.engine.loop import client_reports
    from fedlore.types import Reply

    # a client's own score: the metric on its model's predictive over its test split
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(40, 4), torch.tensor([0, 1, 2, 2] * 10)
    empty = TensorSplit(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    data = ClientData(client_id=0, train=empty, test=TensorSplit(x, y))
    out = local_scores(model, data, 0, ("balanced_accuracy", "brier"))
    with torch.no_grad():
        probs = model(x).softmax(-1)
    want = balanced_accuracy_score(y.numpy(), probs.argmax(-1).numpy())
    assert out["local_balanced_accuracy"] == pytest.approx(want)
    onehot = torch.nn.functional.one_hot(y, 3).float()
    assert out["local_brier"] == pytest.approx(float(((probs - onehot) ** 2).sum(-1).mean()))
    assert out["local_n"] == 40 and set(out) >= {"local_accuracy", "local_loss", "local_ece"}

    # the round pools them by local_n, leaving out a client whose value is undefined
    def reply(n: int, **scores: float) -> Reply:
        return Reply(metrics={"num_examples": 9, "local_n": n, "local_accuracy": 0.5, **scores})

    row = client_reports([(0, reply(1, local_brier=0.2)), (1, reply(3, local_brier=0.6))])
    assert row["local_brier"] == pytest.approx((0.2 * 1 + 0.6 * 3) / 4)  # not the plain 0.4
    nan = float("nan")
    undefined = reply(1, local_auroc_macro=nan)  # AUROC on a one-class split
    row = client_reports([(0, undefined), (1, reply(3, local_auroc_macro=0.7))])
    assert row["local_auroc_macro"] == pytest.approx(0.7) and row["local_clients"] == 2
    row = client_reports([(0, undefined), (1, reply(3, local_auroc_macro=nan))])
    assert np.isnan(row["local_auroc_macro"])
    # a method's per-client metric stays per client, never pooled
    row = client_reports([(0, reply(1, local_lr=0.1))], per_client=("local_lr",))
    assert row["local_lr"] == {"0": 0.1}

    # end to end: rows, summary and the report's table
    # (ditto's P-local score is its personal model's, fedfomo's the combined model's)
    cfg = _cfg(
        tmp_path,
        "eval.metrics=[balanced_accuracy]",
        "eval.local=true",
        "seeds=[0]",
        "algorithms=[fedavg, ditto, fedfomo]",
    )
    run_experiment(cfg)
    for method in ("fedavg", "ditto", "fedfomo"):
        run = tmp_path / "metrics" / method / "seed-0"
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        assert 0 <= last["local_balanced_accuracy"] <= 1 and last["local_clients"] == 3, method
        summary = json.loads((run / "summary.json").read_text())
        assert summary["final_local_balanced_accuracy"] == last["local_balanced_accuracy"]
    section = report(tmp_path / "metrics", write=False).split("## Evaluation metrics")[1]
    assert "| local_balanced_accuracy |" in section


def _all_classes(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    """A metric that needs every class in the split (fails on a non-IID client's)."""
    if len(y.unique()) < log_probs.shape[-1]:
        raise ValueError("needs every class")
    return 0.5


def test_p_local_metrics_are_tried_on_every_clients_split_before_the_run(tmp_path: Path) -> None:
    """The central test set holds every class; a Dirichlet(0.05) client's test split does not:
    with eval.local the metric is refused before training, naming the client, not left to
    fail in the last round (where it would cost the client its update)."""
    skewed = ["partition.alpha=0.05", "eval.metrics=[all_classes]", "seeds=[0]"]
    with _registered("all_classes", _all_classes):
        run_experiment(_cfg(tmp_path / "central", *skewed))  # G-central only: it scores
        with pytest.raises(ConfigError) as e:
            run_experiment(_cfg(tmp_path / "local", *skewed, "eval.local=true"))
    text = str(e.value)
    assert "metric 'all_classes' failed: ValueError: needs every class" in text
    assert "on client " in text and "test split (eval.local" in text
    assert not (tmp_path / "local").exists()


def test_a_metric_failing_on_a_clients_model_costs_neither_its_update_nor_the_round() -> None:
    from fedlore.algorithms.base import local_scores
    from fedlore.data.client_data import ClientData, TensorSplit

    def confident_only(log_probs: torch.Tensor, y: torch.Tensor) -> float:
        if float(log_probs.exp().max()) < 0.99:  # fails on this model's predictive
            raise ValueError("not confident")
        return 1.0

    torch.manual_seed(0)
    x, y = torch.randn(30, 4), torch.arange(30) % 3
    empty = TensorSplit(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    data = ClientData(client_id=7, train=empty, test=TensorSplit(x, y))
    with _registered("confident_only", confident_only), pytest.warns(RuntimeWarning) as w:
        out = local_scores(torch.nn.Linear(4, 3), data, 0, ("brier", "confident_only"))
    assert "client 7: P-local eval.metrics not scored" in str(w[0].message)
    assert "'confident_only' failed" in str(w[0].message)
    assert np.isnan(out["local_confident_only"]) and np.isnan(out["local_brier"])
    accuracy = out["local_accuracy"]
    assert isinstance(accuracy, float) and 0 <= accuracy <= 1 and out["local_n"] == 30


def test_a_diverged_clients_model_makes_the_pooled_p_local_metric_nan() -> None:
    from fedlore.engine.loop import client_reports
    from fedlore.types import Reply, Scalars

    def reply(loss: float, brier: float) -> Reply:
        m: Scalars = {"num_examples": 9, "local_n": 5, "local_loss": loss, "local_brier": brier}
        return Reply(metrics=m)

    healthy = reply(0.5, 0.3)
    assert client_reports([(0, healthy), (1, reply(0.7, 0.5))])["local_brier"] == 0.4
    row = client_reports([(0, healthy), (1, reply(float("nan"), 0.9))])
    assert np.isnan(row["local_loss"]) and np.isnan(row["local_brier"])  # not 0.6, not 0.3


def test_no_metric_name_makes_a_report_csv_column_of_its_own() -> None:
    """A metric's CSV columns are final_<name>_mean/_std/_n: a name that would repeat a fixed
    column (final_accuracy_pct_mean: 'accuracy_pct') is reserved."""
    from fedlore.results.tables import COLUMNS

    made = {
        c.removeprefix("final_").rsplit("_", 1)[0]
        for c in COLUMNS
        if c.startswith("final_") and c.rsplit("_", 1)[1] in ("mean", "std", "n")
    }
    assert "accuracy_pct" in made
    free = sorted(n for n in made if n not in M.RESERVED)
    assert not free, f"add to fedlore.train.metrics.RESERVED: {free}"


def test_a_method_section_may_not_set_the_runs_metrics(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"method.fedavg.metrics: set eval.metrics instead"):
        run_experiment(_cfg(tmp_path, "method={fedavg: {metrics: [brier]}}"))


def test_runs_recorded_with_or_without_the_metrics_copy_continue(tmp_path: Path) -> None:
    """eval.metrics is compared at its config path; the copy the clients get is not a method
    setting: a run recorded by fedlore 2026-12-05 (hyper.metrics in config.json) or before it
    (no such key) is the same config."""
    cfg = _cfg(tmp_path, "eval.metrics=[brier]", "eval.local=true", "seeds=[0]")
    run_experiment(cfg)
    run = tmp_path / "metrics" / "fedavg" / "seed-0"
    record = json.loads((run / "config.json").read_text())
    assert "metrics" not in record["hyper"] and record["eval"]["metrics"] == ["brier"]
    summary = (run / "summary.json").read_text()
    for hyper in ({**record["hyper"], "metrics": ["brier"]}, record["hyper"]):
        (run / "config.json").write_text(json.dumps({**record, "hyper": hyper}))
        run_experiment(cfg)  # skipped as finished: a different config would raise
        assert (run / "summary.json").read_text() == summary
