"""How far apart are the Eq. 19 scores of Meta-BayFL's candidate rates, against the spread of
one rate's score from trial seed to trial seed? (Seed 001's per-epoch search, issue 33.)

From a Meta-BayFL run's last global model (its folder's ``checkpoint.pt``: a run made on this
machine, since checkpoints stay out of git), for each client: a meta split d, then 8 searches
with different trial seeds at the round's start and again after 2 local epochs at 1e-3; prints
each candidate's score (the MC-predictive NLL on d after its trial steps) as mean ± sample std
over the 8 searches, and the 8 picks.

    python experiments/search_noise.py \\
        experiments/runs/bayes_table4/cnn/bayes_table4-base/meta_bayfl_mcd/seed-43
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics

import torch

from fedlore.algorithms.bayes import MetaBayFL
from fedlore.algorithms.bayes_search import elbo_kl_term
from fedlore.algorithms.meta_lr import meta_split
from fedlore.bayes import is_bayesian, sampling
from fedlore.experiment_parts import make_algorithm
from fedlore.train.local import local_train
from fedlore.trained import load_trained

SEARCHES = 8
EPOCHS = 2


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a Meta-BayFL run folder with its checkpoint.pt")
    args = parser.parse_args()
    run = load_trained(args.run)
    algo = make_algorithm(run.method, run.cfg)
    if not isinstance(algo, MetaBayFL):
        raise SystemExit(f"search_noise: {args.run} is a {run.method} run, not a Meta-BayFL one")
    for cid in range(run.fed.num_clients):
        data = run.fed.client(cid)
        model = algo.prepare_model(copy.deepcopy(run.model))
        fit, meta = meta_split(data, algo.meta_fraction, algo.meta_split, 1234 + cid)
        terms = [elbo_kl_term(algo.beta_kl, len(fit))] if is_bayesian(model) else []
        opt = algo.make_optimizer(model)
        steps = EPOCHS * math.ceil(len(fit) / algo.train.batch_size)
        for epochs in (0, EPOCHS):
            if epochs:  # train on as the client would, at the fixed rate
                with sampling(model, True):
                    batches = data.batches(
                        algo.train.batch_size, steps, torch.Generator().manual_seed(cid), 0
                    )
                    local_train(model, batches, opt, [algo.train.lr] * steps, loss_terms=terms)
            scores, picks = [], []
            for s in range(SEARCHES):
                with sampling(model, True):
                    lr, score = algo.select_lr(model, opt, fit, meta, terms, 1000 * cid + s)
                scores.append(score)
                picks.append(lr)
            cells = [
                f"{lr:g}: {statistics.mean(col):.4f} ± {statistics.stdev(col):.4f}"
                for lr, col in zip(algo.candidate_lrs, zip(*scores, strict=True), strict=True)
            ]
            print(f"client {cid} after {epochs} epochs: {', '.join(cells)}; picks {picks}")


if __name__ == "__main__":
    main()
