"""User-level local differential privacy (``dp.mode: local``): every client noises its own upload.

Central DP (:mod:`fedlore.privacy.dp`) trusts someone with the clipped uploads: the server (DP
alone) or, under secure aggregation, the protocol that hands the server only their sum. Local
DP trusts no one. Each sampled client clips its whole upload vector ``x`` to L2 norm ``C``
(:func:`~fedlore.privacy.dp.clip_upload`, as under central DP) and adds ``N(0, (σC)²)`` to every
coordinate of the clipped vector (:func:`add_local_noise`) before anything leaves it. The noise
comes from OS entropy (:class:`~fedlore.privacy.randomness.SecureSource`), never from the run
seed or the client's training generator, so neither the server, nor the other clients, nor
anyone who knows the seed can regenerate and subtract it (``dp.reproducible_noise`` draws it from
the seed: the debugging mode with no privacy, as under central DP). The server sums the noised
uploads and divides by their number, with uniform weights, and adds no noise of its own.

**Accounting.** Adjacency is *any two datasets of one client* (user-level LDP): the client's
clipped upload lies in the C-ball whatever its data, so changing all of them moves it by at most
``2C`` in L2. One upload is therefore the Gaussian mechanism of L2 sensitivity ``2C`` and noise
std ``σC``: noise multiplier ``σ/2`` relative to the sensitivity. dp-accounting's
``GaussianDpEvent`` defines its ``noise_multiplier`` as exactly that ratio ("If the norms of the
values are bounded ||v_i|| <= C, the noise_multiplier is defined as s / C", ``dp_event.py``),
and its RDP accountant composes a ``GaussianDpEvent(z)`` as the Gaussian of RDP ``α / (2 z²)``
whatever the neighbouring relation (``_compute_rdp_poisson_subsampled_gaussian`` at ``q = 1``;
its docstring: "noise_multiplier: The ratio of the standard deviation of the Gaussian noise to
the l2-sensitivity"); ``GaussianDpEvent(σ/2)`` gives ``α (2C)² / (2 σ² C²)``, the Gaussian's own
RDP. Its PLD accountant under ``REPLACE_ONE`` doubles the sensitivity itself and is given ``σ``
(:func:`~fedlore.privacy.dp.pld_event`). That is the unsampled event of central DP: one client's
release is central DP's round of full participation, so :func:`local_epsilon` is
:func:`~fedlore.privacy.dp.epsilon_spent` with one client of one (the same ``rdp`` / ``pld``
accountants, the same checks against the exact Gaussian-DP value).

The server chooses who takes part, so sampling amplifies nothing against it: client k's ε is
the Gaussian self-composed over the exchanges it took part in (:class:`Uploads`, a round counted
for every client sent the model in it, whether or not its upload arrived: it may have left the
client; setup exchanges included, as central DP counts them), and a run reports the largest ε
over its clients (``dp_epsilon``: the worst-off client's). ``dp.epsilon`` solves σ for the worst
case, a client in every exchange of the run (:func:`local_noise_for_epsilon`).

With secure aggregation the two compose: each client adds its whole ``N(0, (σC)²)`` inside the
masked upload, so the local guarantee holds even against the server with every other client
(who could unmask it), and the server sees only the sum of noised uploads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fedlore.privacy.dp import epsilon_spent, noise_for_epsilon
from fedlore.privacy.randomness import NoiseSource
from fedlore.types import Arrays

UPLOADS_KEY = "privacy.uploads"
"""Server-state value under local DP: each client's count of exchanges (so a resumed run goes
on counting from where the killed one was), as ``client:count`` pairs joined by commas."""


def local_epsilon(
    noise_multiplier: float, delta: float, uploads: int, *, accountant: str = "rdp"
) -> float:
    """ε at ``delta`` of one client after ``uploads`` locally noised uploads (module docstring):
    ``uploads`` compositions of ``GaussianDpEvent(σ / 2)`` (L2 sensitivity 2C, noise σC), never
    amplified by sampling; ``inf`` for σ = 0, ``0`` for no upload.

    Raises:
        ValueError: for an unknown ``accountant``.
    """
    return epsilon_spent(noise_multiplier, delta, uploads, 1, 1, accountant=accountant)


def local_noise_for_epsilon(
    epsilon: float, delta: float, exchanges: int, *, accountant: str = "rdp"
) -> float:
    """The smallest σ (within :data:`~fedlore.privacy.dp.SIGMA_SEARCH_RTOL`) whose
    :func:`local_epsilon` after ``exchanges`` uploads is at most ``epsilon``: the worst case, a
    client that uploads in every exchange of the run
    (:func:`~fedlore.privacy.dp.noise_for_epsilon` for one client of one).

    Raises:
        ValueError: as :func:`~fedlore.privacy.dp.noise_for_epsilon`.
    """
    every = "with one client in every one (the worst case)"
    return noise_for_epsilon(epsilon, delta, exchanges, 1, 1, accountant=accountant, whom=every)


def add_local_noise(
    arrays: Arrays, std: float, noise: NoiseSource, rnd: int, client_id: int
) -> Arrays:
    """``arrays`` (already clipped) plus ``N(0, std²)`` on every coordinate: one draw of
    ``noise`` for the whole upload (sorted key order, float64), added in float64 and returned in
    each array's own dtype and device."""
    keys = sorted(arrays)
    total = sum(arrays[k].numel() for k in keys)
    draw = noise.gaussian(total, std, rnd, client_id)
    out: Arrays = {}
    at = 0
    for k in keys:
        v = arrays[k]
        n = v.numel()
        part = draw[at : at + n].reshape(v.shape).to(v.device)
        out[k] = (v.detach().double() + part).to(v.dtype).contiguous()
        at += n
    return {k: out[k] for k in arrays}


@dataclass
class Uploads:
    """Each client's count of the exchanges it took part in under local DP.

    Attributes:
        counts: client id -> exchanges it was sent the model in (its noised upload may have
            left it), setup exchanges included.
    """

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, clients: Iterable[int]) -> None:
        """Count one exchange for each of ``clients`` (each once, however often named)."""
        for c in set(clients):
            self.counts[c] = self.counts.get(c, 0) + 1

    def most(self) -> int:
        """The largest count: the worst-off client's exchanges (0 before any)."""
        return max(self.counts.values(), default=0)

    def encode(self) -> str:
        """The counts as ``client:count`` pairs joined by commas (sorted by client)."""
        return ",".join(f"{c}:{n}" for c, n in sorted(self.counts.items()))

    def restore(self, text: str) -> None:
        """Replace the counts by those :meth:`encode` wrote.

        Raises:
            ValueError: naming the text when it is not such a list.
        """
        counts: dict[int, int] = {}
        try:
            for item in filter(None, text.split(",")):
                c, _, n = item.partition(":")
                counts[int(c)] = int(n)
        except ValueError:
            raise ValueError(
                f"{UPLOADS_KEY} = {text!r} is not a list of client:count pairs"
            ) from None
        if any(n < 0 for n in counts.values()):
            raise ValueError(f"{UPLOADS_KEY} = {text!r} holds a negative count")
        self.counts = counts
