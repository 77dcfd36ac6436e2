"""fedlore vs Apple's pfl-research (``pfl`` 0.6.0, PyTorch backend) on identical FedAvg work.

Issue 30, item 3 (a benchmark, not a test). Two tasks on the quickstart's federation settings
(``experiments/quickstart.yaml``: 10 clients, every client in every round, K = 10 local steps of
batch 32, seed 42):

* ``digits``: sklearn digits, Dirichlet(0.5) labels (the quickstart's: clients of unequal
  sizes), fedlore's MLP (64-128-128-10), 30 rounds, local SGD lr 0.1;
* ``fmnist``: Fashion-MNIST, IID clients (as ``benchmarks/round_time.py``), fedlore's McMahan et
  al. CNN (1.66 M parameters), 10 rounds, local SGD lr 0.05.

fedlore runs its ``fedavg`` method (FedAvg with plain local SGD) through
:func:`fedlore.experiment.run_one`, the code path of ``fedlore run``; pfl runs
``FederatedAveraging`` on its ``SimulatedBackend``. The work is the same:

* data: pfl's users are fedlore's clients (their training splits from ``build_federation``); both
  score fedlore's central test set;
* initial weights: pfl's ``PyTorchModel`` wraps a model built by fedlore's ``model_factory`` (the
  initial state of every fedlore run of the seed); a digest of the weights pfl starts from is
  compared with fedlore's;
* minibatches: fedlore's client c draws round t's K batches from ``generator(seed, CLIENT, t, c)``
  (``ClientData.batches``: epoch-wise permutations; an epoch's last batch may be short). pfl's
  dataset of user c in round t yields exactly these K batches, drawn by the same call (pfl's own
  ``Dataset`` slices a user's data in stored order, unshuffled). A digest of every batch either
  side consumed (inputs and labels, per round and client) is compared;
* local optimizer: fedlore's settings, read from its ``fedavg`` object: ``torch.optim.SGD`` at its
  lr, momentum 0 and weight decay 0 (``--method fedfull``: AdamW with fedlore's betas, eps and
  weight decay, lr 3e-3), new for every client and round on both sides; constant lr, no clipping;
  the loss is the mean cross-entropy on both sides;
* aggregation: weighted by the clients' training-set sizes (fedlore ``weighting: num_examples``,
  pfl ``WeightByDatapoints``), then pfl's central optimizer, SGD with lr 1.0, adds the weighted
  mean of the deltas to the model: plain FedAvg on both sides. fedlore sums the weighted deltas
  in float64 and casts the mean to float32; pfl's stock sum is float32 and multiplies by the
  reciprocal of the total weight. Here a pfl postprocessor (``Float64Deltas``, before the
  weighting) gives pfl fedlore's arithmetic, so the two compute the same floats; with pfl's
  float32 sum the first round's models differed by 1.5e-8 and training grew it (Fashion-MNIST
  on Dirichlet(0.5) clients, one thread, 10 rounds: weights 4e-3 apart, 52 test predictions
  differing, accuracies 0.15 % apart);
* each framework's own overheads stay: fedlore screens the uploads (finite, shapes, norms) and
  writes a metrics row per round; pfl builds a user dataset and context per user and round.
  Left out on both sides: fedlore's per-round checkpoint (pfl writes none by default) and pfl's
  scoring of every user's data before and after local training, which it does whenever
  ``iteration % evaluation_frequency == 0``, so always in round 0 (fedlore scores no client by
  default); both score the central test set once, after the last round, untimed.

Accuracy check: the final test accuracies must agree within one test image or 0.1 %, whichever
is larger (on the 360 digits test images one image, 0.28 %; on Fashion-MNIST's 10,000, 10
images). With the same thread count on both sides the two compute the same floats and the final
weights are bit-identical (max abs weight difference 0); a different thread count can change
float sums in torch's kernels, which training then grows, hence the tolerance. The number of
test images whose predicted class differs and the largest weight difference are reported. The
script exits 1 when the accuracies disagree or the initial weights or minibatches differ.

Timing: each framework runs in a fresh subprocess, one at a time (alternating which goes first,
repeat by repeat), ``--repeats`` times. A round is timed from the end of the previous round to its
own end, so everything the framework does per round counts; round 0 is a warm-up (first-call
costs) and is not reported; fedlore's central evaluation after the last round is timed and taken
out. Per run: the median wall seconds per round; reported: the median over repeats, and
fedlore / pfl of those medians. Beside it, the process CPU seconds (all threads) / wall seconds
over the timed rounds: about the number of cores kept busy (spinning OpenMP threads count too).

Threads: each framework's default, as a user gets it: fedlore's ``threads: auto``, pfl's torch
default (the pfl process imports torch and pfl before fedlore's data and model code, so fedlore's
``OMP_WAIT_POLICY=PASSIVE`` default does not reach pfl's OpenMP runtime either). The count each
used is reported. ``--threads N`` sets ``OMP_NUM_THREADS=N`` for both (same count on both sides).

    python benchmarks/peer_pfl.py                          # both tasks, 3 repeats (a few minutes)
    python benchmarks/peer_pfl.py --tasks digits --rounds 2 --repeats 1    # a smoke test
    python benchmarks/peer_pfl.py --threads 1              # both on one thread

pfl is not a dependency of fedlore (pyproject extra ``peer``, see the message when it is
missing: exit 2). Run on an otherwise idle machine: the timings of a shared one are noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Only the standard library at module level: a worker chooses its own import order (see Threads).

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

        def batches(self_: Any, batch_size: int, num_batches: int, rng: Any, rnd: int) -> Any:
            entry = seen[(int(rnd), self_.client_id)] = [0, hashlib.sha256()]
            for x, y in original(self_, batch_size, num_batches, rng, rnd):
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

    parts_mod.evaluate = timed_evaluate  # type: ignore[assignment]
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

    experiment_mod.model_factory = digesting_factory  # type: ignore[assignment]
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

    from fedlore.data.federation import build_federation
    from fedlore.experiment_parts import make_algorithm, model_factory
    from fedlore.seeding import CLIENT, generator

    cfg = task_config(a.task, a.method, a.rounds, a.lr, a.workdir / "runs")
    algo = make_algorithm(a.method, cfg)  # fedlore's settings, the one source for both sides
    if (
        algo.train.schedule != "constant"
        or algo.train.weighting != "num_examples"
        or algo.train.freeze
    ):
        raise SystemExit(f"peer_pfl: unsupported fedlore settings for a pfl twin: {algo}")
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
            if batch_size != algo.train.batch_size:  # pfl scoring the user (not done here)
                yield from super().iter(batch_size)
                return
            rng = generator(SEED, CLIENT, self.rnd, self.client.client_id)
            yield from self.client.batches(batch_size, algo.train.local_steps, rng, self.rnd)

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
        local_num_steps=algo.train.local_steps,
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


def pfl_problem() -> str | None:
    """None when pfl imports (in a fresh process, its PyTorch parts), else why not."""
    import importlib.util

    if importlib.util.find_spec("pfl") is None:
        return "no module named 'pfl'"
    code = (
        "import pfl.model.pytorch, pfl.algorithm, pfl.aggregate.simulate, "
        "pfl.data.federated_dataset"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        return (res.stderr.strip().splitlines() or ["import failed"])[-1]
    return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "machine": platform.machine()}
    for pkg in ("torch", "pfl", "fedlore", "dp-accounting"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def run_one_framework(
    a: argparse.Namespace, fw: str, task: str, rounds: int, lr: float, workdir: Path
) -> dict[str, Any]:
    """One worker subprocess; its result (exits 1 with its output when it fails)."""
    env = dict(os.environ)
    if a.threads is not None:
        env["OMP_NUM_THREADS"] = str(a.threads)
    env["PFL_PYTORCH_DEVICE"] = "cpu"  # fedlore runs on the CPU here (device=cpu)
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        fw,
        "--tasks",
        task,
        "--rounds",
        str(rounds),
        "--lr",
        str(lr),
        "--method",
        a.method,
        "--workdir",
        str(workdir),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-30:])
        print(f"peer_pfl: the {fw} run of {task} failed (exit {res.returncode}):\n{tail}")
        raise SystemExit(1)
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    return result


def compare(fed_dir: Path, pfl_dir: Path) -> dict[str, Any]:
    """Largest weight difference and differing test predictions of two final models."""
    import torch

    f = torch.load(fed_dir / "final.pt")
    p = torch.load(pfl_dir / "final.pt")
    if set(f["weights"]) != set(p["weights"]):
        names = sorted(set(f["weights"]) ^ set(p["weights"]))
        raise SystemExit(f"peer_pfl: the two final models differ in their tensors: {names}")
    diff = max(
        float((f["weights"][k].double() - p["weights"][k].double()).abs().max())
        for k in f["weights"]
    )
    return {
        "max_abs_weight_diff": diff,
        "predictions_differing": int((f["predictions"] != p["predictions"]).sum()),
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {list(TASKS)}")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: per task)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--method", choices=("fedavg", "fedfull"), default="fedavg")
    p.add_argument("--lr", type=float, default=None, help="local lr (default: per task/method)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both sides")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/peer_pfl.json")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.task = a.tasks
        worker(a)
        return
    tasks = a.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or a.repeats < 1 or (a.rounds is not None and a.rounds < 2):
        p.error(f"unknown tasks {unknown}" if unknown else "need --repeats >= 1, --rounds >= 2")
    problem = pfl_problem()
    if problem is not None:
        print(f"{INSTALL} [{problem}]")
        raise SystemExit(2)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        t: {fw: [] for fw in FRAMEWORKS} for t in tasks
    }
    pairs: dict[str, list[dict[str, Any]]] = {t: [] for t in tasks}
    with tempfile.TemporaryDirectory(prefix="peer_pfl-") as tmp:
        for rep in range(a.repeats):
            order = FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]
            for task in tasks:
                rounds = a.rounds or TASKS[task].rounds
                lr = a.lr or (TASKS[task].sgd_lr if a.method == "fedavg" else ADAMW_LR)
                dirs = {}
                for fw in order:
                    dirs[fw] = Path(tmp) / f"{task}-{fw}-{rep}"
                    dirs[fw].mkdir()
                    r = run_one_framework(a, fw, task, rounds, lr, dirs[fw])
                    r.update(rounds_total=rounds, lr=lr, repeat=rep)
                    runs[task][fw].append(r)
                    print(
                        f"[{rep + 1}/{a.repeats}] {task} {fw}: {r['s_per_round']:.4f} s/round, "
                        f"{r['threads']} threads, CPU/wall {r['cpu_per_wall']:.2f}, "
                        f"accuracy {r['accuracy']:.4f}",
                        file=sys.stderr,
                    )
                pairs[task].append(compare(dirs["fedlore"], dirs["pfl"]))
    failures: list[str] = []
    report: dict[str, Any] = {}
    for task in tasks:
        f_runs, p_runs = runs[task]["fedlore"], runs[task]["pfl"]
        n_test = f_runs[0]["n_test"]
        tol = max(1.0 / n_test, 0.001)
        for rep, (fr, pr) in enumerate(zip(f_runs, p_runs, strict=True)):
            if fr["init_digest"] != pr["init_digest"]:
                failures.append(f"{task} repeat {rep + 1}: the initial weights differ")
            if fr["batch_digest"] != pr["batch_digest"] or fr["batches"] != pr["batches"]:
                failures.append(
                    f"{task} repeat {rep + 1}: the minibatches differ "
                    f"({fr['batches']} vs {pr['batches']} batches)"
                )
            if fr["buffers"] or pr["buffers"]:
                failures.append(f"{task}: the model has buffers, which pfl does not average")
            if not abs(fr["accuracy"] - pr["accuracy"]) <= tol + 1e-9:
                why = ""
                if fr["threads"] != pr["threads"]:
                    why = (
                        f"; they ran on {fr['threads']} and {pr['threads']} threads, which can "
                        "change float sums (rerun with --threads N on an idle machine)"
                    )
                failures.append(
                    f"{task} repeat {rep + 1}: accuracies disagree: fedlore "
                    f"{fr['accuracy']:.4f}, pfl {pr['accuracy']:.4f} (tolerance {tol:.4f}){why}"
                )
        per = {
            fw: {
                "s_per_round": median([r["s_per_round"] for r in rs]),
                "cpu_s_per_round": median([r["cpu_s_per_round"] for r in rs]),
                "cpu_per_wall": median([r["cpu_per_wall"] for r in rs]),
                "threads": sorted({t for r in rs for t in r["threads"]}),
                "accuracy": [r["accuracy"] for r in rs],
                "process_wall_s": median([r["process_wall_s"] for r in rs]),
                "runs": rs,
            }
            for fw, rs in (("fedlore", f_runs), ("pfl", p_runs))
        }
        report[task] = {
            "title": TASKS[task].title,
            "rounds": f_runs[0]["rounds_total"],
            "timed_rounds": f_runs[0]["timed_rounds"],
            "lr": f_runs[0]["lr"],
            "n_test": n_test,
            "accuracy_tolerance": tol,
            **per,
            "ratio_fedlore_over_pfl": per["fedlore"]["s_per_round"] / per["pfl"]["s_per_round"],
            "cpu_ratio_fedlore_over_pfl": per["fedlore"]["cpu_s_per_round"]
            / per["pfl"]["cpu_s_per_round"],
            "agreement": pairs[task],
        }
    print(
        f"# fedlore vs pfl {versions()['pfl']}: FedAvg ({a.method}), 10 clients, K=10, B=32, "
        f"seed {SEED}; median of {a.repeats} fresh-process runs each; "
        f"{os.cpu_count()} CPUs; threads: "
        + (f"OMP_NUM_THREADS={a.threads} for both" if a.threads else "each framework's default")
    )
    print(
        "| task | rounds (timed) | fedlore s / round | pfl s / round | fedlore / pfl | "
        "fedlore threads, CPU/wall | pfl threads, CPU/wall | test accuracy fedlore / pfl | "
        "test predictions differing | max abs weight diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for task, r in report.items():
        f, q = r["fedlore"], r["pfl"]
        worst = max(pairs[task], key=lambda c: c["predictions_differing"])
        acc = max(  # the repeat whose accuracies are furthest apart
            zip(f["accuracy"], q["accuracy"], strict=True), key=lambda fp: abs(fp[0] - fp[1])
        )
        print(
            f"| {r['title']} | {r['rounds']} ({r['timed_rounds']}) | {f['s_per_round']:.4f} | "
            f"{q['s_per_round']:.4f} | {r['ratio_fedlore_over_pfl']:.2f} | "
            f"{','.join(map(str, f['threads']))}, {f['cpu_per_wall']:.2f} | "
            f"{','.join(map(str, q['threads']))}, {q['cpu_per_wall']:.2f} | "
            f"{acc[0]:.4f} / {acc[1]:.4f} | "
            f"{worst['predictions_differing']} of {r['n_test']} | "
            f"{max(c['max_abs_weight_diff'] for c in pairs[task]):.2e} |"
        )
    out = {
        "args": {k: str(v) for k, v in vars(a).items() if k not in ("worker", "workdir")},
        "versions": versions(),
        "cpus": os.cpu_count(),
        "tasks": report,
        "checks_passed": not failures,
        "failures": failures,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    print(f"results in {a.out}")
    if failures:
        print("peer_pfl: NOT identical work or disagreeing results:\n  " + "\n  ".join(failures))
        raise SystemExit(1)
    print("checks: same initial weights, same minibatches, accuracies agree")


if __name__ == "__main__":
    main()
