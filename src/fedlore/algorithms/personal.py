"""Building blocks of the personalized methods (pFedMe, Ditto, FedFomo, pFedBayes, FedMask).

A personalized method keeps each client's personal model in that client's :class:`State` under
``personal.<state_dict name>``. The transport's client-state store persists it between the
rounds a client takes part in (:class:`~fedlore.engine.store.ClientStore` in process, Flower's
``Context.state`` on a SuperNode); ``personal.`` tensors never enter a reply.

Personalized evaluation (P-local, reference notes Part 0.8): :meth:`Personalized.evaluate_personal`
loads the personal model from the client state into the scratch model and scores it on the
client's own test split. It reads only the state and the test split, never the global model, and
training never reads the test split: in the run's last round (``local_eval``) a client reports
the score of the personal model it just trained as ``local_accuracy``, ``local_loss``,
``local_ece`` beside the global model's G-central (``accuracy``) and G-local
(``client_accuracy``) scores.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlore.algorithms.base import Hyper, local_eval_due, local_scores
from fedlore.data.client_data import ClientData
from fedlore.tensors import load_model_arrays, select, with_prefix
from fedlore.train.local import LossTerm
from fedlore.types import Scalars, State

PERSONAL = "personal."


def prox_term(anchor: dict[str, torch.Tensor], lam: float) -> LossTerm:
    """The proximal term ``model -> (lam / 2) Σ ||w - anchor||²`` over the trained parameters
    named in ``anchor`` (FedProx's mu, Ditto's lambda with the received w^t, pFedMe's lambda
    with the local copy w_i; Li et al. 2020 Eq. 2, Li et al. 2021 Eq. 2, Dinh et al. 2020
    Eq. 2). Its gradient is ``lam (w - anchor)``.

    Args:
        anchor: plain ``state_dict`` names -> tensors (copied: later changes do not leak in).
        lam: the coefficient (>= 0).

    Returns:
        a :data:`~fedlore.train.local.LossTerm` giving a 0-d tensor.
    """
    fixed = {k: v.detach().clone() for k, v in anchor.items()}

    def prox(model: nn.Module) -> torch.Tensor:
        parts = [
            (p - fixed[name]).pow(2).sum()
            for name, p in model.named_parameters()
            if p.requires_grad and name in fixed
        ]
        if not parts:  # nothing anchored is trained: a zero on the model's device
            device = next((q.device for q in model.parameters()), torch.device("cpu"))
            return torch.zeros((), device=device)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return 0.5 * lam * total

    return prox


def personal_arrays(state: State | None) -> dict[str, torch.Tensor]:
    """The personal model's tensors (plain names) held in a client state ({} when none)."""
    return {} if state is None else select(state.arrays, PERSONAL)


def keep_personal(model: nn.Module) -> dict[str, torch.Tensor]:
    """``personal.*`` copies of every tensor of ``model`` (detached clones: the snapshot never
    aliases the live weights, the pFedMe pitfall of reference notes Part 7.5)."""
    return with_prefix({k: v.detach().clone() for k, v in model.state_dict().items()}, PERSONAL)


class BetaMixing:
    """Server step of pFedMe (Dinh et al. 2020, Algorithm 1 line 12) and pFedBayes:
    ``w^{t+1} = (1 - beta) w^t + beta · Σ p_i w_i / Σ p_i``, i.e. the step ``beta · Σ p_i Δ_i /
    Σ p_i`` (beta = 1: FedAvg). Mixed in before :class:`~fedlore.algorithms.dense.DenseServer`
    into a dataclass with a ``beta`` field."""

    def mean_update(
        self,
        model: dict[str, torch.Tensor],
        updates: list[dict[str, torch.Tensor]],
        weights: list[float],
    ) -> dict[str, torch.Tensor]:
        beta = float(self.beta)  # type: ignore[attr-defined]
        combined = self.combine_deltas(updates, weights)  # type: ignore[attr-defined]
        return {k: beta * v for k, v in combined.items()}


class Personalized:
    """Mixin of the personalized methods: P-local evaluation of the personal model held in the
    client state. Mixed into a :class:`~fedlore.algorithms.base.Hyper` dataclass; a method whose
    model differs from the registered one defines ``prepare_model`` (applied first), and one whose
    personal model is not a plain ``state_dict`` overrides :meth:`load_personal`."""

    def load_personal(self, state: State, model: nn.Module) -> nn.Module:
        """Load the client's personal model from ``state`` into the scratch ``model``.

        Raises:
            ValueError: when ``state`` holds no personal model.
            RuntimeError: when its tensors do not match the model (strict load).
        """
        prepare = getattr(self, "prepare_model", None)
        if callable(prepare):
            model = prepare(model)
        arrays = personal_arrays(state)
        if not arrays:
            raise ValueError(f"{type(self).__name__}: the client state holds no personal model")
        load_model_arrays(model, arrays)
        return model

    def evaluate_personal(self, state: State, model: nn.Module, data: ClientData) -> Scalars:
        """P-local: the personal model of ``state`` on ``data.test`` (the MC predictive over
        ``mc_samples`` draws for a stochastic model). Depends only on ``state`` and the test
        split, not on what ``model`` held.

        Returns:
            ``local_accuracy`` (share), ``local_loss`` (mean NLL, nats), ``local_ece``,
            ``local_<name>`` for each of ``eval.metrics`` and ``local_n`` (test examples); {}
            when the client has no test split.
        """
        if len(data.test) == 0:
            return {}
        hyper: Hyper = self  # type: ignore[assignment]
        return local_scores(
            self.load_personal(state, model), data, hyper.train.mc_samples, hyper.train.metrics
        )

    def personal_eval_metrics(
        self, state: State, model: nn.Module, data: ClientData, rnd: int
    ) -> Scalars:
        """:meth:`evaluate_personal` in the run's last round when ``local_eval`` is on, else {}
        (the same gate as :func:`~fedlore.algorithms.base.local_eval_metrics`). Called after
        local training, so the test split is read only once the personal model is final."""
        hyper: Hyper = self  # type: ignore[assignment]
        if not local_eval_due(hyper, rnd):
            return {}
        return self.evaluate_personal(state, model, data)
