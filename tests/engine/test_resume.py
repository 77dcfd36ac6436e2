"""Kill-and-resume gives the run an uninterrupted one would have given, and the CLI around it.

``run_one(..., stop_after=k)`` simulates a kill right after round ``k`` (its checkpoint is on
disk); ``run_one(..., resume=True)`` continues from it. Every metric except wall time must match
an uninterrupted run in another output directory, round by round.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.cli import main
from fedlore.config import Config, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

SEED = 3
ROUNDS = 4


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=resume",
            "num_clients=3",
            f"rounds={ROUNDS}",
            "local_steps=2",
            "batch_size=16",
            "lr=3e-3",
            "rank=4",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _is_timing(key: str) -> bool:
    """Wall-clock measurements (``wall_s``, ``eval_s``, ``wall_s_per_round``, ...)."""
    return key.endswith("_s") or "_s_" in key


def _no_timing(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not _is_timing(k)}


_REFERENCE: dict[tuple[str, tuple[str, ...]], tuple[dict[str, Any], Path]] = {}


def _reference(
    method: str, factory: pytest.TempPathFactory, *extra: str
) -> tuple[dict[str, Any], Path]:
    """Uninterrupted run (cached per method and config): its summary and its run directory."""
    key = (method, extra)
    if key not in _REFERENCE:
        cfg = _cfg(factory.mktemp("reference"), *extra)
        summary = run_one(cfg, method, SEED)
        assert summary is not None
        _REFERENCE[key] = (summary, run_dir(cfg, method, SEED))
    return _REFERENCE[key]


def _assert_same_run(
    got: Path, want: Path, got_summary: dict[str, Any], want_summary: dict[str, Any]
) -> None:
    assert _no_timing(got_summary) == _no_timing(want_summary)
    assert json.loads((got / "summary.json").read_text()) == got_summary
    a, b = _rows(got / "metrics.jsonl"), _rows(want / "metrics.jsonl")
    assert [r["round"] for r in a] == [r["round"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert _no_timing(ra) == _no_timing(rb), ra["round"]
    # the final server state and client store are the same tensors
    ra_, sa, store_a = Checkpointer.load(got / "checkpoint.pt")
    rb_, sb, store_b = Checkpointer.load(want / "checkpoint.pt")
    assert ra_ == rb_ == ROUNDS - 1
    assert sa.values == sb.values and sa.arrays.keys() == sb.arrays.keys()
    for k in sa.arrays:
        assert torch.equal(sa.arrays[k], sb.arrays[k]), k
    assert store_a.to_dict().keys() == store_b.to_dict().keys()
    for cid, st in store_a.to_dict().items():
        other = store_b.to_dict()[cid]
        assert st["values"] == other["values"]
        for k, t in st["arrays"].items():
            assert torch.equal(t, other["arrays"][k]), (cid, k)


KILLS = [
    ("fedlore", -1),  # right after the setup exchange (P^0 from client gradients)
    ("fedlore", 1),  # a middle round
    ("fedlore", ROUNDS - 2),  # the last round before the end
    ("fedfull", -1),  # killed before its first round: nothing to resume from
    ("fedfull", 0),
    ("fedfull", 1),
    ("fedfull", ROUNDS - 2),
    ("scaffold", 1),  # its server c and each client's c_i come back from the checkpoint
    ("feddyn", 1),  # its server h and each client's h_k, likewise
    ("fednova", 1),  # its parameter list (server state values) comes back from the checkpoint
    ("qffl", 1),  # likewise, and each client's loss F_k measured anew from the restored model
    ("fedper", 1),  # each client's head comes back from the checkpoint's client store
    ("fedbn", 1),  # each client's BatchNorm layers, running statistics included
    ("fedrep", 1),  # each client's head, trained before the body in every round
    ("moon", 1),  # each client's previous model (prev.*), the negative of its contrastive term
    ("apfl", 1),  # each client's v_i and alpha_i (personal.*, apfl.alpha)
    ("perfedavg", 1),  # no client state: its D' and D'' streams come from the round generator
    ("heterofl", 1),  # its rate salt and width plan (server state values); rolling windows
]
MODEL: dict[str, tuple[str, ...]] = {
    "fedbn": ("model.kwargs={hidden: [32], norm: batch}",),
    # sub-models of three widths whose windows move with the round (so the round counter
    # matters after the resume)
    "heterofl": ("method.heterofl.rates=[1.0, 0.5, 0.25]", "method.heterofl.extraction=rolling"),
}
"""A method's own settings (FedBN refuses a model without BatchNorm; HeteroFL's rolling
extraction)."""


@pytest.mark.parametrize(("method", "kill_after"), KILLS)
def test_resume_matches_uninterrupted_run(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, method: str, kill_after: int
) -> None:
    want_summary, want = _reference(method, tmp_path_factory, *MODEL.get(method, ()))
    cfg = _cfg(tmp_path, *MODEL.get(method, ()))
    out = run_dir(cfg, method, SEED)
    assert run_one(cfg, method, SEED, stop_after=kill_after) is None
    assert not (out / "summary.json").exists()
    done = [r["round"] for r in _rows(out / "metrics.jsonl")]
    start = -1 if method == "fedlore" else 0
    assert done == list(range(start, kill_after + 1))
    if done:
        assert Checkpointer.load(out / "checkpoint.pt")[0] == kill_after
    got_summary = run_one(cfg, method, SEED, resume=True)
    assert got_summary is not None
    assert got_summary["rounds"] == ROUNDS
    assert got_summary["final_accuracy"] is not None
    _assert_same_run(out, want, got_summary, want_summary)


@pytest.mark.parametrize(
    "extra",
    [
        ("compression.kind=topk", "compression.fraction=0.05"),
        ("compression.kind=qsgd", "compression.levels=7", "compression.error_feedback=true"),
    ],
    ids=["topk", "qsgd-ef"],
)
def test_resume_with_compressed_uploads(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, extra: tuple[str, ...]
) -> None:
    """FedAvg with upload compression: each client's error-feedback memory (``ef.*``) lives in
    the client store the checkpoint holds, and QSGD's codes come from the client's round
    generator, so the resumed run is the uninterrupted one, bit for bit."""
    want_summary, want = _reference("fedavg", tmp_path_factory, *extra)
    cfg = _cfg(tmp_path, *extra)
    out = run_dir(cfg, "fedavg", SEED)
    assert run_one(cfg, "fedavg", SEED, stop_after=1) is None
    _, _, store = Checkpointer.load(out / "checkpoint.pt")
    states = store.to_dict()
    assert len(states) == cfg.num_clients  # not vacuous: every client holds its memory
    for st in states.values():
        memory = {k: t for k, t in st["arrays"].items() if k.startswith("ef.")}
        assert memory and any(bool(t.abs().sum() > 0) for t in memory.values())
    got_summary = run_one(cfg, "fedavg", SEED, resume=True)
    assert got_summary is not None
    _assert_same_run(out, want, got_summary, want_summary)


def test_fedlore_clients_keep_state_across_the_kill(tmp_path: Path) -> None:
    """The store really is part of the checkpoint (else 'resume matches' would be vacuous for
    stateless clients only)."""
    cfg = _cfg(tmp_path)
    run_one(cfg, "fedlore", SEED, stop_after=0)
    _, _, store = Checkpointer.load(run_dir(cfg, "fedlore", SEED) / "checkpoint.pt")
    assert len(store) == cfg.num_clients
    assert store.nbytes() > 0
    run_one(cfg, "fedfull", SEED, stop_after=0)
    _, _, store = Checkpointer.load(run_dir(cfg, "fedfull", SEED) / "checkpoint.pt")
    assert len(store) == 0


def test_two_kills_then_resume(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    want_summary, want = _reference("fedlore", tmp_path_factory)
    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedlore", SEED, stop_after=-1) is None
    assert run_one(cfg, "fedlore", SEED, resume=True, stop_after=1) is None
    got = run_one(cfg, "fedlore", SEED, resume=True)
    assert got is not None
    _assert_same_run(run_dir(cfg, "fedlore", SEED), want, got, want_summary)


def test_resume_with_the_auto_subspace_route(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``candidate_svd: auto`` (the default) with settings under which it takes the seeded
    subspace route for the 32 x 64 hidden layer (``2 ((2·1 + 1)(4 + 1) + 1) = 32 <= 32``): the
    resumed run equals the uninterrupted one bit for bit (the sketch columns come from the
    client's per-round generator, not from a generator state that a kill would lose)."""
    import fedlore.algorithms.lowrank as lowrank_mod

    routes: list[str] = []
    inner: Any = lowrank_mod.top_left_singular

    def spy(mat: torch.Tensor, rank: int, method: str = "exact", *a: Any, **k: Any) -> Any:
        routes.append(method)
        return inner(mat, rank, method, *a, **k)

    monkeypatch.setattr(lowrank_mod, "top_left_singular", spy)
    extra = ("method.fedlore.svd_oversample=1", "method.fedlore.svd_niter=1")
    want_summary, want = _reference("fedlore", tmp_path_factory, *extra)
    assert "subspace" in routes and "exact" in routes  # rounds / the setup exchange
    cfg = _cfg(tmp_path, *extra)
    assert run_one(cfg, "fedlore", SEED, stop_after=1) is None
    got = run_one(cfg, "fedlore", SEED, resume=True)
    assert got is not None
    _assert_same_run(run_dir(cfg, "fedlore", SEED), want, got, want_summary)


