"""The ``threads`` setting: auto = one thread per CPU other work leaves free; a resumed run keeps
the count it started with (issue 19)."""

import json

import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.device import (
    CpuSample,
    auto_threads,
    busy_cpus,
    cgroup_cpus,
    cpu_sample,
    use_threads,
)
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one


@pytest.fixture
def no_env_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.usefixtures("no_env_threads")
def test_auto_takes_the_free_cpus() -> None:
    assert auto_threads(cpus=2, busy=0.0) == 2  # an idle machine: every CPU
    assert auto_threads(cpus=2, busy=1.2) == 1  # a competing process: one thread
    assert auto_threads(cpus=2, busy=7.5) == 1  # never fewer than one
    assert auto_threads(cpus=16, busy=3.4) == 13
    assert auto_threads(cpus=4, busy=-1.0) == 4  # never more than the CPUs


def counters(*samples: CpuSample | None):
    """A counter source that returns ``samples`` in turn."""
    it = iter(samples)
    return lambda: next(it)


@pytest.mark.usefixtures("no_env_threads")
def test_an_idle_machine_gets_all_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 CPUs watched for 0.25 s each (0.5 CPU-seconds): only this process ran (0.02 s of its
    # own start-up work); a load average of 1.9 left by the job that just ended does not count
    monkeypatch.setattr("os.getloadavg", lambda: (1.9, 1.0, 0.5))
    idle = counters(CpuSample(10.0, 100.0, 1.0, 2), CpuSample(10.02, 100.5, 1.02, 2))
    assert busy_cpus(0.0, idle) == pytest.approx(0.0)
    monkeypatch.setattr("fedlore.device.available_cpus", lambda: 2)
    monkeypatch.setattr(
        "fedlore.device.busy_cpus",
        lambda: busy_cpus(0.0, counters(CpuSample(10, 100, 1, 2), CpuSample(10, 100.5, 1, 2))),
    )
    assert auto_threads() == 2
    # 16 CPUs, nothing else running, this process busy on 3 of them: still all 16
    own = counters(CpuSample(0, 0, 0, 16), CpuSample(0.75, 4.0, 0.75, 16))
    assert auto_threads(cpus=16, busy=busy_cpus(0.0, own)) == 16


@pytest.mark.usefixtures("no_env_threads")
def test_a_busy_neighbour_keeps_its_cpu() -> None:
    # one competing process the whole 0.25 s (0.25 busy CPU-seconds that are not ours): 1 CPU
    one = counters(CpuSample(10, 100, 1, 2), CpuSample(10.27, 100.5, 1.02, 2))
    assert busy_cpus(0.0, one) == pytest.approx(1.0)
    assert auto_threads(cpus=2, busy=busy_cpus(0.0, counters(
        CpuSample(10, 100, 1, 2), CpuSample(10.27, 100.5, 1.02, 2)))) == 1  # fmt: skip
    # half a neighbour rounds to the free CPUs; never more busy CPUs than there are
    half = counters(CpuSample(0, 0, 0, 4), CpuSample(0.125, 1.0, 0, 4))
    assert busy_cpus(0.0, half) == pytest.approx(0.5)
    full = counters(CpuSample(0, 0, 0, 2), CpuSample(9, 0.5, 0, 2))
    assert busy_cpus(0.0, full) == 2.0


def test_without_cpu_counters_the_load_average_is_the_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.getloadavg", lambda: (1.25, 1.0, 0.5))
    assert busy_cpus(0.0, counters(None)) == 1.25
    monkeypatch.setattr("os.getloadavg", lambda: (_ for _ in ()).throw(OSError("none")))
    assert busy_cpus(0.0, counters(None)) == 0.0


def test_this_process_own_work_is_not_a_neighbour() -> None:
    """On the real counters: a thread of this process that spins through the sample shows as
    this process's own CPU time, which busy_cpus subtracts (other load on the machine may add
    to the result, never this thread)."""
    import threading

    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    before = cpu_sample()
    if before is None:
        pytest.skip("this OS gives no per-CPU times (psutil)")
    t = threading.Thread(target=spin)
    t.start()
    try:
        samples: list[CpuSample | None] = []

        def recorded() -> CpuSample | None:
            samples.append(cpu_sample())
            return samples[-1]

        others = busy_cpus(0.3, recorded)
    finally:
        stop.set()
        t.join()
    first, second = samples
    assert first is not None and second is not None
    per_cpu = (second.total - first.total) / first.cpus
    all_busy = (second.busy - first.busy) / per_cpu
    own = (second.own - first.own) / per_cpu
    # the spinning thread ran through the sample as this process's time: on a loaded machine
    # (two test workers and other work on two cores) it gets a fraction of a core, not most of one
    assert own > 0.05
    assert others == pytest.approx(max(all_busy - own, 0.0), abs=1e-9)
    assert others <= all_busy - own + 1e-9


def test_a_cgroup_quota_caps_the_cpus(tmp_path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")
    assert cgroup_cpus(f) == 2  # 1.5 CPUs of time: 2 threads, rounded up
    f.write_text("max 100000\n")
    assert cgroup_cpus(f) is None
    f.write_text("garbage")
    assert cgroup_cpus(f) is None
    assert cgroup_cpus(tmp_path / "missing") is None


def test_an_explicit_omp_num_threads_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    assert auto_threads(cpus=8, busy=0.0) == before


def test_use_threads_sets_torch_and_reuses_a_recorded_count() -> None:
    before = torch.get_num_threads()
    try:
        assert use_threads(2) == 2 and torch.get_num_threads() == 2
        assert use_threads("auto", recorded=3) == 3 and torch.get_num_threads() == 3
        assert use_threads(1, recorded=3) == 1  # an explicit count is not overridden
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -2, "many", 1.5, True])
def test_bad_thread_counts_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="threads"):
        load_config(None, [f"threads={bad}"] if not isinstance(bad, bool) else ["threads=true"])


