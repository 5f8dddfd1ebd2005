"""StructuredOutputsParams: exactly one constraint, and it crosses the engine-core boundary intact."""

import msgpack
import pytest
from tokenmill.engine.core import EngineCoreRequest
from tokenmill.engine.core.proc import ADD, decode, encode
from tokenmill.engine.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json": {"type": "object"}},
        {"json": '{"type": "integer"}'},
        {"json": {}},
        {"json_object": True},
        {"regex": "[a-z]+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a" | "b"'},
    ],
)
def test_one_constraint_is_accepted(kwargs):
    so = StructuredOutputsParams(**kwargs)
    assert so.kind == next(iter(kwargs))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "got none"),
        ({"json": {}, "regex": "a"}, "got json, regex"),
        ({"json_object": False}, "got none"),
        ({"choice": []}, "at least one"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"json": 3}, "JSON schema object or string, got int"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"grammar": "  "}, "grammar must be a non-empty string"),
    ],
)
def test_bad_constraints_are_refused_by_name(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_cross_the_core_boundary():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, "x"]}}}}
    so = StructuredOutputsParams(json=schema, strict=False, disable_any_whitespace=True)
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(structured_outputs=so), 0.0)
    kind, back = decode(encode((ADD, req)))
    assert kind == ADD
    assert back.sampling_params.structured_outputs == so
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(SamplingParams().to_dict()))) == SamplingParams()