def test_a_run_of_the_old_exact_default_is_not_resumed_under_auto(tmp_path: Path) -> None:
    """A FedLore run recorded with ``candidate_svd: exact`` (the default before issue 30) is
    refused under the new default, naming the setting, and resumes with it restored; one
    recorded before ``hyper`` existed is refused (FedLore's default changed since)."""
    from fedlore.config import ConfigError

    old = _cfg(tmp_path, "method.fedlore.candidate_svd=exact")
    assert run_one(old, "fedlore", SEED, stop_after=0) is None
    with pytest.raises(ConfigError, match=r"hyper\.candidate_svd: 'exact' -> 'auto'"):
        run_one(_cfg(tmp_path), "fedlore", SEED, resume=True)
    assert run_one(old, "fedlore", SEED, resume=True, stop_after=1) is None  # restored: resumes
    path = run_dir(old, "fedlore", SEED) / "config.json"
    recorded = json.loads(path.read_text())
    del recorded["hyper"]  # as written before fedlore recorded it
    path.write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="behaved differently by default"):
        run_one(old, "fedlore", SEED, resume=True)


@pytest.mark.parametrize("method", ["fedlore", "fedfull"])
def test_torn_temp_checkpoint_and_torn_metrics_line(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    """A kill inside ``atomic_save`` leaves ``checkpoint.pt.tmp`` garbage; a kill between the
    metrics row and the checkpoint leaves a row (maybe half written) past the checkpoint."""
    want_summary, want = _reference(method, tmp_path_factory, *MODEL.get(method, ()))
    cfg = _cfg(tmp_path, *MODEL.get(method, ()))
    out = run_dir(cfg, method, SEED)
    run_one(cfg, method, SEED, stop_after=1)
    (out / "checkpoint.pt.tmp").write_bytes(b"\x80\x02garbage, not a torch file" * 10)
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"round": 2, "accuracy": 0.99, "wall_s": 0.0}) + "\n")
        f.write('{"round": 3, "accur')  # torn last line
    got = run_one(cfg, method, SEED, resume=True)
    assert got is not None
    _assert_same_run(out, want, got, want_summary)
    assert not (out / "checkpoint.pt.tmp").exists()  # replaced by the next atomic save


