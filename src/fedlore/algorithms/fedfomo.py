"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021): first-order model optimization.

Each client builds its own model as a weighted combination of other clients' models, weighting
a model by how much it lowers the client's loss on its **own validation split** per unit of
parameter distance (FedFomo Eqs. 5-7; NVlabs/FedFomo ``client.py``):

``Δ_n = (L_val(theta_b) - L_val(theta_n)) / ||theta_n - theta_b||``,
``w_n = max(Δ_n, 0) / Σ_m max(Δ_m, 0)``, ``theta <- theta_b + Σ_n w_n (theta_n - theta_b)``

(``theta <- theta_b`` when no ``Δ_n`` is positive). ``theta_b`` is the client's model before its
previous local training (NVlabs ``--baseline_model first_model``); the candidates are the models
the client asked the server for plus its own last trained model. The affinity vector ``P_i``
(``P_i[n] += Δ_n / |Σ_m Δ_m|``) ranks the clients to ask for next time: each of the
``num_candidates`` = M slots is, with probability ``epsilon_t = max(0, epsilon - t ·
epsilon_decay)``, a random client of the pool, otherwise the best remaining by ``P_i`` (random
tie-breaks; NVlabs ``get_federating_clients``). Then the client trains ``theta`` with local SGD
on the rest of its training split and uploads it.

