"""Action schemas (mcar.tokenizer.action_schema): any schema and its records round-trip to ids and back, each
part in its own id range; out-of-range axis values are clamped and counted; schema errors name the field."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.tokenizer.action_schema import RecordError, SchemaActions, SchemaError

NAMES = st.text("abcdefghij", min_size=1, max_size=4)


@st.composite
def parts(draw, i):
    kind = draw(st.sampled_from(["keys", "choice", "axis", "constant"]))
    name = f"p{i}"
    if kind == "keys":
        keys = draw(st.lists(NAMES, min_size=1, max_size=5, unique=True))
        return {"name": name, "type": "keys", "keys": keys, "mode": draw(st.sampled_from(["each", "one", "packed"]))}
    if kind == "choice":
        return {"name": name, "type": "choice", "choices": draw(st.lists(NAMES, min_size=1, max_size=6, unique=True))}
    if kind == "axis":
        lo = draw(st.floats(-1000, 999, allow_nan=False))
        hi = lo + draw(st.floats(0.5, 1000))
        return {"name": name, "type": "axis", "range": [lo, hi], "bins": draw(st.integers(2, 41)),
                "scale": draw(st.sampled_from(["uniform", "mu_law"]))}
    return {"name": name, "type": "constant"}


@st.composite
def schema_and_record(draw):
    n = draw(st.integers(1, 4))
    schema = {"actions": [draw(parts(i)) for i in range(n)]}
    record = {}
    for p in schema["actions"]:
        if p["type"] == "keys":
            most = 1 if p["mode"] == "one" else len(p["keys"])
            record[p["name"]] = draw(st.lists(st.sampled_from(p["keys"]), max_size=most, unique=True))
        elif p["type"] == "choice":
            record[p["name"]] = draw(st.sampled_from(p["choices"]))
        elif p["type"] == "axis":
            record[p["name"]] = draw(st.floats(*p["range"]))
    return schema, record


@settings(max_examples=150, deadline=None)
@given(schema_and_record())
def test_any_schema_and_record_round_trip_through_ids(case):
    schema, record = case
    space = SchemaActions(schema)
    encoded = space.encode_counted(record)
    ids = encoded.ids
    assert len(ids) == space.n_a and not encoded.clamped
    starts = space.offsets + [space.vocab_size]
    for (part, _), i, lo, hi in zip(space.slots, ids, starts, starts[1:]):
        assert lo <= i < hi and hi - lo == part.size  # each token in its own part's range
    decoded = space.decode(ids)
    assert space.encode(decoded) == ids  # a decoded record is what the ids say, exactly
    for p in schema["actions"]:
        if p["type"] == "choice":
            assert decoded[p["name"]] == record[p["name"]]
        elif p["type"] == "keys":
            assert set(decoded[p["name"]]) == set(record[p["name"]])
        elif p["type"] == "axis":  # the nearest bin's centre, within one bin of the value
            lo, hi = p["range"]
            assert lo - 1e-6 <= decoded[p["name"]] <= hi + 1e-6
            if p["scale"] == "uniform":
                assert abs(decoded[p["name"]] - record[p["name"]]) <= (hi - lo) / (p["bins"] - 1) / 2 + 1e-6


@settings(max_examples=60, deadline=None)
@given(st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from(["uniform", "mu_law"]))
def test_out_of_range_axis_values_are_clamped_and_counted(value, scale):
    space = SchemaActions({"actions": [{"name": "x", "type": "axis", "range": [-2, 3], "bins": 11, "scale": scale}]})
    encoded = space.encode_counted({"x": value})
    inside = -2 <= value <= 3
    assert encoded.clamped == ([] if inside else ["x"])
    assert encoded.ids == space.encode({"x": min(max(value, -2), 3)})


def test_keys_modes_and_fields():
    space = SchemaActions({"actions": [
        {"name": "keys", "type": "keys", "keys": ["w", "a"]},
        {"name": "pair", "field": "*", "type": "keys", "keys": ["left", "right"], "mode": "one"},
        {"name": "buttons", "type": "keys", "keys": ["x", "y", "z"], "mode": "packed"},
        {"name": "cam", "field": "mouse[1]", "type": "axis", "range": [-10, 10], "bins": 5}]})
    assert space.n_a == 5 and space.offsets == [0, 2, 4, 7, 15] and space.vocab_size == 20
    ids = space.encode({"keys": {"w": 1, "a": 0}, "left": 1, "right": 1, "buttons": ["x", "z"], "mouse": [0, 10]})
    assert ids == [0 + 1, 2 + 0, 4 + 0, 7 + 0b101, 15 + 4]  # left + right together: none
    assert space.encode({}) == [0, 2, 4, 7, 15 + 2]  # every field missing: its rest value
    assert space.label(ids) == "w x z cam+10" and space.decode(ids)["mouse"] == [None, 10.0]


def test_a_one_choice_schema_names_its_actions():
    space = SchemaActions({"actions": [{"name": "a", "type": "choice", "choices": ["NOOP", "FIRE", "UP"]}],
                           "moves": ["UP"]})
    assert space.names == ("NOOP", "FIRE", "UP") and space.moves == ("UP",)
    assert space.encode_name("FIRE") == [1] and space.label([2]) == "UP"


@pytest.mark.parametrize("schema, field", [
    ({}, "actions"),
    ({"actions": [{"name": "m", "type": "axis", "bins": 4}]}, "actions.m.range"),
    ({"actions": [{"name": "m", "type": "axis", "range": [1, 1]}]}, "actions.m.range"),
    ({"actions": [{"name": "m", "type": "axis", "range": [0, 1], "bins": 1}]}, "actions.m.bins"),
    ({"actions": [{"name": "m", "type": "axis", "range": [0, 1], "scale": "log"}]}, "actions.m.scale"),
    ({"actions": [{"name": "k", "type": "keys", "keys": []}]}, "actions.k.keys"),
    ({"actions": [{"name": "k", "type": "keys", "keys": list("abcdefghijklm"), "mode": "packed"}]}, "actions.k"),
    ({"actions": [{"name": "c", "type": "choice", "choices": ["a", "a"]}]}, "actions.c.choices"),
    ({"actions": [{"name": "c", "type": "dial"}]}, "actions.c.type"),
    ({"actions": [{"name": "c", "type": "constant"}, {"name": "c", "type": "constant"}]}, "actions[1].name"),
    ({"actions": [{"name": "c", "type": "choice", "choices": ["a"]}], "moves": ["b"]}, "moves"),
])
def test_a_schema_error_is_one_line_naming_the_field(schema, field):
    with pytest.raises(SchemaError) as e:
        SchemaActions(schema)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


@pytest.mark.parametrize("record, field", [
    ({"k": ["q"]}, "k: unknown key 'q'"), ({"k": {"a": 2}}, "k.a=2"), ({"k": "a"}, "k='a'"),
    ({"c": "fly"}, "c='fly'"), ({"x": "far"}, "x='far'"), ({"x": math.nan}, "x=nan"), ({"x": True}, "x=True"),
])
def test_a_bad_record_names_its_field(record, field):
    space = SchemaActions({"actions": [{"name": "k", "type": "keys", "keys": ["a"]},
                                       {"name": "c", "type": "choice", "choices": ["go"]},
                                       {"name": "x", "type": "axis", "range": [0, 1]}]})
    with pytest.raises(RecordError, match=field.replace("[", r"\[").replace("?", r"\?")):
        space.encode(record)