@pytest.mark.parametrize("committed", [True, False])
def test_a_stale_temporary_file_is_never_read_and_the_resume_deletes_it(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, committed: bool
) -> None:
    """A kill inside an atomic write leaves ``<name>.tmp``, here whole (a later round's
    checkpoint, killed before its rename): the resume continues from ``checkpoint.pt``, or from
    the first round when the kill fell on the first checkpoint (``committed`` False), never from
    the temporary file, and deletes every such file of its own; a user's files stay."""
    want_summary, want = _reference("fedfull", tmp_path_factory)
    cfg = _cfg(tmp_path)
    out = run_dir(cfg, "fedfull", SEED)
    run_one(cfg, "fedfull", SEED, stop_after=1)
    later = torch.load(out / "checkpoint.pt", weights_only=True)
    torch.save({**later, "round": 2}, out / "checkpoint.pt.tmp")
    if not committed:
        (out / "checkpoint.pt").unlink()
    for name in ("summary.json", "config.json", "metrics.jsonl", "dp_ledger.json"):
        (out / f"{name}.tmp").write_text('{"torn": ')
    mine = ["notes.tmp", "checkpoint.pt.tmp.bak", "checkpoint.tmp", "summary.json.old.tmp"]
    for name in mine:
        (out / name).write_text("the user's")
    assert run_one(cfg, "fedfull", SEED, resume=True, stop_after=2) is None  # killed again
    assert [r["round"] for r in _rows(out / "metrics.jsonl")] == [0, 1, 2]
    assert sorted(p.name for p in out.iterdir() if "tmp" in p.name) == sorted(mine)
    got = run_one(cfg, "fedfull", SEED, resume=True)
    assert got is not None
    _assert_same_run(out, want, got, want_summary)
    assert all((out / name).read_text() == "the user's" for name in mine)


