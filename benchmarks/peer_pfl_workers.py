"""The two worker processes of ``benchmarks/peer_pfl.py`` (fedlore's and pfl's run of one task)
and the settings they share with the driver; see that script's docstring for the method."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only the standard library at module level: a worker chooses its own import order (see Threads).
if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "experiments" / "quickstart.yaml"
SEED = 42
FRAMEWORKS = ("fedlore", "pfl")
EVAL_BATCH = 512
INSTALL = (
    "pfl (Apple's pfl-research 0.6.0) is not installed: pip install -e '.[peer]' && "
    "pip install --no-deps pfl==0.6.0   (its dp-accounting<0.6 pin clashes with fedlore's "
    "dp-accounting==0.6.0, with which it runs)"
)


@dataclass(frozen=True)
class Task:
    """One benchmark configuration: config overrides of the quickstart, rounds, SGD lr."""

    title: str
    overrides: tuple[str, ...]
    rounds: int
    sgd_lr: float


TASKS = {
    "digits": Task("sklearn digits, MLP", (), 30, 0.1),
    "fmnist": Task(
        "Fashion-MNIST, CNN",
        ("data.name=fashion_mnist", "model.name=cnn", "partition.name=iid"),
        10,
        0.05,
    ),
}
ADAMW_LR = 3e-3
"""``--method fedfull``: the quickstart's AdamW lr."""


def task_config(task: str, method: str, rounds: int, lr: float, out: Path) -> Any:
    """The fedlore config both workers build their federation, model and method from."""
    from fedlore.config import load_config

    return load_config(
        BASE_CONFIG,
        [
            *TASKS[task].overrides,
            f"algorithms={method}",
            f"lr={lr}",
            f"rounds={rounds}",
            f"eval.every={rounds}",  # the central test set once, after the last round
            "checkpoint=false",
            "progress=false",
            "device=cpu",
            f"output_dir={out}",
        ],
    )


