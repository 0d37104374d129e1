"""Each attempt's hand-off, chosen from the connector, the layout and MoRIIO's transfer mode.
Pure: no server (the legs themselves run end to end in test_pipeline.py and
test_moriio_legs.py; the stage recorded as each leg opens is in observe/test_metrics.py)."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from epd_trio._core.config import Settings
from epd_trio._core.errors import NoInstance
from epd_trio._core.health import Registry
from epd_trio._core.names import STAGES, Stage
from epd_trio._core.routing import Instance
from epd_trio._handoff import (
    DECODE_ONLY,
    MORIIO_READ,
    MORIIO_WRITE,
    PREFILL_THEN_DECODE,
    HandOff,
    choose_handoff,
)
from epd_trio._pipeline import Pipeline, RequestRun

DECODE = Instance("http://d:1")
PREFILL = Instance("http://p:1")


@pytest.mark.parametrize(("moriio", "with_prefill", "mode", "expected"), [
    (False, False, None, DECODE_ONLY),
    (False, True, None, PREFILL_THEN_DECODE),
    (False, True, "WRITE", PREFILL_THEN_DECODE),  # a transfer mode is MoRIIO's alone
    (True, True, None, MORIIO_READ),  # no registration has fixed the mode yet
    (True, True, "READ", MORIIO_READ),
    (True, True, "WRITE", MORIIO_WRITE),
])
def test_each_layout_and_transfer_mode_has_its_handoff(
    moriio: bool, with_prefill: bool, mode: str | None, expected: HandOff,
) -> None:
    assert choose_handoff(moriio=moriio, with_prefill=with_prefill, transfer_mode=mode) is expected


@pytest.mark.parametrize("mode", [None, "READ", "WRITE"])
def test_moriio_without_a_prefill_instance_has_no_handoff(mode: str | None) -> None:
    with pytest.raises(NoInstance, match="MoRIIO needs a prefill instance") as info:
        choose_handoff(moriio=True, with_prefill=False, transfer_mode=mode)
    assert info.value.status == 503


def test_only_a_write_attempt_has_the_decode_failover_retry_its_prefill() -> None:
    """WRITE's prefill runs beside decode, with no failover of its own."""
    handoffs = (DECODE_ONLY, PREFILL_THEN_DECODE, MORIIO_READ, MORIIO_WRITE)
    assert [h.also_retry for h in handoffs] == [(), (), (), ("prefill",)]


def pipeline(settings: Settings, mode: list[str | None]) -> Pipeline:
    """A pipeline that is only asked for its hand-off (nothing is routed or called)."""
    nothing: Any = None
    return Pipeline(settings, pools=nothing, models=nothing, loads=nothing, registry=Registry(),
                    accounting=nothing, moriio_peer=lambda inst: None,
                    transfer_mode=lambda: mode[0])


def test_the_handoff_is_chosen_per_attempt_from_the_rosters_transfer_mode() -> None:
    """The first MoRIIO registration fixes the mode: a retry after it reads it again."""
    mode: list[str | None] = [None]
    moriio = pipeline(Settings(kv_connector="moriio"), mode)
    assert moriio.handoff(with_prefill=True) is MORIIO_READ
    mode[0] = "WRITE"
    assert moriio.handoff(with_prefill=True) is MORIIO_WRITE
    generic = pipeline(Settings(decode_urls=(DECODE,)), mode)
    assert generic.handoff(with_prefill=True) is PREFILL_THEN_DECODE
    assert generic.handoff(with_prefill=False) is DECODE_ONLY


def test_the_stage_type_and_the_stage_tuple_are_one_fact() -> None:
    assert STAGES == get_args(Stage) == ("encode", "prefill", "decode")


def test_a_request_run_is_one_object_with_no_instance_dict() -> None:
    """The request path allocates one object per request, with fixed slots."""
    nothing: Any = None
    run = RequestRun(nothing, nothing, "/v1/completions", "r1")
    assert not hasattr(run, "__dict__")
    assert run.request_id == "r1" and run.committed and run.relay is None


class Recorder:
    """Stands in for the account, the decode leg and its stream: records what happens."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.tail = b""
        self.abandon: Any = None

    def read_usage(self, data: bytes) -> None:
        self.events.append("usage read")

    def finish(self) -> None:
        self.events.append("account finished")

    def client_left(self) -> None:
        self.events.append("client left")

    def release(self) -> None:
        self.events.append("leg released")

    async def aclose(self) -> None:
        self.events.append("stream closed")
        self.abandon()  # as StreamRelay.aclose does for a stream that had not finished


@pytest.mark.parametrize(("committed", "client_left"), [(True, ["client left"]), (False, [])])
async def test_a_request_run_closes_its_stream_then_releases_its_leg_slot_and_account(
    committed: bool, client_left: list[str],
) -> None:
    """The one clean-up a request leaves with its resources, in order. A stream closed before
    its end is the client leaving, unless it was a MoRIIO WRITE attempt's not yet committed."""
    nothing: Any = None
    record = Recorder()
    run = RequestRun(nothing, record, "/v1/completions", "r1")
    run.relay, run.stream_leg, run.committed = record, record, committed
    record.abandon = run._abandoned
    run._decode_load = lambda: record.events.append("slot released")
    await run.close()
    assert record.events == ["stream closed", *client_left, "usage read", "leg released",
                             "slot released", "account finished"]
    await run.close_stream()  # closed once
    assert run.relay is None and run.stream_leg is None
