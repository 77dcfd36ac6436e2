"""The refusals of the model against the data, and the preflight that runs every check for every
method of an experiment before any run folder is touched (see :mod:`fedlore.checks`)."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

from fedlore import registry
from fedlore.algorithm import Algorithm, Capabilities
from fedlore.checks.stopping import check_early_stopping
from fedlore.config import Config, ConfigError
from fedlore.data.checks import DataWarning
from fedlore.settings import not_applicable
from fedlore.train.metrics import trial_problems

if TYPE_CHECKING:
    from torch import nn

    from fedlore.data.federation import Federation

log = logging.getLogger("fedlore.checks")


class Declares(Protocol):
    """A method class: it holds its :class:`~fedlore.algorithm.Capabilities` record."""

    capabilities: ClassVar[Capabilities]


def check_site_data(cfg: Config, deployed: bool) -> None:
    """``flower.site_data`` needs a deployment (``deployed``: the run's transport is a Flower
    Grid's).

    Raises:
        ConfigError: for ``flower.site_data=true`` in process or in the simulation.
    """
    if cfg.flower.site_data and not deployed:
        raise ConfigError(
            "flower.site_data=true: each site's data stay on its SuperNode, so this run needs a "
            "`flwr run` deployment (scripts/flower_local_federation.sh with SITES=...); "
            "in process or in the simulation, leave it false"
        )


def check_params(cfg: Config, model: nn.Module) -> None:
    """Every ``params.exclude`` prefix names at least one tensor of ``model`` (a typo would
    silently project or adapt the head); ``params.freeze`` is checked by each method.

    Raises:
        ConfigError: naming the prefixes that match nothing.
    """
    names = list(model.state_dict())
    unused = [p for p in cfg.params.exclude if not any(n.startswith(p) for n in names)]
    if unused:
        raise ConfigError(
            f"params.exclude prefix(es) {unused} match no tensor of model {cfg.model.name!r} "
            f"(names look like {names[:3]})"
        )


def check_model_output(cfg: Config, model: nn.Module, fed: Federation) -> None:
    """A classifier maps a batch ``[B, *input_shape]`` to logits ``[B, num_classes]``: checked
    on two training inputs (test inputs on a server without a pool: ``flower.site_data``), in
    eval mode without gradients (no buffer or random draw changes). A model that returned
    another shape (its argmax, one score per example) had every client's update rejected in
    round 0 with torch's message about the loss.

    Raises:
        ConfigError: naming the model, the shape it returned and the one expected, or the
            error its forward raised.
    """
    if fed.task != "classification":
        return
    import torch

    x = (fed.pool.x if len(fed.pool.x) else fed.central_test.x)[:2]  # site data: no pool
    if not len(x):
        return
    was_training = model.training
    model.eval()
    # a CUDA model's own draws (MC dropout's masks) come from the device's generator
    cuda = [x.device.index or 0] if x.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            out = model(x)
    except Exception as e:  # the model's own bug: one line here, not a traceback per client
        raise ConfigError(
            f"model {cfg.model.name!r} fails on inputs {tuple(x.shape)}: {type(e).__name__}: {e}"
        ) from e
    finally:
        model.train(was_training)
    want = (len(x), fed.num_classes)
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape == want:
        return
    got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    raise ConfigError(
        f"model {cfg.model.name!r} returns {got} for inputs {tuple(x.shape)}; a classifier "
        f"returns float logits of shape {want} ([batch, num_classes])"
    )


def check_model_fits_data(model: str, fed: Federation) -> None:
    """Token-id data (text sources) needs a model that takes token ids, and image or feature
    data a model that does not; a pre-training corpus needs a causal language model, and
    labelled data a classifier.

    Raises:
        ConfigError: naming the model, the data's input dtype and the models that fit.
    """
    factory = registry.get("model", model)
    takes_tokens = bool(getattr(factory, "takes_token_ids", False))
    causal = bool(getattr(factory, "causal_lm", False))
    lm_data = fed.task == "language_modeling"
    if lm_data != causal:
        raise ConfigError(
            f"model {model!r} is "
            + ("a causal language model" if causal else "a classifier")
            + f", but data source {fed.source!r} is "
            + ("a pre-training corpus: use model.name=llama" if lm_data else "labelled")
        )
    tokens = not fed.pool.x.is_floating_point()
    if tokens and not takes_tokens:
        raise ConfigError(
            f"model {model!r} takes float inputs, but the data are token ids ({fed.pool.x.dtype}, "
            "a text source): use model.name=text_encoder"
        )
    if takes_tokens and not tokens:
        raise ConfigError(
            f"model {model!r} takes token ids, but the data are float features "
            f"({fed.pool.x.dtype}): use a text source (data.name=fortunes, text_csv, text_jsonl)"
        )


def check_eval(cfg: Config, fed: Federation) -> None:
    """``eval.metrics`` needs a classifier (``top5_accuracy`` more than five classes), and
    each metric must score a trial predictive (:func:`~fedlore.train.metrics.trial_problems`)
    for the central test set's labels and, with ``eval.local``, for each client's test split.
    Per-client evaluation (``eval.clients``, G-local; ``eval.local``, P-local) needs local
    test splits, which a pre-training corpus does not have (every training document belongs to
    exactly one client's training data), nor LEAF users whose test examples lie with other users
    under ``data.local_test=by_id``, nor a client too small to hold an example out.

    Raises:
        ConfigError: for ``eval.metrics`` on language or regression data; for
            ``eval.clients`` or ``eval.local`` on a pre-training corpus, or where no client has a
            local test split, naming why and the ways out (a warning, once per process, names
            the clients without one when only some lack it: they are left out).
    """
    if cfg.eval.metrics and fed.task != "classification":
        raise ConfigError(
            f"eval.metrics {cfg.eval.metrics} score classifiers; {fed.source!r} is a "
            f"{fed.task.replace('_', ' ')} task (its scores: "
            f"{'perplexity' if fed.task == 'language_modeling' else 'rmse'} and loss); "
            "set eval.metrics=[]"
        )
    if "top5_accuracy" in cfg.eval.metrics and fed.num_classes <= 5:
        raise ConfigError(
            f"eval.metrics: top5_accuracy needs more than 5 classes; {fed.source!r} has "
            f"{fed.num_classes}"
        )
    if cfg.eval.metrics:
        problems = trial_problems(cfg.eval.metrics, fed.central_test.y, fed.num_classes)
        if problems:
            raise ConfigError("\n".join(problems))
    asked = [
        k for k, on in (("eval.clients", cfg.eval.clients), ("eval.local", cfg.eval.local)) if on
    ]
    if not asked:
        return
    settings = " / ".join(f"{k}=true" for k in asked)
    off = " and ".join(f"{k}=false" for k in asked)
    if fed.task == "language_modeling":
        raise ConfigError(
            f"{settings}: {fed.source!r} clients have no local test split (the common "
            f"validation corpus is evaluated every eval.every rounds); set {off}"
        )
    empty = [c for c in range(fed.num_clients) if len(fed.client(c).test) == 0]
    if cfg.eval.local and cfg.eval.metrics:  # each client scores its own split: try them all
        problems = []
        for c in range(fed.num_clients):
            where = f"client {c}'s test split (eval.local scores each client's own)"
            problems += trial_problems(
                cfg.eval.metrics, fed.client(c).test.y, fed.num_classes, where, limit=0
            )
            if len(problems) >= 3:
                break
        if problems:
            raise ConfigError("\n".join(problems))
    if not empty:
        return
    by_id = cfg.data.local_test == "by_id" or (
        cfg.data.local_test is None and cfg.partition.name == "natural"
    )
    if by_id:
        why = (
            "under data.local_test=by_id a client's test examples are those of its own ids, and "
            "these clients' ids have none (LEAF split by user: its test users are not its "
            "training users)"
        )
        way = "set data.local_test=split (a share of each client's training data held out)"
    else:
        why = (
            f"a client holds out data.test_fraction={cfg.data.test_fraction} of its training "
            "examples, and one needs at least two examples to hold one out"
        )
        way = "use fewer clients or more data (data.fraction)"
    if len(empty) == fed.num_clients:
        raise ConfigError(
            f"{settings}: none of the {fed.num_clients} clients has a local test split: {why}; "
            f"{way}, or set {off}"
        )
    shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
    text = (
        f"{' / '.join(asked)}: {len(empty)} of the {fed.num_clients} clients have no local test "
        f"split and are left out of the per-client metrics (clients {shown}): {why}"
    )
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, DataWarning, stacklevel=2)


_WARNED: set[str] = set()


def check_tokenizer_matches_model(cfg: Config, fed: Federation) -> None:
    """Text data must be tokenized with the text model's own tokenizer: ``data.tokenizer`` and
    ``model.kwargs.path`` name the same folder, or folders whose tokenizers (as Hugging Face
    loads them: ``tokenizer.json`` when present, else ``vocab.txt``) map the same tokens to the
    same ids with the same pad id; and no token id reaches past the model's embedding table
    (``vocab_size`` of the folder's ``config.json``, or of ``model.kwargs.config_overrides``).

    Raises:
        ConfigError: naming the folders and what differs.
    """
    if fed.pool.x.is_floating_point() or fed.task == "language_modeling":
        return  # a pre-training model takes its vocabulary size from the data's tokenizer
    from fedlore.data.text import load_tokenizer
    from fedlore.models.text import resolve_text_folder

    try:
        data_dir = resolve_text_folder(cfg.data.tokenizer).resolve()
    except FileNotFoundError as e:
        raise ConfigError(f"data.tokenizer: {e}") from e
    try:
        model_dir = resolve_text_folder(cfg.model.kwargs.get("path")).resolve()
    except FileNotFoundError as e:
        raise ConfigError(f"model.kwargs.path: {e}") from e
    data_tok = load_tokenizer(data_dir)
    if data_dir != model_dir:
        model_tok = load_tokenizer(model_dir)
        differs = []
        ours, theirs = data_tok.get_vocab(), model_tok.get_vocab()
        if ours != theirs:
            moved = sum(1 for t, i in ours.items() if theirs.get(t) != i)
            differs.append(
                f"vocabularies ({len(ours)} vs {len(theirs)} tokens; {moved} of the data's "
                "tokens have another id or none in the model's)"
            )
        if data_tok.pad_token_id != model_tok.pad_token_id:
            differs.append(f"pad ids ({data_tok.pad_token_id} vs {model_tok.pad_token_id})")
        if differs:
            raise ConfigError(
                f"data.tokenizer={str(data_dir)!r} and model.kwargs.path={str(model_dir)!r} have "
                f"different {' and '.join(differs)}: the data would be tokenized for another "
                "model. Set data.tokenizer to the model's folder (or leave both unset for "
                "all-MiniLM-L6-v2)."
            )
    overrides = cfg.model.kwargs.get("config_overrides") or {}
    vocab_size = overrides.get("vocab_size")
    if vocab_size is None:
        vocab_size = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab_size, int) and len(data_tok) > vocab_size:
        raise ConfigError(
            f"the tokenizer in {str(data_dir)!r} has {len(data_tok)} tokens but the model's "
            f"embedding table has vocab_size={vocab_size} rows: ids past it cannot be embedded"
        )


def preflight(
    cfg: Config,
    fed: Federation,
    build: Callable[[], nn.Module],
    start: Callable[[str], Algorithm],
) -> list[tuple[str, Algorithm]]:
    """Refuse a config that would fail part-way: the model fits the data and returns logits of
    its shape, the tokenizer is the model's, and every method accepts ``params`` and its
    hyperparameters on the real model (its server state is built once and dropped). Runs
    before any run folder is touched. Returns every method's name with the method as built.
    Warns about a method that keeps layers on the clients
    (:attr:`~fedlore.algorithm.Capabilities.keeps_layers_local`) in a run without
    ``eval.local``.

    Args:
        build: the first seed's model factory (:func:`fedlore.experiment_parts.model_factory`).
        start: builds a method by name and starts its server on a fresh model (and, under secure
            aggregation, checks its round), raising ValueError (ConfigError included) for a
            problem; the driver passes it (:func:`fedlore.experiment_parts.try_method`), so nothing
            here builds a method itself.

    Raises:
        ConfigError: naming the method and the problem.
    """
    check_model_fits_data(cfg.model.name, fed)
    check_tokenizer_matches_model(cfg, fed)
    check_eval(cfg, fed)
    check_early_stopping(cfg, fed)
    model = build()
    check_params(cfg, model)
    check_model_output(cfg, model, fed)
    problems: list[str] = []
    accepted: list[tuple[str, Algorithm]] = []
    for name in cfg.algorithms:  # every method's problems at once, not only the first's
        try:  # a fresh model per method: a method may convert its workspace (a BNN)
            algo = start(name)
        except ValueError as e:  # ConfigError included
            text = str(e)
            prefix = f"method {name!r}"
            problems.append(text if text.startswith(prefix) else f"{prefix}: {e}")
            continue
        accepted.append((name, algo))
        if algo.caps().keeps_layers_local and not cfg.eval.local:
            log.warning(
                "%s keeps part of the model on each client (its server's copy stays at its "
                "initialization), so its global scores are of a model no client uses; set "
                "eval.local=true for its real score, each client's own model (P-local)",
                name,
            )
    if problems:
        raise ConfigError("\n".join(problems))
    return accepted


def warn_own_optimizer(cfg: Config, name: str, algo: Algorithm) -> None:
    """Warn that ``optim.name`` does not reach method ``name`` when it keeps an inner optimizer
    of its own (it has no ``optimizer`` setting)."""
    keeps_own = not hasattr(algo, "optimizer") or "optimizer" in not_applicable(type(algo))
    if cfg.optim.name != "adam" and keeps_own:
        log.warning(
            "optim.name=%s sets the inner optimizer of the projected methods; %s keeps its "
            "own (method.%s.local_optimizer where it has one)",
            cfg.optim.name,
            name,
            name,
        )