def digest(tensors: dict[str, Any]) -> str:
    """sha256 of named tensors (names sorted; dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


class BatchLog:
    """Digests every minibatch a client consumes, per (round, client), by wrapping
    ``ClientData.batches`` (both workers alike, so the cost is the same on both sides)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], list[Any]] = {}

    def install(self) -> None:
        from fedlore.data.client_data import ClientData

        original = ClientData.batches
        seen = self.seen

        def batches(
            self: ClientData, batch_size: int, num_batches: int, rng: torch.Generator, rnd: int
        ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            entry = seen[(int(rnd), self.client_id)] = [0, hashlib.sha256()]
            for x, y in original(self, batch_size, num_batches, rng, rnd):
                entry[1].update(x.detach().cpu().contiguous().numpy().tobytes())
                entry[1].update(y.detach().cpu().contiguous().numpy().tobytes())
                entry[0] += 1
                yield x, y

        ClientData.batches = batches  # type: ignore[method-assign]

    def summary(self) -> tuple[str, int]:
        """(one digest of all rounds and clients, number of batches consumed)."""
        h = hashlib.sha256()
        for (rnd, cid), (n, d) in sorted(self.seen.items()):
            h.update(f"{rnd},{cid},{n},{d.hexdigest()};".encode())
        return h.hexdigest(), sum(n for n, _ in self.seen.values())


@dataclass
class Clock:
    """Wall and process CPU seconds from the end of one round to the end of the next, less the
    time spent in :meth:`exclude`-d work (fedlore's final central evaluation)."""

    rounds: list[dict[str, float]] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    last: tuple[float, float] | None = None
    skip_wall: float = 0.0
    skip_cpu: float = 0.0

    def exclude(self, wall: float, cpu: float) -> None:
        self.skip_wall += wall
        self.skip_cpu += cpu

    def tick(self, threads: int) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.last is not None:
            self.rounds.append(
                {
                    "wall_s": now[0] - self.last[0] - self.skip_wall,
                    "cpu_s": now[1] - self.last[1] - self.skip_cpu,
                }
            )
        self.last, self.skip_wall, self.skip_cpu = now, 0.0, 0.0
        self.threads.append(threads)

    def report(self) -> dict[str, Any]:
        timed = self.rounds  # rounds 1 .. R-1 (round 0 has no start mark: the warm-up)
        wall = sum(r["wall_s"] for r in timed)
        nan = float("nan")
        return {
            "s_per_round": statistics.median(r["wall_s"] for r in timed) if timed else nan,
            "cpu_s_per_round": statistics.median(r["cpu_s"] for r in timed) if timed else nan,
            "cpu_per_wall": sum(r["cpu_s"] for r in timed) / wall if wall > 0 else float("nan"),
            "threads": sorted(set(self.threads)),
            "timed_rounds": len(timed),
            "rounds": timed,
        }


def predict(model: Any, x: Any) -> Any:
    """Predicted classes of ``x`` (eval mode, chunks of :data:`EVAL_BATCH`)."""
    import torch

    model.eval()
    with torch.no_grad():
        return torch.cat(
            [model(x[i : i + EVAL_BATCH]).argmax(-1) for i in range(0, len(x), EVAL_BATCH)]
        )


def fedlore_worker(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """One fedlore run (``run_one``, as ``fedlore run``): (result, final weights and test
    predictions)."""
    import fedlore  # first, as in `fedlore run`: its OMP_WAIT_POLICY default reaches torch

    wait_policy = os.environ.get("OMP_WAIT_POLICY")  # (a statement: keeps fedlore first)
    import torch

    import fedlore.experiment as experiment_mod
    import fedlore.experiment_parts as parts_mod
    from fedlore.data.federation import build_federation
    from fedlore.tensors import load_model_arrays, select

    cfg = task_config(a.task, a.method, a.rounds, a.lr, a.workdir / "runs")
    log = BatchLog()
    log.install()
    clock = Clock()
    original_evaluate = parts_mod.evaluate  # looked up there by the run's evaluator

    def timed_evaluate(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original_evaluate(*args, **kwargs)
        finally:
            clock.exclude(time.perf_counter() - wall, time.process_time() - cpu)

    parts_mod.evaluate = timed_evaluate
    original_factory = experiment_mod.model_factory  # looked up there by build()
    init: list[str] = []  # the digest of the first model run_one builds: the server's W^0

    def digesting_factory(*args: Any, **kwargs: Any) -> Any:
        build = original_factory(*args, **kwargs)

        def built() -> Any:
            model = build()
            if not init:
                init.append(digest(dict(model.named_parameters())))
            return model

        return built

    experiment_mod.model_factory = digesting_factory
    final: dict[str, Any] = {}

    class Recorder:
        def on_round_end(self, rnd: int, row: dict[str, Any], state: Any) -> None:
            clock.tick(torch.get_num_threads())
            if rnd == cfg.rounds - 1:
                model = select(state.arrays, "model.")
                final.update({k: v.detach().cpu().clone() for k, v in model.items()})

    summary = experiment_mod.run_one(cfg, a.method, SEED, extra_callbacks=(Recorder(),))
    assert summary is not None
    fed = build_federation(cfg, SEED)  # again (deterministic): the central test set
    model = original_factory(cfg, fed, SEED)()
    load_model_arrays(model, final)
    preds = predict(model, fed.central_test.x)
    batches, count = log.summary()
    result = {
        **clock.report(),
        "accuracy": float(summary["final_accuracy"]),
        "n_test": len(fed.central_test),
        "init_digest": init[0],
        "batch_digest": batches,
        "batches": count,
        "buffers": [k for k, _ in model.named_buffers()],
        "omp_wait_policy": wait_policy,
        "fedlore_version": fedlore.__version__,
    }
    return result, {"weights": final, "predictions": preds.cpu()}


def pfl_worker(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """One pfl run: FederatedAveraging on the SimulatedBackend over fedlore's clients and
    batches. (result, final weights and test predictions)."""
    import dataclasses
    import functools

    import torch  # before fedlore: pfl gets torch's own defaults
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, StringMetricName, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.postprocessor.base import Postprocessor
    from pfl.stats import MappedVectorStatistics

    default_threads = torch.get_num_threads()
    wait_policy = os.environ.get("OMP_WAIT_POLICY")  # what pfl's OpenMP runtime read

    from fedlore.algorithms.fedavg import FedFull
    from fedlore.data.federation import build_federation
    from fedlore.experiment_parts import make_algorithm, model_factory
    from fedlore.seeding import CLIENT, generator

    cfg = task_config(a.task, a.method, a.rounds, a.lr, a.workdir / "runs")
    algo = make_algorithm(a.method, cfg)  # fedlore's settings, the one source for both sides
    assert isinstance(algo, FedFull)  # --method fedavg or fedfull
    train = algo.train
    if (
        algo.train.schedule != "constant"
        or algo.train.weighting != "num_examples"
        or algo.train.freeze
    ):
        raise SystemExit(f"peer_pfl: unsupported fedlore settings for a pfl twin: {algo}")
    if train.local_steps is None:
        raise SystemExit(
            "peer_pfl: the pfl twin replays K = local_steps minibatches per client and round; "
            f"this config sets local_epochs={train.local_epochs} instead: give local_steps"
        )
    local_steps: int = train.local_steps  # narrowed for RoundBatches.iter below
    fed = build_federation(cfg, SEED).to(torch.device("cpu"))
    log = BatchLog()
    log.install()
    clock = Clock()

    class Net(torch.nn.Module):
        """fedlore's model with the ``loss`` and ``metrics`` pfl's PyTorchModel calls."""

        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.train()
            return F.cross_entropy(self(x), y)  # fedlore's task_loss for class targets

        @torch.no_grad()
        def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            self.eval()
            logits = self(x)
            n = len(y)
            return {
                "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(-1) == y).sum()), n),
            }

    class RoundBatches(Dataset):
        """User c's data in round t; training reads fedlore's K minibatches of (t, c)."""

        def __init__(self, cid: int, rnd: int) -> None:
            self.client, self.rnd = fed.client(cid), rnd
            super().__init__(raw_data=(self.client.train.x, self.client.train.y), user_id=cid)

        def iter(self, batch_size: int | None) -> Any:
            if batch_size != train.batch_size:  # pfl scoring the user (not done here)
                yield from super().iter(batch_size)
                return
            rng = generator(SEED, CLIENT, self.rnd, self.client.client_id)
            yield from self.client.batches(train.batch_size, local_steps, rng, self.rnd)

    made = [0] * fed.num_clients  # datasets made per user: the round of the next one

    def make_dataset(cid: int) -> RoundBatches:
        made[cid] += 1
        return RoundBatches(cid, made[cid] - 1)

    class FedAvg(FederatedAveraging):
        """pfl's FedAvg without its scoring of every user's data before and after local
        training, which pfl does whenever ``iteration % evaluation_frequency == 0``, so always
        in round 0 (fedlore scores no client by default)."""

        def get_next_central_contexts(self, *args: Any, **kwargs: Any) -> Any:
            contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, metrics

    class Float64Stats(MappedVectorStatistics):
        """Deltas in float64 whose reweighting multiplies by the new weight and divides by the
        old one: the weighted mean ``Σ n_i Δ_i / Σ n_i`` as fedlore computes it
        (:func:`fedlore.tensors.weighted_mean`; pfl multiplies by the reciprocal)."""

        weight: float

        def reweight(self, new_weight: float) -> None:
            for name in list(self.keys()):
                self[name] = self[name] * float(new_weight) / float(self.weight)
            self.weight = new_weight

    class Float64Deltas(Postprocessor):
        """Each user's delta to float64 before it is weighted and summed (pfl sums float32)."""

        def postprocess_one_user(self, *, stats: Any, user_context: Any) -> tuple[Any, Metrics]:
            wide = {k: v.to(torch.float64) for k, v in stats.items()}
            return Float64Stats(wide, weight=stats.weight), Metrics()

    class Tick(TrainingProcessCallback):
        def after_central_iteration(
            self, aggregate_metrics: Metrics, model: Any, *, central_iteration: int
        ) -> tuple[bool, Metrics]:
            clock.tick(torch.get_num_threads())
            if made != [central_iteration + 1] * fed.num_clients:
                raise RuntimeError(f"pfl did not train every user once per round: {made}")
            return False, Metrics()

    net = Net(model_factory(cfg, fed, SEED)())
    local: Callable[..., torch.optim.Optimizer]
    if algo.local_optimizer == "sgd":
        local = functools.partial(
            torch.optim.SGD, momentum=algo.momentum, weight_decay=algo.train.weight_decay
        )
    else:
        local = functools.partial(
            torch.optim.AdamW,
            betas=algo.train.betas,
            eps=algo.train.eps,
            weight_decay=algo.train.weight_decay,
        )
    model = PyTorchModel(
        net,
        local_optimizer_create=local,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    init = digest({k.removeprefix("net."): v for k, v in model.get_parameters().items()})
    train_params = NNTrainHyperParams(
        local_num_epochs=None,
        local_learning_rate=algo.train.lr,
        local_batch_size=algo.train.batch_size,
        local_num_steps=local_steps,
        local_max_grad_norm=algo.train.grad_clip,
    )
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=cfg.rounds,
        evaluation_frequency=cfg.rounds,
        train_cohort_size=fed.num_clients,
        val_cohort_size=None,
    )
    users = FederatedDataset(make_dataset, MinimizeReuseUserSampler(list(range(fed.num_clients))))
    backend = SimulatedBackend(
        training_data=users,
        val_data=None,
        postprocessors=[Float64Deltas(), WeightByDatapoints()],  # in this order
    )
    eval_params = NNEvalHyperParams(local_batch_size=EVAL_BATCH)
    FedAvg().run(algorithm_params, backend, model, train_params, eval_params, [Tick()])
    test = fed.central_test
    scores = model.evaluate(Dataset((test.x, test.y)), eval_params=eval_params)
    batches, count = log.summary()
    result = {
        **clock.report(),
        "accuracy": float(scores[StringMetricName("accuracy")].overall_value),
        "n_test": len(test),
        "init_digest": init,
        "batch_digest": batches,
        "batches": count,
        "buffers": [k for k, _ in net.named_buffers()],
        "torch_default_threads": default_threads,
        "omp_wait_policy": wait_policy,
    }
    weights = {
        k.removeprefix("net."): v.detach().cpu().clone() for k, v in net.state_dict().items()
    }
    return result, {"weights": weights, "predictions": predict(net, test.x).cpu()}


def worker(a: argparse.Namespace) -> None:
    """Run one framework once and leave ``result.json`` and ``final.pt`` in ``--workdir``."""
    wall, cpu = time.perf_counter(), time.process_time()
    load = os.getloadavg()[0]
    omp_env = {k: v for k, v in os.environ.items() if k.startswith("OMP_")}  # before imports
    result, final = (fedlore_worker if a.worker == "fedlore" else pfl_worker)(a)
    import torch

    torch.save(final, a.workdir / "final.pt")
    result.update(
        framework=a.worker,
        task=a.task,
        process_wall_s=time.perf_counter() - wall,
        process_cpu_s=time.process_time() - cpu,
        load_at_start=load,
        omp_env=omp_env,
    )
    (a.workdir / "result.json").write_text(json.dumps(result))
