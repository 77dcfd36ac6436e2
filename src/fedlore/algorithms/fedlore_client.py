"""FedLore's client round: :class:`FedLoreClient`, the client half of
:class:`~fedlore.algorithms.fedlore.FedLore` and every variant.

Seed (the FedLore paper), Algorithm 1 lines 6-22:

* synchronize (lines 6-10): the cached global model becomes W^t, from the dense model or by a
  replay of the server's increment log (:func:`~fedlore.algorithms.sync.replay_steps`),
  ``cache <- a_s cache + P^s Δ^s`` per missed round s with the round's common decay ``a_s``
  (Proposition 8; :func:`~fedlore.algorithms.lowrank.apply_increment`, the server's own
  operation, so the cache stays bit-identical to the server's model) and, under a 16-bit wire or
  ``upload_increments``, the unprojected tensors' increments; the bases P^s come from the
  broadcast or, for FedLore-Random, from their seeds (:mod:`fedlore.algorithms.basis_rules`);
* train (lines 11-19): K steps of projected Adam in the shared basis P^t with fresh moments
  (:func:`~fedlore.algorithms.lowrank.train_projected`), which accumulate the lr-weighted
  coordinates ``ΔZ_i`` (``r x n``);
* upload (lines 20-22): ``ΔZ_i`` (``update.*``), the unprojected tensors (``dense.*``: their
  values, or their increments ``D_K - D^t``) and the basis rule's upload (FedLore's candidate
  ``P_i = TopLeftSVD_r(G_i^{t,K-1})``, FedLore-Sketch's sketch, nothing for the others).

In the setup exchange (round -1) the client only uploads its rule's basis upload of one
construction-minibatch gradient at W^0. Its state: the cache ``cache.*``, the bases it holds
``basis.*``, values ``version`` (the round of its cache) and ``held`` (the id of its bases).
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from fedlore.algorithms.base import construction_gradients, local_eval_metrics, reply_metrics
from fedlore.algorithms.basis_rules import BasisRule
from fedlore.algorithms.lowrank import (
    LowRankHyper,
    OptState,
    ProjectedResult,
    add_increment,
    apply_increment,
    train_projected,
)
from fedlore.algorithms.sync import replay_steps
from fedlore.data.client_data import ClientData
from fedlore.optim.subspace import MatrixSpec
from fedlore.tensors import load_model_arrays, model_arrays, select, to_wire, with_prefix
from fedlore.types import Arrays, Broadcast, Reply, State


class FedLoreClient(LowRankHyper, abc.ABC):
    """The client side of FedLore (module docstring), a base of
    :class:`~fedlore.algorithms.fedlore.FedLore`, which gives it its basis rule and whether the
    unprojected tensors travel as increments."""

    @property
    @abc.abstractmethod
    def rule(self) -> BasisRule:
        """The variant's basis rule."""

    @property
    @abc.abstractmethod
    def dense_increments(self) -> bool:
        """Whether the unprojected tensors travel as increments ``D_K - D^t``."""

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        plan = self.plan(model)
        self.set_frozen(model)
        rule = self.rule
        rnd = int(msg.config["round"])
        if rnd < 0:
            load_model_arrays(model, select(msg.arrays, "model."))
            grads = construction_gradients(
                model, data.train, self.train.batch_size, rng, list(plan)
            )
            views = {k: plan[k].view(g) for k, g in grads.items()}
            held_model = model_arrays(model)
            new_state = State(
                arrays=with_prefix(held_model, "cache."), values={"version": 0, "held": -1}
            )
            up = rule.upload(msg, plan, views, None, rng, held_model)
            return Reply(up, reply_metrics(data.num_examples)), new_state
        cache, bases, held = self._synchronize(msg, state, plan, rnd, model)
        cur = int(msg.config["basis_id"])
        if cur != held:
            bases, held = rule.client_bases(msg, cur, plan, cache), cur
        load_model_arrays(model, cache)
        res = self.train_round(model, data, plan, bases, rng, rnd, state)
        final = model_arrays(model)
        wire = self.wire_dtype
        out = with_prefix(to_wire(res.coords, wire), "update.")
        dense = {k: final[k] for k in self.dense_keys(final, plan)}
        if self.dense_increments:  # the unprojected tensors' increments D_K - D^t
            dense = {k: v - cache[k].to(v.dtype) for k, v in dense.items()}
        out.update(with_prefix(to_wire(dense, wire), "dense."))
        out.update(rule.upload(msg, plan, res.last_grads, bases, rng, final))
        metrics = reply_metrics(
            data.num_examples,
            train_loss=res.stats.mean_loss,
            skipped_steps=res.stats.skipped_steps,
            optimizer_state_bytes=res.state_bytes,
            basis_bytes=res.basis_bytes,
            train_s=res.train_s,
            **res.extra,
            **local_eval_metrics(self, model, data, rnd),
        )
        kept = self.optimizer_keep(res)
        new_state = State(
            arrays={**with_prefix(cache, "cache."), **with_prefix(bases, "basis."), **kept.arrays},
            values={"version": rnd, "held": held, **kept.values},
        )
        return Reply(out, metrics), new_state

    def train_round(
        self,
        model: nn.Module,
        data: ClientData,
        plan: dict[str, MatrixSpec],
        bases: Arrays,
        rng: torch.Generator,
        rnd: int,
        state: State | None,
    ) -> ProjectedResult:
        """The round's K local steps from the synchronized model (lines 11-19): projected Adam
        in ``bases`` on the task loss (:func:`~fedlore.algorithms.lowrank.train_projected`),
        keeping the last gradient when the basis rule needs it; Bayesian FedLore trains on the
        ELBO with a learning-rate search instead."""
        lrs = self.round_lrs(rnd, data.num_examples)
        return train_projected(
            self,
            model,
            data.batches(self.train.batch_size, len(lrs), rng, rnd),
            plan,
            bases,
            lrs,
            keep_last_grad=self.rule.refreshes,
            start=self.optimizer_start(state, plan, bases),
            keep_state=self.keeps_optimizer_state,
        )

    @property
    def keeps_optimizer_state(self) -> bool:
        """Whether the client keeps optimizer state across rounds (:meth:`optimizer_keep` is
        handed the round's final state): no; FedSLoP does."""
        return False

    def optimizer_start(
        self, state: State | None, plan: dict[str, MatrixSpec], bases: Arrays
    ) -> dict[str, OptState] | None:
        """The optimizer state the round's local steps continue from, given the client's state
        before the round and the round's ``bases``: None, fresh moments every round (seed
        Algorithm 1 line 12); FedSLoP continues its momentum."""
        return None

    def optimizer_keep(self, res: ProjectedResult) -> State:
        """What of the round's final optimizer state the client keeps (nothing; FedSLoP keeps
        its momentum), merged into its state."""
        return State()

    def _synchronize(
        self,
        msg: Broadcast,
        state: State | None,
        plan: dict[str, MatrixSpec],
        rnd: int,
        model: nn.Module,
    ) -> tuple[Arrays, Arrays, int]:
        """Bring the client's cached global model to W^rnd: the broadcast's dense model (frozen
        tensors from the cache), or the replay of every logged round since the cache's version
        (``cache <- a_s cache + P^s Δ^s``, then the unprojected increments or values).

        Returns:
            (cache, the bases held after the replay, their id).

        Raises:
            RuntimeError: as :func:`~fedlore.algorithms.sync.replay_steps` does.
            KeyError: when the broadcast lacks a basis the replay needs.
        """
        held = int(state.values.get("held", -1)) if state is not None else -1
        bases = select(state.arrays, "basis.") if state is not None else {}
        if msg.config["mode"] == "dense":
            return self.fill_frozen(select(msg.arrays, "model."), state, model), bases, held
        cache, steps = replay_steps(msg, state, rnd)
        for s, inc in steps:
            bid = int(msg.config[f"basis_id.{s}"])
            if bid != held:
                bases, held = self.rule.client_bases(msg, bid, plan, cache), bid
            decay = float(msg.config[f"decay.{s}"])
            for k, spec in plan.items():
                cache[k] = apply_increment(cache[k], spec, bases[k], inc[k], decay)
            for k, v in inc.items():
                if k not in plan:  # 16-bit transport: an unprojected tensor's increment
                    cache[k] = add_increment(cache[k], v)
        cache.update(select(msg.arrays, "dense."))
        return cache, bases, held
