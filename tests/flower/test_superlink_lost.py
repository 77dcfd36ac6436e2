"""A deployed ServerApp whose SuperLink stops answering: flwr 1.42's grid retries for ever, so
fedlore bounds it (``flower.superlink_timeout_s``) and ends the run with one error line, which
frees the run folder for ``resume=true`` (a killed SuperLink used to leave the ServerApp
running, holding the folder's lock: the resume then failed with "in use by another run")."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import httpx
from flwr.app import Context, RecordDict
from flwr.supercore.retry import make_simple_http_retry_invoker

from fedlore.config import load_config
from fedlore.flower import app
from fedlore.flower.transport import bound_superlink_wait

pytestmark = pytest.mark.flower

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"


def _refused(request: Any = None) -> None:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def _call_in_thread(invoker: Any, wait_s: float) -> list[BaseException]:
    """Invoke a call whose SuperLink refuses every connection; the errors it ended with (none
    when it is still retrying after ``wait_s``)."""
    out: list[BaseException] = []

    def call() -> None:
        try:
            invoker.invoke(_refused)
        except BaseException as e:  # whatever ends the retries is the result
            out.append(e)

    t = threading.Thread(target=call, daemon=True)  # a retry for ever must not block pytest
    t.start()
    t.join(wait_s)
    return out


def test_a_bounded_grid_gives_up_on_a_dead_superlink() -> None:
    """Flower's own retry invoker, as the deployed grid holds it: unbounded it still retries
    after 3 s; bounded at 0.3 s it re-raises the connection error."""
    grid = SimpleNamespace(_retry_invoker=make_simple_http_retry_invoker())
    assert grid._retry_invoker.max_time is None  # flwr 1.42: no limit of its own
    bound_superlink_wait(grid, None)  # type: ignore[arg-type]
    assert grid._retry_invoker.max_time is None
    bound_superlink_wait(grid, 0.3)  # type: ignore[arg-type]
    assert grid._retry_invoker.max_time == 0.3
    errors = _call_in_thread(grid._retry_invoker, 10.0)
    assert len(errors) == 1 and isinstance(errors[0], httpx.ConnectError)
    bound_superlink_wait(grid, 50.0)  # type: ignore[arg-type]
    assert grid._retry_invoker.max_time == 0.3  # a bound already set is kept
    bound_superlink_wait(SimpleNamespace(), 1.0)  # type: ignore[arg-type]  # in-memory grid


def test_an_unbounded_invoker_retries_on() -> None:
    """The control: without the bound the same call is still retrying (why the fix exists)."""
    invoker = make_simple_http_retry_invoker()
    assert _call_in_thread(invoker, 3.0) == []
    invoker.max_time = 0.0  # then let the thread give up at its next try


def test_the_deployed_server_app_stops_with_one_line_when_the_superlink_is_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`_deployed_main` bounds the grid at the config's `flower.superlink_timeout_s` and turns
    the transport error that ends the retries into one `fedlore: error:` line, not a
    traceback; the round loop's own state (rows, checkpoint) is what it wrote before."""
    seen: dict[str, Any] = {}

    def lost(grid: Any, *_: Any, **__: Any) -> None:
        seen["max_time"] = grid._retry_invoker.max_time
        _refused()

    monkeypatch.setattr(app, "server_main", lost)
    grid = SimpleNamespace(_retry_invoker=make_simple_http_retry_invoker())
    ctx = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(),
        run_config={"config": str(QUICKSTART), "overrides": "flower.superlink_timeout_s=7"},
    )  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="flwr"):
        app._deployed_main(grid, ctx)  # type: ignore[arg-type]
    assert seen["max_time"] == 7.0
    lines = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith(
        "fedlore: error: the SuperLink did not answer for flower.superlink_timeout_s = 7.0 s "
        "(ConnectError: [Errno 111] Connection refused)"
    )
    assert "resume=true" in lines[0]


def test_the_default_bound() -> None:
    assert load_config(QUICKSTART, []).flower.superlink_timeout_s == 120.0
