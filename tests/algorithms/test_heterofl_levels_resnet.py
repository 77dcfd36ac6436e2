"""HeteroFL's per-level evaluation (``eval_levels``) on a ResNet under rolling extraction
(FedRolex), checked by hand: each level's sub-model rebuilt here from the global checkpoint and
the last round's windows, its option-A shortcuts routed here (the global model's wiring
restricted to the held channels), its BatchNorms normalizing with the level's stored running
statistics, scored on the central test set against the row's ``levels``."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fedlore.config import Config, load_config
from fedlore.data.federation import build_federation
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

SEED = 1
F64 = torch.float64
RATES = (1.0, 0.5, 0.25)
WIDTH = 4  # stages of 4, 8, 16 channels: the windows wrap and desynchronize within 4 rounds
ROUNDS = 4


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=levels_resnet",
            "num_clients=6",
            f"rounds={ROUNDS}",
            "local_steps=2",
            "batch_size=16",
            "lr=0.1",
            "model.name=resnet20",
            f"model.kwargs={{width: {WIDTH}}}",
            "partition.min_size=10",
            "progress=false",
            "algorithms=[heterofl]",
            "method.heterofl.rates=[1.0, 0.5, 0.25]",
            "method.heterofl.eval_levels=true",
            f"output_dir={out}",
            *extra,
        ],
    )


def _run(cfg: Config) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    assert run_one(cfg, "heterofl", SEED) is not None
    folder = run_dir(cfg, "heterofl", SEED)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    return rows, Checkpointer.load(folder / "checkpoint.pt")[1].arrays


def window(n: int, rate: float, rnd: int) -> torch.Tensor:
    """FedRolex's window of a layer of n channels in round ``rnd``, written out: the
    ``ceil(r n)`` channels from ``rnd mod n`` on, wrapping around (all n, in order, at r = 1)."""
    m = math.ceil(rate * n)
    return torch.arange(n) if m >= n else (rnd + torch.arange(m)) % n


class ByHand:
    """Level ``j``'s sub-model of round ``rnd``, evaluated functionally in float64 from the
    global checkpoint's tensors ``w`` (each sliced by the windows of its dimensions)."""

    def __init__(self, w: dict[str, torch.Tensor], j: int, rnd: int) -> None:
        self.w, self.rate, self.rnd = w, RATES[j], rnd
        self.width = int(w["model.stem.weight"].shape[0])
        self.stats = "model." if RATES[j] == 1.0 else f"levels.{j}."
        self.seen: dict[str, list[torch.Tensor]] | None = None
        """Set: the query's pass (batch statistics; each BatchNorm's inputs kept here)."""

    def u(self, n: int) -> torch.Tensor:
        return window(n, self.rate, self.rnd)

    def conv(self, x: torch.Tensor, name: str, n_out: int, n_in: int, stride: int) -> torch.Tensor:
        k = self.w[f"model.{name}.weight"].to(F64)[self.u(n_out)]
        k = k if name == "stem" else k[:, self.u(n_in)]  # the image's channels are whole
        return F.conv2d(x, k, stride=stride, padding=1)

    def norm(self, z: torch.Tensor, name: str, n: int) -> torch.Tensor:
        """BatchNorm in evaluation: the level's statistics (stored in window order); in the
        query's pass the batch's own (biased variance, as torch normalizes)."""
        if self.seen is not None:
            self.seen.setdefault(name, []).append(z.transpose(0, 1).reshape(z.shape[1], -1))
            mean, var = z.mean((0, 2, 3)), z.var((0, 2, 3), unbiased=False)
        else:
            mean = self.w[f"{self.stats}{name}.running_mean"]
            var = self.w[f"{self.stats}{name}.running_var"]
        gamma = self.w[f"model.{name}.weight"][self.u(n)]
        beta = self.w[f"model.{name}.bias"][self.u(n)]

        def col(t: torch.Tensor) -> torch.Tensor:
            return t.to(F64).view(1, -1, 1, 1)

        return (z - col(mean)) / torch.sqrt(col(var) + 1e-5) * col(gamma) + col(beta)

    def shortcut(self, x: torch.Tensor, n_in: int, n_out: int, stride: int) -> torch.Tensor:
        """Option A restricted to the held channels: put them back at their global places
        (zeros elsewhere), pad as the global model does, keep the output's held channels."""
        full = x.new_zeros(x.shape[0], n_in, *x.shape[2:])
        full[:, self.u(n_in)] = x
        full = full[:, :, ::stride, ::stride]
        lo = (n_out - n_in) // 2
        full = F.pad(full, (0, 0, 0, 0, lo, n_out - n_in - lo))
        return full[:, self.u(n_out)]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.width
        z = torch.relu(self.norm(self.conv(x.to(F64), "stem", w, 1, 1), "stem_norm", w))
        n_in = w
        for b in range(9):
            n, stride = w * 2 ** (b // 3), 2 if b in (3, 6) else 1
            name = f"blocks.{b}"
            h = torch.relu(
                self.norm(self.conv(z, f"{name}.conv1", n, n_in, stride), f"{name}.norm1", n)
            )
            h = self.norm(self.conv(h, f"{name}.conv2", n, n, 1), f"{name}.norm2", n)
            z = torch.relu(h + self.shortcut(z, n_in, n, stride))
            n_in = n
        pooled = z.mean((2, 3))
        head = self.w["model.head.weight"].to(F64)[:, self.u(n_in)]
        return pooled @ head.T + self.w["model.head.bias"].to(F64)


def query_pass(
    hand: ByHand, xs: list[torch.Tensor], batch_size: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per BatchNorm of ``hand``'s sub-model, the mean and unbiased variance of its input when
    each of ``xs`` (a client's training data) passes through it in minibatches of
    ``batch_size`` in order (a last one of one example joined to the one before), every
    BatchNorm normalizing with the minibatch's statistics: the static batch norm query."""
    hand.seen = {}
    for x in xs:
        cuts = list(range(0, len(x), batch_size))
        if len(x) - cuts[-1] == 1 and len(cuts) > 1:
            cuts.pop()
        for a, b in zip(cuts, [*cuts[1:], len(x)], strict=True):
            hand.logits(x[a:b])
    seen, hand.seen = hand.seen, None
    return {k: (torch.cat(v, 1).mean(1), torch.cat(v, 1).var(1)) for k, v in seen.items()}


Run = tuple[Config, list[dict[str, Any]], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def rolling(tmp_path_factory: pytest.TempPathFactory) -> Run:
    cfg = _cfg(tmp_path_factory.mktemp("rolling"), "method.heterofl.extraction=rolling")
    return (cfg, *_run(cfg))


def test_each_resnet_levels_scores_are_its_sub_model_rebuilt_by_hand(rolling: Run) -> None:
    """The last row's ``levels`` of a rolling ResNet-20 run (width 4: in round 3 the half-width
    window of the first stage, channels {3, 0}, feeds the second stage's {3, 4, 5, 6} through
    one shortcut channel of two, the quarter-width one through none): per rate the accuracy and
    loss of the sub-model rebuilt here; rate 1 is the global model's row."""
    cfg, rows, w = rolling
    test = build_federation(cfg, SEED).central_test
    last = rows[-1]
    assert last["levels"]["1.0"]["accuracy"] == last["accuracy"]
    for j, rate in enumerate(RATES):
        logits = ByHand(w, j, ROUNDS - 1).logits(test.x)
        got = last["levels"][str(rate)]
        acc = float((logits.argmax(1) == test.y).double().mean())
        assert got["accuracy"] == pytest.approx(acc, abs=1e-6), rate
        nll = float(F.cross_entropy(logits, test.y))
        assert got["loss"] == pytest.approx(nll, rel=1e-4), rate
        if rate < 1.0:  # the window of the round before scores differently: the check can tell
            before = ByHand(w, j, ROUNDS - 2).logits(test.x)
            assert float(F.cross_entropy(before, test.y)) != pytest.approx(nll, rel=1e-3)


def test_each_resnet_levels_statistics_are_of_the_evaluated_window(rolling: Run) -> None:
    """The running statistics each level is evaluated with (``levels.<j>.*``, in window order)
    are the mean and unbiased variance of its BatchNorms' inputs when the last round's clients
    able to run it pass their training data through the sub-model of that round's window (batch
    statistics, minibatches of 16 in order, a last one of one example joined to the one before),
    rebuilt here; the window of the round before gives other statistics."""
    cfg, rows, w = rolling
    fed = build_federation(cfg, SEED)
    rates = {int(c): r for c, r in rows[-1]["width_rate"].items()}
    for j, rate in enumerate(RATES):
        xs = [fed.client(c).train.x for c, r in sorted(rates.items()) if r >= rate]
        for rnd, same in ((ROUNDS - 1, True), (ROUNDS - 2, False)):
            hand = ByHand(w, j, rnd)
            for name, (mean, var) in query_pass(hand, xs, 16).items():
                close = torch.allclose(
                    w[f"{hand.stats}{name}.running_mean"].to(F64), mean, rtol=1e-4, atol=1e-5
                ) and torch.allclose(
                    w[f"{hand.stats}{name}.running_var"].to(F64), var, rtol=1e-4, atol=1e-5
                )
                assert close == same or (rate == 1.0 and close), (rate, rnd, name)


def _script() -> Any:
    path = Path(__file__).resolve().parents[2] / "scripts" / "heterofl_windows.py"
    spec = importlib.util.spec_from_file_location("heterofl_windows", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _requeried(
    cfg: Config, rows: list[dict[str, Any]], w: dict[str, torch.Tensor], j: int, rnd: int
) -> float:
    """Level j's accuracy (%) in round ``rnd``'s window with statistics re-queried by hand."""
    fed = build_federation(cfg, SEED)
    rates = {int(c): r for c, r in rows[-1]["width_rate"].items()}
    xs = [fed.client(c).train.x for c, r in sorted(rates.items()) if r >= RATES[j]]
    hand = ByHand(dict(w), j, rnd)
    for name, (mean, var) in query_pass(hand, xs, 16).items():
        hand.w[f"{hand.stats}{name}.running_mean"] = mean
        hand.w[f"{hand.stats}{name}.running_var"] = var
    test = fed.central_test
    return 100 * float((hand.logits(test.x).argmax(1) == test.y).double().mean())


def test_the_window_script_scores_each_level_in_another_rounds_window(
    rolling: Run, tmp_path: Path
) -> None:
    """``scripts/heterofl_windows.py`` (the docs' windows of other rounds): in the last round's
    window the row's accuracy; in the round before's, the sub-model rebuilt by hand with its
    statistics re-queried by hand; on a static run, round s's rolling window (the static one
    shifted by s units)."""
    script = _script()
    cfg, rows, w = rolling
    got = script.windows(run_dir(cfg, "heterofl", SEED), [ROUNDS - 1, ROUNDS - 2])
    assert set(got) == {"0.5", "0.25"}
    for j, rate in enumerate(RATES[1:], 1):
        scores = got[str(rate)]
        assert scores["row"] == pytest.approx(100 * rows[-1]["levels"][str(rate)]["accuracy"])
        assert scores[str(ROUNDS - 1)] == pytest.approx(scores["row"], abs=1e-4), rate
        want = _requeried(cfg, rows, w, j, ROUNDS - 2)
        assert scores[str(ROUNDS - 2)] == pytest.approx(want, abs=1e-4), rate
    static = _cfg(tmp_path, "rounds=1")
    rows, w = _run(static)
    got = script.windows(run_dir(static, "heterofl", SEED), [0, 1])
    for j, rate in enumerate(RATES[1:], 1):
        assert got[str(rate)]["0"] == pytest.approx(got[str(rate)]["row"], abs=1e-4), rate
        assert got[str(rate)]["1"] == pytest.approx(_requeried(static, rows, w, j, 1), abs=1e-4)
