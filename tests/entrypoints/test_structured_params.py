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


# ---- the HTTP fields that set it (protocol.py): response_format, structured_outputs, guided_*, tools ----

from pagefleet.worker.entrypoints.protocol import (  # noqa: E402
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_tools,
    structured_params,
    tool_choice,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}


def chat(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize("body, kind, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json", "response_format"),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"structured_outputs": {"regex": r"\d+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}}, "choice",
     "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "grammar", "structured_outputs"),
    ({"guided_json": SCHEMA}, "json", "guided_json"),
    ({"guided_choice": ["x"]}, "choice", "guided_choice"),
    ({"guided_regex": "[ab]+"}, "regex", "guided_regex"),
])
def test_each_field_maps_to_one_constraint(body, kind, field):
    for req in (chat(**body), CompletionRequest(prompt="hi", **body)):
        structured, source = structured_params(req)
        assert structured.kind == kind and source == field
    assert structured_params(chat(response_format={"type": "text"})) is None
    assert structured_params(chat()) is None


def test_json_schema_maps_to_the_schema_itself():
    structured, _ = structured_params(chat(response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": SCHEMA}}))
    assert structured.json == SCHEMA


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "nonsense"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_json": {"properties": 3}}, "guided_json"),
    ({"guided_regex": "["}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        structured_params(chat(**body))
    assert e.value.status == 400 and e.value.param == param
    assert param.split(".")[0] in e.value.message


def test_tools_are_checked_and_defaulted():
    tools = check_tools([TOOL, {"type": "function", "function": {"name": "now"}}])
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    for bad, param in [([{"type": "retrieval"}], "tools[0].type"),
                       ([{"type": "function", "function": {}}], "tools[0].function.name"),
                       ([TOOL, TOOL], "tools[1].function.name"),
                       ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                        "tools[0].function.parameters")]:
        with pytest.raises(APIError) as e:
            check_tools(bad)
        assert e.value.param == param


def test_tool_choice_modes():
    tools = check_tools([TOOL])
    assert tool_choice(chat(), [], False) == ("none", None)
    assert tool_choice(chat(tools=tools), tools, True) == ("auto", None)
    assert tool_choice(chat(tools=tools, tool_choice="required"), tools, False) == ("required", None)
    named = {"type": "function", "function": {"name": "weather"}}
    assert tool_choice(chat(tools=tools, tool_choice=named), tools, False) == ("named", "weather")
    for req, auto in [(chat(tools=tools), False),  # auto needs --enable-auto-tool-choice
                      (chat(tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}}), True),
                      (chat(tools=tools, tool_choice="sometimes"), True),
                      (chat(tool_choice="required"), True)]:
        with pytest.raises(APIError) as e:
            tool_choice(req, check_tools(req.tools), auto)
        assert e.value.status == 400 and e.value.param == "tool_choice"