def test_stale_temporary_files_of_spilled_states_and_of_finished_runs_go(tmp_path: Path) -> None:
    """A spilled client state's ``<client>.<generation>.pt.tmp`` goes (no checkpoint names
    one), and a plain rerun of a finished run clears what a kill left in its folder."""
    from fedlore.engine.runstart import remove_stale_temps
    from fedlore.experiment import run_experiment

    spill = tmp_path / "client_states"
    spill.mkdir()
    for name in ("3.7.pt.tmp", "3.7.pt", "notes.pt.tmp", "3.pt.tmp", "x.tmp"):
        (spill / name).write_text("x")
    remove_stale_temps(tmp_path / "run", spill)
    assert sorted(p.name for p in spill.iterdir()) == [
        "3.7.pt",
        "3.pt.tmp",
        "notes.pt.tmp",
        "x.tmp",
    ]
    cfg = _cfg(tmp_path, "algorithms=[fedfull]", f"seeds=[{SEED}]")
    run_experiment(cfg)
    out = run_dir(cfg, "fedfull", SEED)
    (out / "summary.json.tmp").write_text('{"torn": ')
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "summary.json.tmp"}
    run_experiment(cfg)  # reports the finished run
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(
    ("method", "cut", "said"),
    [
        ("fedfull", "middle", "lacks the rows of round 1,"),
        ("fedfull", "tail", "lacks the rows of round 2,"),
        ("fedfull", "all", "lacks the rows of rounds 0 to 2,"),
        ("fedfull", "twice", "holds round 1 twice,"),
        ("fedlore", "setup", "lacks the rows of round -1,"),  # its basis-only setup round
        ("fedlore", "all", "lacks the rows of rounds -1 to 2,"),
    ],
)
def test_resume_refuses_metrics_rows_lost_before_the_checkpoint(
    tmp_path: Path, method: str, cut: str, said: str
) -> None:
    """Rows of rounds the checkpoint has passed, gone or repeated (a file cut or edited by
    hand), would give a finished run whose summary and curves miss or double them: the resume
    is refused, naming the rounds, from the method's first round (a setup round is -1); the
    file and checkpoint are left as they were."""
    from fedlore.config import ConfigError

    cfg = _cfg(tmp_path)
    out = run_dir(cfg, method, SEED)
    assert run_one(cfg, method, SEED, stop_after=2) is None
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])["round"]
    assert first == (-1 if method == "fedlore" else 0)
    kept = {
        "middle": lines[:1] + lines[2:],
        "tail": lines[:-1],
        "all": [],
        "twice": lines[:2] + lines[1:],
        "setup": lines[1:],
    }[cut]
    (out / "metrics.jsonl").write_text("".join(kept))
    ckpt = (out / "checkpoint.pt").read_bytes()
    with pytest.raises(ConfigError, match="the file was cut or edited") as e:
        run_one(cfg, method, SEED, resume=True)
    assert said in str(e.value)
    assert (out / "metrics.jsonl").read_text() == "".join(kept)
    assert (out / "checkpoint.pt").read_bytes() == ckpt
    assert not (out / "summary.json").exists()


