"""Shapes, the TP rank view and switch validation (the wire contract's switch names included)."""

from __future__ import annotations

import dataclasses

import pytest

from collector import records
from worker.config import (
    SWITCH_NAMES,
    ModelShape,
    ShapeError,
    SwitchError,
    Switches,
    parse_switch_args,
    tp_rank_of,
)


def test_switch_fields_are_the_wire_contract_names():
    assert tuple(f.name for f in dataclasses.fields(Switches)) == records.SWITCH_NAMES == SWITCH_NAMES


def test_prod57b_shape_and_parameter_count():
    s = ModelShape.from_name("prod57b")
    assert (s.n_blocks, s.d_model, s.n_heads, s.head_dim, s.ffn) == (60, 7680, 60, 128, 30720)
    assert s.new_tokens == 757 and s.window == 5788 and s.passes == 4 and s.reset_every == 42
    assert abs(s.params - 56.6e9) < 0.05e9
    assert (s.frame_h, s.frame_w) == (704, 1088)
    assert s.attention_calls_per_step == 240


def test_tp3_rank_view_of_prod57b():
    r = tp_rank_of(ModelShape.from_name("prod57b"), 3, rank=2)
    assert (r.heads, r.ffn_local, r.tp_rank, r.tp_size) == (20, 10240, 2, 3)
    assert r.params == ModelShape.from_name("prod57b").params  # the full model's count


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ShapeError, match="valid presets: tiny, small, prod57b"):
        ModelShape.from_name("huge")


def test_tp_that_does_not_divide_heads_is_refused_with_valid_sizes():
    with pytest.raises(ShapeError, match="valid tp sizes: 1, 2, 3, 4"):
        tp_rank_of(ModelShape.from_name("prod57b"), 7)


@pytest.mark.parametrize(
    ("switches", "needs"),
    [
        ({"ring_cache": True}, "ring_cache needs rope_at_write"),
        ({"fp8_cache": True}, "fp8_cache needs rope_at_write"),
        ({"rope_at_write": True, "delta_rotation": True}, "delta_rotation needs ring_cache"),
    ],
)
def test_invalid_combinations_are_refused_naming_the_valid_ones(switches, needs):
    with pytest.raises(SwitchError, match=needs) as e:
        Switches(**switches)
    assert "Valid cache combinations: plain (all off); rope_at_write; ring_cache+rope_at_write" in str(e.value)


def test_every_valid_combination_builds_and_encodes_like_the_contract():
    sw = Switches.all_on()
    assert "buffer_per_shape" not in sw.on()
    assert "attention_fp8_dots" not in sw.on()  # outside the quality band: an operator's choice, off in production
    assert sw.encode() == records.encode_switches(sw.on())
    assert Switches.decode(sw.encode()) == sw
    assert Switches().encode() == ""


def test_parse_switch_args():
    sw = parse_switch_args(["ring_cache=on", "rope_at_write=ON", "fp8_cache=off"])
    assert sw.on() == {"ring_cache", "rope_at_write"}
    with pytest.raises(SwitchError, match="unknown switch 'warp'; valid switches: ring_cache"):
        parse_switch_args(["warp=on"])
    with pytest.raises(SwitchError, match="name=on|off"):
        parse_switch_args(["ring_cache"])
    with pytest.raises(SwitchError, match="ring_cache needs rope_at_write"):
        parse_switch_args(["ring_cache=on"])


@pytest.mark.parametrize("value,want", [("off", False), ("on", True), ("false", False), (0, False), (True, True)])
def test_from_mapping_reads_every_spelling_of_a_value(value, want):
    assert Switches.from_mapping({"compile": value}).compile is want


@pytest.mark.parametrize("value", ["maybe", 2, None, 0.5])
def test_from_mapping_refuses_other_values(value):
    with pytest.raises(SwitchError, match="valid values"):
        Switches.from_mapping({"compile": value})
