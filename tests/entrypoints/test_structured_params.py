"""StructuredOutputsParams: exactly one constraint, checked types, a canonical cache key."""

import pytest

from pagefleet.worker.core.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one") as e:
        StructuredOutputsParams()
    assert e.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="json_object, choice"):
        StructuredOutputsParams(json_object=True, choice=["a"])


@pytest.mark.parametrize("kwargs, param", [
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": 3}, "structured_outputs.json"),
    ({"json_object": 1}, "structured_outputs.json_object"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 2]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"grammar": ["root ::= x"]}, "structured_outputs.grammar"),
    ({"structural_tag": 1}, "structured_outputs.structural_tag"),
])
def test_bad_types_name_the_field(kwargs, param):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == param


def test_kind_and_canonical_spec():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "string"}}, "type": "object"}')
    assert a.kind == "json" and a.key() == b.key()
    assert StructuredOutputsParams(json_object=True).key() == ("json_object", "")
    assert StructuredOutputsParams(choice=("x", "y")).key() == ("choice", '["x", "y"]')
    assert StructuredOutputsParams(regex=r"\d+").key() == ("regex", r"\d+")
    assert StructuredOutputsParams(grammar='root ::= "a"').kind == "grammar"


def test_sampling_params_field():
    sp = SamplingParams(structured=StructuredOutputsParams(choice=["yes", "no"])).validate()
    assert sp.structured.kind == "choice"
    assert SamplingParams().structured is None
    with pytest.raises(ValueError) as e:
        SamplingParams(structured={"json": {}}).validate()
    assert e.value.param == "structured"