Client state (the transport's store): the personal ``theta`` (``personal.*``), ``theta_b``
(``base.*``), the affinities (``fomo.ids``, ``fomo.affinity``). The validation split is a fixed
``val_fraction`` of the training split per client (NVlabs ``--train_split 0.8``); it is never
trained on. Server state: every client's latest upload (``store.<id>.*``), each client's
request for its next round, and a FedAvg of the round's uploads (``model.*``) that is only a
reference (the run's G-central / G-local scores; NVlabs logs one too).

Messages: a client asks at round t for the M models it receives at its next round
(``fomo.request``, padded with -1), chosen from the clients that had uploaded by round t
(``fomo.pool`` in the broadcast). A client with no request yet receives M pool models drawn by
the server from a seed in its state. Bytes: up to M models down (plus the initial model at
first contact), one model up.

Defaults: M = 4 (NVlabs README "5 models": 4 others + the client's own), ``epsilon = 0.3``,
``epsilon_decay = 0.05``, ``val_fraction = 0.2``, ``distance = "l1"`` (NVlabs
``--model_delta_norm l1``; PFLlib and FL-bench use l2); local SGD at the run's ``lr``.

P-local (``plocal="combined"``, the default): as NVlabs ``server.py: local_eval`` does, the
client scores its federated model, ``theta`` right after the weighted combination and before
local training, on its own test split (in the run's last round, ``eval.local``; at a client's
first contact the received initial model); ``plocal="trained"`` scores ``theta`` after local
training instead, as the other personalized methods do. The scores only read the test split
(evaluation mode, no gradient), so training is the same either way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.base import ReplySpec, local_eval_due, local_scores, reply_metrics
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.meta_lr import meta_size, meta_split
from fedlore.algorithms.personal import Personalized, keep_personal, personal_arrays
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.registry import register_algorithm
from fedlore.seeding import derive_seed
from fedlore.tensors import load_model_arrays, model_arrays, select, with_prefix
from fedlore.train.local import evaluate, local_train
from fedlore.types import Broadcast, Reply, Scalars, State

FOMO_SEED = "fomo.seed"


def fomo_weights(
    base_loss: float, losses: list[float], distances: list[float]
) -> tuple[list[float], list[float]]:
    """FedFomo's first-order weights (Eqs. 5-6).

    Args:
        base_loss: ``L_val(theta_b)`` (nats).
        losses: ``L_val(theta_n)`` per candidate (nats).
        distances: ``||theta_n - theta_b||`` per candidate.

    Returns:
        (``Δ_n``, ``w_n``): ``Δ_n = (base_loss - losses[n]) / distances[n]`` (0 for a candidate
        equal to the baseline or with a non-finite loss), ``w_n = max(Δ_n, 0) / Σ max(Δ, 0)``
        (all 0 when no Δ is positive).

    Raises:
        ValueError: when the lists differ in length.
    """
    if len(losses) != len(distances):
        raise ValueError(f"{len(losses)} losses but {len(distances)} distances")
    deltas = [
        (base_loss - loss) / d
        if d > 0 and math.isfinite(loss) and math.isfinite(base_loss)
        else 0.0
        for loss, d in zip(losses, distances, strict=True)
    ]
    pos = [max(x, 0.0) for x in deltas]
    total = sum(pos)
    return deltas, [x / total if total > 0 else 0.0 for x in pos]


def pick_requests(
    pool: list[int],
    affinity: dict[int, float],
    m: int,
    epsilon: float,
    rng: torch.Generator,
) -> list[int]:
    """Epsilon-greedy choice of up to ``m`` distinct clients of ``pool``: per slot, with
    probability ``epsilon`` a uniformly random remaining client, else the remaining one with the
    highest ``affinity`` (0 for unknown clients; random tie-breaks). NVlabs/FedFomo
    ``client.py: get_federating_clients``."""
    left = list(pool)
    out: list[int] = []
    while left and len(out) < m:
        explore = float(torch.rand((), generator=rng)) < epsilon
        if explore:
            j = left[int(torch.randint(len(left), (), generator=rng))]
        else:
            best = max(affinity.get(c, 0.0) for c in left)
            ties = [c for c in left if affinity.get(c, 0.0) == best]
            j = ties[int(torch.randint(len(ties), (), generator=rng))]
        out.append(j)
        left.remove(j)
    return out


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], norm: str) -> float:
    """L1 or L2 distance between two models over their floating-point tensors."""
    diffs = [(a[k] - b[k]).flatten().double() for k in a if a[k].is_floating_point()]
    flat = torch.cat(diffs) if diffs else torch.zeros(1, dtype=torch.float64)
    return float(flat.abs().sum() if norm == "l1" else flat.norm())


@register_algorithm("fedfomo")
@dataclass(frozen=True)
class FedFomo(Personalized, FedAvg):
    """FedFomo (module docstring). Hyperparameters beyond FedAvg's:

    Attributes:
        num_candidates: M, other clients' models a client downloads per round.
        epsilon: initial exploration probability of the candidate choice.
        epsilon_decay: its decrease per round.
        val_fraction: share of the training split kept as the client's validation set.
        distance: ``"l1"`` or ``"l2"``, the norm in ``Δ_n``'s denominator.
        plocal: which model P-local scores: ``"combined"`` (NVlabs: the weighted combination,
            before local training) or ``"trained"`` (after local training).
    """

    name: ClassVar[str] = "fedfomo"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=(
            "its server weighs each client model by its loss against the current round's models"
        ),
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        server_optimizer=False,  # its server forwards models; it takes no averaged step
        individual_uploads=(
            "its server stores each client's uploaded model and forwards it to the clients that "
            "ask for it, which weight every candidate model by its loss on their own validation "
            "split (FedFomo Eqs. 5-7)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    num_candidates: int = 4
    epsilon: float = 0.3
    epsilon_decay: float = 0.05
    val_fraction: float = 0.2
    distance: Literal["l1", "l2"] = "l1"
    plocal: Literal["combined", "trained"] = "combined"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "num_candidates": self.num_candidates >= 1,
            "epsilon": 0.0 <= self.epsilon <= 1.0,
            "epsilon_decay": self.epsilon_decay >= 0,
            "val_fraction": 0.0 < self.val_fraction < 1.0,
            "distance": self.distance in ("l1", "l2"),
            "plocal": self.plocal in ("combined", "trained"),
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"fedfomo: invalid {field}={getattr(self, field)!r}")
        if self.train.freeze:
            raise ValueError(
                f"fedfomo combines and uploads whole client models; params.freeze="
                f"{list(self.train.freeze)} is not supported by it (leave it empty)"
            )

    # -- server ---------------------------------------------------------------------------

    def round_steps(self, num_examples: int) -> int:
        """K on the examples the client trains on: its training split without the validation
        share it holds out (all of it below 2 examples, as :meth:`client_update` does)."""
        if num_examples < 2:
            return self.local_steps(num_examples)
        held = meta_size(num_examples, self.val_fraction, "heldout")
        return self.local_steps(num_examples - held)

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """The initial model (``model.*``) and a seed for the server's fallback choices."""
        seed = int(torch.randint(0, 2**62, (1,), generator=rng))
        return State(arrays=with_prefix(model_arrays(model), "model."), values={FOMO_SEED: seed})

    def pool(self, state: State) -> list[int]:
        """Ids of the clients whose latest upload the server holds, ascending."""
        return sorted({int(k.split(".")[1]) for k in state.arrays if k.startswith("store.")})

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        """The initial model at first contact; up to M candidate models (``cand.<id>.*``); the
        pool of ids the client may ask for next (``fomo.pool``, int64)."""
        arrays: dict[str, torch.Tensor] = {}
        if not state.values.get(f"seen.{client_id}"):
            arrays.update(select(state.arrays, "model.", strip=False))
        pool = [c for c in self.pool(state) if c != client_id]
        asked = str(state.values.get(f"request.{client_id}", ""))
        if asked:
            wanted = [c for c in map(int, asked.split(",")) if c in pool]
        else:  # no request yet: M pool models drawn from a seed fixed by (state, round, client)
            g = torch.Generator().manual_seed(
                derive_seed(int(state.values[FOMO_SEED]), rnd, client_id)
            )
            wanted = sorted(pick_requests(pool, {}, self.num_candidates, 1.0, g))
        for c in wanted:
            arrays.update(with_prefix(select(state.arrays, f"store.{c}."), f"cand.{c}."))
        arrays["fomo.pool"] = torch.tensor(pool, dtype=torch.int64)
        return Broadcast(arrays=arrays, config={"round": rnd})

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """Store each accepted upload and request; the reference model is their FedAvg."""
        arrays = dict(state.arrays)
        values = dict(state.values)
        ok = [(c, r) for c, r in replies if r is not None]
        for c, r in replies:
            if r is None:
                values.pop(f"seen.{c}", None)
        for c, r in ok:
            for k in [k for k in arrays if k.startswith(f"store.{c}.")]:
                del arrays[k]
            arrays.update(with_prefix(select(r.arrays, "model."), f"store.{c}."))
            values[f"seen.{c}"] = 1
            req = [int(x) for x in r.arrays["fomo.request"].tolist() if int(x) >= 0]
            values[f"request.{c}"] = ",".join(map(str, req))
        if ok:
            uploads = [select(r.arrays, "model.") for _, r in ok]
            mean = self.combine_deltas(uploads, self.weights([r for _, r in ok]))
            arrays.update(with_prefix(mean, "model."))
        return State(arrays=arrays, values=values), {"aggregated": len(ok)}

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        spec: ReplySpec = {
            "model." + k: (tuple(v.shape), v.dtype)
            for k, v in select(state.arrays, "model.").items()
        }
        spec["fomo.request"] = ((self.num_candidates,), torch.int64)
        return spec

    # -- client ---------------------------------------------------------------------------

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """Combine the candidates on the validation split, train locally, upload the model and
        the next request."""
        rnd = int(msg.config["round"])
        own = personal_arrays(state)
        # a client with one example cannot hold one out: it validates on its training example
        fit, val = (
            meta_split(data, self.val_fraction, "heldout")
            if data.num_examples >= 2
            else (data.train,) * 2
        )
        ids = [] if state is None else state.arrays["fomo.ids"].tolist()
        aff = [] if state is None else state.arrays["fomo.affinity"].tolist()
        affinity = dict(zip(ids, aff, strict=True))
        combined: dict[str, float | int] = {}
        if not own:  # first contact: start from the received initial model
            load_model_arrays(model, select(msg.arrays, "model."))
        else:
            assert state is not None
            base = select(state.arrays, "base.")
            cands = {
                c: select(msg.arrays, f"cand.{c}.")
                for c in sorted({int(k.split(".")[1]) for k in msg.arrays if k.startswith("cand.")})
            }
            cands[data.client_id] = own
            combined = self.combine(model, base, cands, val, affinity)
        scores: Scalars = {}
        if self.plocal == "combined" and local_eval_due(self, rnd) and len(data.test):
            # NVlabs: before training
            scores = local_scores(model, data, self.train.mc_samples, self.train.metrics)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        opt = self.make_optimizer(model)
        lrs = self.round_lrs(rnd, len(fit))
        t0 = time.perf_counter()
        stats = local_train(
            model,
            dataclasses.replace(data, train=fit).batches(self.train.batch_size, len(lrs), rng, rnd),
            opt,
            lrs,
            grad_clip=self.train.grad_clip,
        )
        train_s = time.perf_counter() - t0
        pool = msg.arrays["fomo.pool"].tolist()
        eps = max(0.0, self.epsilon - max(rnd, 0) * self.epsilon_decay)
        request = pick_requests(pool, affinity, self.num_candidates, eps, rng)
        request += [-1] * (self.num_candidates - len(request))
        known = sorted(affinity)
        new = State(
            arrays={
                **keep_personal(model),
                **with_prefix(start, "base."),
                "fomo.ids": torch.tensor(known, dtype=torch.int64),
                "fomo.affinity": torch.tensor([affinity[c] for c in known], dtype=torch.float64),
            }
        )
        reply_arrays = {
            **with_prefix(
                {k: v.detach().clone() for k, v in model_arrays(model).items()}, "model."
            ),
            "fomo.request": torch.tensor(request, dtype=torch.int64),
        }
        metrics = reply_metrics(
            data.num_examples,
            train_loss=stats.mean_loss,
            skipped_steps=stats.skipped_steps,
            train_s=train_s,
            **combined,
            **(scores if self.plocal == "combined" else {}),
            **(
                self.personal_eval_metrics(new, model, data, rnd)
                if self.plocal == "trained"
                else {}
            ),
        )
        return Reply(arrays=reply_arrays, metrics=metrics), new

    def combine(
        self,
        model: nn.Module,
        base: dict[str, torch.Tensor],
        cands: dict[int, dict[str, torch.Tensor]],
        val: TensorSplit,
        affinity: dict[int, float],
    ) -> dict[str, float | int]:
        """Load ``theta_b + Σ w_n (theta_n - theta_b)`` into ``model`` and update ``affinity``
        in place (``P_i[n] += Δ_n / |Σ Δ|``). Returns metrics (candidates, positive weights)."""
        load_model_arrays(model, base)
        base_loss = float(evaluate(model, val, mc_samples=0)["loss"])
        order = sorted(cands)
        losses, dists = [], []
        for c in order:
            load_model_arrays(model, cands[c])
            losses.append(float(evaluate(model, val, mc_samples=0)["loss"]))
            dists.append(_distance(cands[c], base, self.distance))
        deltas, weights = fomo_weights(base_loss, losses, dists)
        total = abs(sum(deltas))
        for c, d in zip(order, deltas, strict=True):
            affinity[c] = affinity.get(c, 0.0) + (d / total if total > 0 else 0.0)
        combined = {}
        for k, b in base.items():
            if not b.is_floating_point():
                combined[k] = b
                continue
            step = sum(
                (w * (cands[c][k] - b) for c, w in zip(order, weights, strict=True) if w > 0),
                torch.zeros_like(b),
            )
            combined[k] = b + step
        load_model_arrays(model, combined)
        return {"candidates": len(order), "positive_weights": sum(w > 0 for w in weights)}
