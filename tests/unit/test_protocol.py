"""worker.protocol: sampling validation messages, native dict, wire round trip, import purity."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from worker.errors import InvalidRequestError, SpecdError
from worker.protocol import SamplingParams


def test_defaults_are_openai_and_valid():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.validate() is p


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("temperature", -0.1, "temperature must be between 0 and 2"),
        ("temperature", 2.01, "temperature must be between 0 and 2"),
        ("temperature", math.nan, "temperature must be a finite number"),
        ("top_p", 0.0, "top_p must be greater than 0 and at most 1"),
        ("top_p", 1.5, "top_p must be greater than 0 and at most 1"),
        ("top_k", -1, "top_k must be an integer >= 0"),
        ("min_p", -0.01, "min_p must be between 0 and 1"),
        ("min_p", 1.01, "min_p must be between 0 and 1"),
        ("repetition_penalty", 0.0, "repetition_penalty must be greater than 0"),
        ("repetition_penalty", -1.0, "repetition_penalty must be greater than 0"),
        ("presence_penalty", 2.5, "presence_penalty must be between -2 and 2"),
        ("presence_penalty", -2.5, "presence_penalty must be between -2 and 2"),
        ("frequency_penalty", 3.0, "frequency_penalty must be between -2 and 2"),
        ("frequency_penalty", math.inf, "frequency_penalty must be a finite number"),
        ("seed", 2**64, "seed must be an integer between"),
    ],
)
def test_out_of_range_values_name_field_value_and_range(field, value, fragment):
    p = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError) as ei:
        p.validate()
    msg = str(ei.value)
    assert fragment in msg
    assert f"got {value!r}" in msg
    assert isinstance(ei.value, SpecdError) and isinstance(ei.value, ValueError)
    with pytest.raises(InvalidRequestError):  # to_native validates too
        p.to_native(0)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 0.0), ("temperature", 2.0), ("top_p", 1e-6), ("top_k", 40), ("min_p", 1.0),
     ("repetition_penalty", 1e-3), ("presence_penalty", -2.0), ("frequency_penalty", 2.0),
     ("seed", 0), ("seed", 2**64 - 1), ("seed", -(2**63))],
)
def test_boundary_values_are_accepted(field, value):
    SamplingParams(**{field: value}).validate()


def test_to_native_keys_types_and_seed_choice():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=0.5, frequency_penalty=-0.5)
    d = p.to_native(default_seed=1234)
    # Exactly the keys the native set_sampling accepts (it rejects unknown ones).
    assert set(d) == {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "seed"}
    assert d == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05,
                 "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                 "seed": 1234}
    assert isinstance(d["top_k"], int) and isinstance(d["seed"], int)
    assert SamplingParams(seed=7).to_native(default_seed=1234)["seed"] == 7
    # Negative seeds map to their two's complement (distinct, in uint64 range).
    assert SamplingParams(seed=-1).to_native(0)["seed"] == 2**64 - 1


def test_frozen_and_wire_round_trip():
    p = SamplingParams(temperature=0.0, seed=42, top_k=3)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]
    wire = msgspec.json.encode(p)
    assert msgspec.json.decode(wire, type=SamplingParams) == p
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    # A newer sender's extra field must not break an older receiver.
    newer = b'{"temperature": 0.5, "some_future_field": [1, 2]}'
    assert msgspec.json.decode(newer, type=SamplingParams).temperature == 0.5
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"top_k": "many"}', type=SamplingParams)


def test_protocol_import_loads_no_numpy_and_no_native_module():
    code = (
        "import sys, worker.protocol\n"
        "bad = [m for m in ('numpy', 'worker._specd', 'worker.engine') if m in sys.modules]\n"
        "assert 'msgspec' in sys.modules\n"
        "print('loaded:', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "loaded: []" in res.stdout
