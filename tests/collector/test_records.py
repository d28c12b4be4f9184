"""The wire contract: models and Arrow schemas agree, and bad values are refused."""

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from collector import records


def _step(**over):
    base = {
        "worker_id": "w", "session_id": "s", "release": "r1", "gpu_kind": "h200", "ts": datetime.now(UTC), "step": 0,
        "diffusion_ms": 150.0, "step_period_ms": 166.0, "late": False, "playout_depth": 2, "reset_step": False,
        "mem_allocated_bytes": 1, "mem_reserved_bytes": 2, "buffers_registered": 0, "switches": "ring_cache,rope_at_write",
    }
    base.update(over)
    return base


def test_arrow_round_trip_keeps_values():
    rows = [_step(step=i) for i in range(3)]
    t = records.to_arrow("step", rows)
    assert t.schema.metadata[b"livestep.kind"] == b"step"
    assert t.column("step").to_pylist() == [0, 1, 2]
    back = [records.StepRecord(**r) for r in t.to_pylist()]
    assert back[2].step == 2 and back[0].switches == "ring_cache,rope_at_write"


@pytest.mark.parametrize(
    "field,value",
    [
        ("diffusion_ms", float("nan")),
        ("diffusion_ms", float("inf")),
        ("step_period_ms", -1.0),
        ("step", -1),
        ("switches", "ring_cache,warp_drive"),
        ("ts", datetime.now(UTC) + timedelta(days=1)),
        ("worker_id", ""),
    ],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValidationError):
        records.StepRecord(**_step(**{field: value}))


def test_extra_field_is_refused():
    with pytest.raises(ValidationError, match="extra"):
        records.StepRecord(**_step(color="blue"))


def test_unknown_switch_message_lists_valid_ones():
    with pytest.raises(ValueError, match="valid switches: ring_cache"):
        records.encode_switches({"nope"})


def test_switch_state_round_trip():
    on = {"fp8_cache", "ring_cache"}
    assert records.decode_switches(records.encode_switches(on)) == on
    assert records.decode_switches("") == frozenset()