def test_a_run_records_its_threads_and_resume_keeps_them(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    cfg = load_config(
        None,
        [
            "data.name=digits", "model.name=mlp", "num_clients=2", "rounds=2", "local_steps=1",
            "algorithms=[fedfull]", "progress=false", f"output_dir={tmp_path}", "threads=auto",
        ],
    )  # fmt: skip
    try:
        monkeypatch.setattr("fedlore.device.available_cpus", lambda: 3)
        monkeypatch.setattr("fedlore.device.busy_cpus", lambda: 0.0)
        assert run_one(cfg, "fedfull", 42, stop_after=0) is None
        out = run_dir(cfg, "fedfull", 42)
        assert json.loads((out / "config.json").read_text())["ran_threads"] == 3
        monkeypatch.setattr("fedlore.device.busy_cpus", lambda: 2.0)  # now auto would take 1
        assert run_one(cfg, "fedfull", 42, resume=True) is not None
        assert torch.get_num_threads() == 3  # the count the run started with
        fresh = run_one(cfg.model_copy(update={"name": "other"}), "fedfull", 42)
        assert fresh is not None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("no_env_threads")
def test_a_supernode_decides_auto_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployed ClientApp process samples the CPUs on its first message and keeps that count
    for every later one (no 0.25 s wait per message, one float-sum order for all its rounds)."""
    pytest.importorskip("flwr")
    from fedlore.flower import app

    calls: list[int] = []

    def busy() -> float:
        calls.append(1)
        return 0.0 if len(calls) == 1 else 5.0

    monkeypatch.setattr("fedlore.device.available_cpus", lambda: 2)
    monkeypatch.setattr("fedlore.device.busy_cpus", busy)
    monkeypatch.setattr(app, "_DEPLOYED_THREADS", {})
    cfg = load_config(None, ["threads=auto"])
    before = torch.get_num_threads()
    try:
        assert app.set_threads(cfg, None) == 2
        assert app.set_threads(cfg, None) == 2 and torch.get_num_threads() == 2
        assert len(calls) == 1
        assert app.set_threads(cfg, 1) == 1  # a simulated client's fixed count is applied
    finally:
        torch.set_num_threads(before)