def test_resume_of_a_finished_run_returns_its_summary(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rounds=2")
    first = run_one(cfg, "fedfull", SEED)
    out = run_dir(cfg, "fedfull", SEED)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    again = run_one(cfg, "fedfull", SEED, resume=True)
    assert again == first
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_a_finished_run_moved_without_its_checkpoint_is_still_finished(tmp_path: Path) -> None:
    """What ``experiments/runs/`` keeps of a finished seed-table run (``config.json``,
    ``summary.json``, ``metrics.jsonl``; its ``.gitignore`` leaves checkpoints and spilled
    client states out) is all a ``--resume`` on another machine, in another folder, needs to
    report the run instead of training it again (experiments/lr_grid.py)."""
    cfg = _cfg(tmp_path / "here", "rounds=2")
    first = run_one(cfg, "fedlore", SEED)
    kept = {"config.json", "summary.json", "metrics.jsonl"}
    elsewhere = _cfg(tmp_path / "there", "rounds=2")
    out = run_dir(elsewhere, "fedlore", SEED)
    out.mkdir(parents=True)
    for name in kept:
        (out / name).write_bytes((run_dir(cfg, "fedlore", SEED) / name).read_bytes())
    assert run_one(elsewhere, "fedlore", SEED, resume=True) == first
    assert {p.name for p in out.iterdir()} == kept  # nothing trained, nothing written
    ignore = (Path(__file__).parents[2] / "experiments" / "runs" / ".gitignore").read_text()
    lines = set(ignore.splitlines())
    assert {"checkpoint.pt*", "client_states/"} <= lines


def test_without_resume_a_run_starts_over(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rounds=2")
    run_one(cfg, "fedfull", SEED, stop_after=0)
    run_one(cfg, "fedfull", SEED)
    assert [r["round"] for r in _rows(run_dir(cfg, "fedfull", SEED) / "metrics.jsonl")] == [0, 1]


# ------------------------------------------------------------------------------------ CLI


def _cli_config(tmp_path: Path) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(
        "name: clitest\nnum_clients: 3\nrounds: 5\nlocal_steps: 2\nbatch_size: 16\n"
        "lr: 3.0e-3\nrank: 4\nalgorithms: [fedfull, fedlore]\nseeds: [0]\n"
        f"output_dir: {runs}\nprogress: false\n"
        "partition:\n  min_size: 10\nmodel:\n  name: mlp\n  kwargs: {hidden: [32]}\n"
    )
    return cfg_file, runs / "clitest"


def test_cli_run_then_resume_does_not_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg_file, exp = _cli_config(tmp_path)
    assert main(["run", str(cfg_file), "rounds=2"]) == 0
    out = capsys.readouterr().out
    assert "fedfull" in out and "fedlore" in out  # the mean ± std table
    assert (exp / "report.md").is_file() and (exp / "report.csv").is_file()
    files = {
        m: (exp / m / "seed-0" / "summary.json", exp / m / "seed-0" / "metrics.jsonl")
        for m in ("fedfull", "fedlore")
    }
    for summary, metrics in files.values():
        assert json.loads(summary.read_text())["rounds"] == 2  # the override reached the run
        assert [r["round"] for r in _rows(metrics) if r["round"] >= 0] == [0, 1]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for pair in files.values() for p in pair}

    assert main(["run", str(cfg_file), "rounds=2", "--resume"]) == 0
    assert "fedfull" in capsys.readouterr().out
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for pair in files.values() for p in pair}
    assert after == before  # wall_s would differ on a rerun


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("participation=0", ["participation", "got 0"]),
        ("lr=-1", ["lr", "got -1"]),
        ("partition.alpha=0", ["partition.alpha", "got 0"]),
        ("roundz=2", ["roundz", "unknown key"]),
        ("algorithms=[fedmagic]", ["fedmagic", "fedlore"]),
        ("method.fedfull.bogus=1", ["bogus"]),
        ("rounds", ["key=value"]),
    ],
)
def test_cli_bad_override_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, needles: list[str]
) -> None:
    cfg_file, exp = _cli_config(tmp_path)
    assert main(["run", str(cfg_file), override]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("fedlore: error:")
    for needle in needles:
        assert needle in captured.err, captured.err
    assert not (exp / "report.md").exists()


def test_cli_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_resume_refuses_a_changed_config_and_names_the_key(tmp_path: Path) -> None:
    from fedlore.config import ConfigError

    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedfull", SEED, stop_after=0) is None
    changed = _cfg(tmp_path, "lr=1e-2")
    with pytest.raises(ConfigError, match=r"different config \(.*\blr: 0\.003 -> 0\.01\)"):
        run_one(changed, "fedfull", SEED, resume=True)


def test_resume_accepts_a_run_from_before_a_setting_existed_while_it_is_at_its_default(
    tmp_path: Path,
) -> None:
    """A run folder written before ``precision`` and ``optim.name`` existed resumes as long as
    the new settings keep their defaults (the behaviour the run was made with)."""
    from fedlore.config import ConfigError

    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedfull", SEED, stop_after=0) is None
    path = run_dir(cfg, "fedfull", SEED) / "config.json"
    old = json.loads(path.read_text())
    del old["precision"]
    del old["optim"]["name"]
    path.write_text(json.dumps(old))
    assert run_one(cfg, "fedfull", SEED, resume=True) is not None
    path.write_text(json.dumps(old))
    (run_dir(cfg, "fedfull", SEED) / "summary.json").unlink()
    with pytest.raises(ConfigError, match=r"precision: 'fp32' -> 'fp64'"):
        run_one(_cfg(tmp_path, "precision=fp64"), "fedfull", SEED, resume=True)
    # optim.name feeds only the projected methods' inner optimizer: FedFull never reads it
    assert run_one(_cfg(tmp_path, "optim.name=sgd"), "fedfull", SEED, resume=True) is not None


def test_resume_compares_the_methods_resolved_settings(tmp_path: Path) -> None:
    """``method.fedfull.lr=1e-3`` (text in YAML 1.1) and ``0.001`` are the same setting, and
    naming a default explicitly is no change: the recorded ``hyper`` decides."""
    cfg = _cfg(tmp_path, "method.fedfull.lr=1e-3", "method.fedfull.momentum=0.0")
    assert run_one(cfg, "fedfull", SEED, stop_after=0) is None
    same = _cfg(tmp_path, "method.fedfull.lr=0.001")
    assert run_one(same, "fedfull", SEED, resume=True) is not None
    recorded = json.loads((run_dir(cfg, "fedfull", SEED) / "config.json").read_text())
    assert recorded["hyper"]["lr"] == 0.001 and recorded["hyper"]["local_steps"] == 2


def test_runs_of_methods_whose_defaults_changed_are_not_resumed_from_older_records(
    tmp_path: Path,
) -> None:
    from fedlore.config import ConfigError

    for method, refused in (("meta_fl", True), ("fedfull", False)):
        cfg = _cfg(tmp_path, f"name=old-{method}")
        assert run_one(cfg, method, SEED, stop_after=0) is None
        path = run_dir(cfg, method, SEED) / "config.json"
        old = json.loads(path.read_text())
        del old["hyper"]  # as written before fedlore recorded it
        path.write_text(json.dumps(old))
        if refused:
            with pytest.raises(ConfigError, match="behaved differently by default"):
                run_one(cfg, method, SEED, resume=True)
        else:
            assert run_one(cfg, method, SEED, resume=True) is not None


def test_starting_over_an_unfinished_run_warns_under_progress_false(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run without --resume over an unfinished one discards its rounds: that is a warning,
    shown with ``progress: false`` (it went through the progress log, which that silences),
    naming how many rounds go; a folder without rows starts over silently."""
    from fedlore.cli import main
    from fedlore.engine.runstart import StartOverWarning

    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedavg", SEED, stop_after=1) is None
    with pytest.warns(StartOverWarning, match=r"fedavg seed 3: starting over in .*whose 2 rounds"):
        assert run_one(cfg, "fedavg", SEED, stop_after=0) is None
    folder = run_dir(cfg, "fedavg", SEED)
    (folder / "metrics.jsonl").write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error", StartOverWarning)
        assert run_one(cfg, "fedavg", SEED, stop_after=0) is None
    capsys.readouterr()
    args = ["name=resume", "num_clients=3", f"rounds={ROUNDS}", "local_steps=2", "batch_size=16",
            "lr=3e-3", "model.kwargs={hidden: [32]}", "partition.min_size=10", "progress=false",
            f"output_dir={tmp_path}", "algorithms=[fedavg]", f"seeds=[{SEED}]"]  # fmt: skip
    assert main(["run", *args]) == 0
    assert "fedlore: warning: fedavg seed 3: starting over in" in capsys.readouterr().err
