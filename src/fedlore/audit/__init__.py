"""How much a client's upload leaks about its training data: gradient inversion attacks against
the upload of each method (:mod:`fedlore.audit.inversion`), with the attacker's model of each
method's local round (:mod:`fedlore.audit.uploads`). ``benchmarks/leakage.py`` runs them.

Threat model: an honest-but-curious server. It knows the model it broadcast (and FedLore's
bases), the local training settings it sent (learning rate, steps, optimizer), the batch size and
the task's classes, and it sees one client's upload of one round, in the clear (no secure
aggregation) or, under DP, as the clipped upload plus the mechanism's Gaussian noise with the
other clients' contributions known (the most an attacker can subtract). It tries to reconstruct
the client's inputs. It is an audit, not a guarantee: a failed attack bounds nothing, a
successful one shows a leak.
"""
