"""Structured outputs (issue 19, point 3): ``response_format`` and forced tool choices become the
engine's constrained decoding. The edge refuses what no engine can constrain to (a 400 naming the
field); the mock engine honours the schema, so the official openai client gets JSON that validates,
from a real frontend and real mock workers of both demo models (K3 and Hermes answer formats)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from support.cluster import Cluster, mock_cluster, openai_client

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.cli.up import DEMO_SCHEMA, structured_curl_command
from dynamo_prep.engines.mock.instance import instance_of
from dynamo_prep.parsing import PlainAnswerParser, fold_deltas
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.parsing.forced import ForcedToolParser
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessError
from dynamo_prep.protocol.preprocessed import StructuredOutput
from dynamo_prep.protocol.structured import ForcedTool, StructuredOutputError, structured_output
from dynamo_prep.tokenizer import Tokenizer

MODELS = ("kimi-k3-demo", "qwen-vl-demo")
USER = [{"role": "user", "content": "Tell me about Paris."}]

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 40},
        "population": {"type": "integer", "minimum": 1000},
        "area_km2": {"type": "number", "exclusiveMinimum": 0},
        "capital": {"type": "boolean"},
        "kind": {"enum": ["city", "town", "village"]},
        "districts": {"type": "array", "items": {"$ref": "#/$defs/district"}, "minItems": 2},
        "mayor": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    },
    "required": ["name", "population", "area_km2", "capital", "kind", "districts", "mayor"],
    "additionalProperties": False,
    "$defs": {
        "district": {
            "type": "object",
            "properties": {"id": {"type": "integer", "maximum": -1}, "label": {"type": "string"}},
            "required": ["id", "label"],
            "additionalProperties": False,
        }
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 5}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


def json_schema_format(schema: Any, *, name: str = "city", strict: Any = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


# -- the edge: shapes in, one StructuredOutput out -----------------------------------------------------


def test_text_and_absent_are_free_text_json_object_and_schema_are_constraints() -> None:
    assert structured_output(None, None, None) is None
    assert structured_output({"type": "text"}, None, None) is None
    assert structured_output({"type": "json_object"}, None, None) == StructuredOutput(json_object=True)
    # the string spelling the K3 chat template reads is accepted too
    assert structured_output("json_object", None, None) == StructuredOutput(json_object=True)
    constrained = structured_output(json_schema_format(CITY), None, None)
    assert constrained is not None and json.loads(constrained.json_schema or "") == CITY


@pytest.mark.parametrize(
    ("response_format", "says"),
    [
        ({"type": "xml"}, "unknown type 'xml'"),
        ({}, "'type' is missing"),
        ("json_schema", "needs a 'json_schema' object"),
        ({"type": "json_schema"}, "needs a 'json_schema' object"),
        ({"type": "json_schema", "json_schema": {"schema": CITY}}, "'json_schema.name'"),
        (json_schema_format(CITY, name="has space"), "'json_schema.name'"),
        (json_schema_format(CITY, strict="yes"), "'json_schema.strict' must be a boolean"),
        (json_schema_format([1]), "'json_schema.schema' must be a JSON Schema object"),
        (json_schema_format({"type": "objekt"}), "not a valid JSON Schema"),
        (json_schema_format({"type": "object", "required": "name"}), "not a valid JSON Schema"),
        (json_schema_format({"properties": {"a": {"minLength": -1}}}), "not a valid JSON Schema"),
        (json_schema_format({"$schema": []}), "'$schema' must be a string"),
        (json_schema_format({"$schema": "http://example.com/mine"}), "unknown '$schema'"),
        (json_schema_format({"$ref": "#/$defs/missing"}), "is not a local reference (#/...) that resolves"),
        (json_schema_format({"items": {"$ref": "https://example.com/s.json"}}), "is not a local reference"),
    ],
)
def test_a_bad_response_format_is_refused_naming_it_and_what_is_accepted(
    response_format: Any, says: str
) -> None:
    with pytest.raises(StructuredOutputError) as refused:
        structured_output(response_format, None, None)
    assert refused.value.param == "response_format"
    assert says in str(refused.value)
    assert '{"type": "json_object"}' in str(refused.value)  # what is accepted


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
KEYWORDS = st.sampled_from(
    ["type", "properties", "required", "items", "$ref", "$defs", "$schema", "enum", "anyOf"]
)
SCHEMAS_ANY = st.dictionaries(KEYWORDS | st.text(max_size=6), JSON, max_size=5)
SCHEMA_KEYWORDS = st.sampled_from(
    ["type", "properties", "required", "items", "prefixItems", "$ref", "$defs", "enum", "const", "anyOf",
     "oneOf", "allOf", "minItems", "uniqueItems", "minLength", "maxLength", "minimum", "exclusiveMaximum",
     "multipleOf", "minProperties", "additionalProperties", "not"]
)  # fmt: skip
SCHEMA_TREES = st.recursive(
    st.booleans() | st.dictionaries(SCHEMA_KEYWORDS, JSON, max_size=3),
    lambda inner: st.dictionaries(
        SCHEMA_KEYWORDS,
        inner | st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_size=4,
    ),
    max_leaves=16,
)  # schemas whose subschemas are schemas again (booleans included) at any depth


@settings(max_examples=300, deadline=None)
@given(schema=SCHEMAS_ANY, name=JSON, strict=JSON, kind=JSON)
def test_any_response_format_is_a_constraint_or_a_refusal_naming_it(
    schema: Any, name: Any, strict: Any, kind: Any
) -> None:
    """Never anything else (an uncaught error would be a 500)."""
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        {"type": kind, "json_schema": {"name": name, "schema": schema, "strict": strict}},
    ):
        try:
            constrained = structured_output(response_format, None, None)
        except StructuredOutputError as refused:
            assert refused.param == "response_format"
        else:
            if constrained is not None and constrained.json_schema is not None:
                instance_of(json.loads(constrained.json_schema))


@settings(max_examples=300, deadline=None)
@given(schema=SCHEMA_TREES)
@example(schema={"anyOf": [False]})
@example(schema={"properties": {"a": False, "b": True}, "required": ["a", "b"], "items": False})
@example(schema={"allOf": [True, {"anyOf": [False, {"type": "integer"}]}]})
def test_the_mock_answers_every_schema_let_through_and_never_raises(schema: Any) -> None:
    """Boolean subschemas, empty branches, odd nesting: the mock's builder never fails a request."""
    try:
        constrained = structured_output(json_schema_format(schema), None, None)
    except StructuredOutputError as refused:
        assert refused.param == "response_format"
        return
    assert constrained is not None and constrained.json_schema is not None
    instance_of(json.loads(constrained.json_schema))


@settings(max_examples=200, deadline=None)
@given(parameters=SCHEMAS_ANY, choice=st.sampled_from(["required", "named"]))
@example(parameters={"anyOf": [False]}, choice="required")  # a boolean subschema crashed the mock
def test_any_forced_tool_is_a_constraint_or_a_refusal_naming_tools(parameters: Any, choice: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "f"}}
    try:
        constrained = structured_output(None, [tool], tool_choice)
    except StructuredOutputError as refused:
        assert refused.param == "tools"
    else:
        assert constrained is not None and constrained.json_schema is not None
        instance_of(json.loads(constrained.json_schema))  # the mock answers any schema let through


def test_a_deeply_nested_schema_is_a_refusal_not_a_crash() -> None:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(StructuredOutputError, match="nested deeper than 48 levels"):
        structured_output(json_schema_format(schema), None, None)


def test_a_named_tool_choice_constrains_to_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    constrained = structured_output(None, [WEATHER, TIME], named)
    assert constrained is not None
    assert json.loads(constrained.json_schema or "") == TIME["function"]["parameters"]  # type: ignore[index]
    bare = {"type": "function", "function": {"name": "now"}}
    empty = structured_output(None, [bare], {"type": "function", "function": {"name": "now"}})
    assert empty is not None and json.loads(empty.json_schema or "") == {"type": "object", "properties": {}}


def test_required_is_an_array_of_calls_of_any_tool_and_wins_over_response_format() -> None:
    constrained = structured_output({"type": "json_object"}, [WEATHER, TIME], "required")
    assert constrained is not None and not constrained.json_object
    schema = json.loads(constrained.json_schema or "")
    calls = [
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}],
        [
            {"name": "get_time", "parameters": {"zone": "CET"}},
            {"name": "get_weather", "parameters": {"city": "Lyon!", "unit": "F"}},
        ],
    ]
    for value in calls:
        jsonschema.validate(value, schema)
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {"zone": "CET"}}],
        [{"name": "other", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = structured_output(None, [WEATHER, TIME], "required", parallel_tool_calls=False)
    assert single is not None and json.loads(single.json_schema or "")["maxItems"] == 1


def test_tool_defs_are_lifted_to_the_array_root_and_a_conflict_is_refused() -> None:
    with_defs = {
        "type": "function",
        "function": {
            "name": "place",
            "parameters": {
                "type": "object",
                "properties": {"at": {"$ref": "#/$defs/point"}},
                "required": ["at"],
                "$defs": {
                    "point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
                },
            },
        },
    }
    constrained = structured_output(None, [with_defs], "required")
    assert constrained is not None
    schema = json.loads(constrained.json_schema or "")
    jsonschema.validate([{"name": "place", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "place", "parameters": {"at": {}}}], schema)
    other = json.loads(json.dumps(with_defs))
    other["function"]["name"] = "move"
    other["function"]["parameters"]["$defs"]["point"] = {"type": "string"}
    with pytest.raises(StructuredOutputError) as refused:
        structured_output(None, [with_defs, other], "required")
    assert refused.value.param == "tools"


def test_a_forced_tool_with_an_invalid_parameters_schema_is_refused_naming_tools() -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    with pytest.raises(StructuredOutputError) as refused:
        structured_output(None, [broken], "required")
    assert refused.value.param == "tools" and "tools[0].function.parameters" in str(refused.value)
    # not forced: the tool is only prompt text, as before
    assert structured_output(None, [broken], "auto") is None


def test_the_preprocessor_carries_the_constraint_to_the_worker_and_refuses_with_param() -> None:
    preprocessor = OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir("qwen-vl-demo"), "qwen-vl-demo")
    request = {"model": "m", "messages": USER, "response_format": json_schema_format(CITY)}
    structured = preprocessor.preprocess(request).sampling_options.structured
    assert structured is not None and json.loads(structured.json_schema or "") == CITY
    assert preprocessor.preprocess({"model": "m", "messages": USER}).sampling_options.structured is None
    for bad, param in (
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": 3}, "response_format"),  # the decoder's refusal names the field too
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ):
        with pytest.raises(PreprocessError) as refused:
            preprocessor.preprocess({"model": "m", "messages": USER, **bad})
        assert refused.value.param == param


# -- the mock's instance and the forced-tool reader ---------------------------------------------------

SCHEMAS = [
    CITY,
    {"type": "object"},
    True,
    {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 3, "uniqueItems": True},
    {"type": ["null", "number"], "exclusiveMinimum": 1, "exclusiveMaximum": 1.5},
    {"type": "integer", "minimum": 7, "multipleOf": 5},
    {"allOf": [{"properties": {"a": {"const": 3}}, "required": ["a"]}, {"required": ["b"]}]},
    {"oneOf": [{"type": "string", "minLength": 9}, {"type": "integer"}]},
    {"type": "object", "properties": {"p": {"type": "string"}}, "minProperties": 1},
    {"prefixItems": [{"type": "boolean"}, {"const": "x"}], "minItems": 2},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_the_mock_s_instance_validates_and_is_deterministic(schema: Any) -> None:
    value = instance_of(schema)
    jsonschema.validate(value, schema)
    assert instance_of(schema) == value


def _forced_answer(forced: ForcedTool, text: str, finish: str = "stop") -> Any:
    tokenizer = Tokenizer.from_model_dir("qwen-vl-demo")
    parser = ForcedToolParser(PlainAnswerParser(vocab_of(tokenizer)), forced)
    ids = tokenizer.encode(text)
    deltas = [delta for index in range(len(ids)) for delta in parser.feed(ids[index : index + 1])]
    return fold_deltas([*deltas, *parser.finish(finish)])


def test_the_forced_reader_turns_the_constrained_json_into_the_calls() -> None:
    named = _forced_answer(ForcedTool("get_time"), ' {"zone": "CET"}\n')
    assert named.content == ""
    assert [(call.name, call.arguments, call.index) for call in named.tool_calls] == [
        ("get_time", '{"zone":"CET"}', 0)
    ]
    required = _forced_answer(
        ForcedTool(None),
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, '
        '{"name": "get_time", "parameters": {"zone": "CET"}}]',
    )
    assert [(call.name, json.loads(call.arguments), call.index) for call in required.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}, 0),
        ("get_time", {"zone": "CET"}, 1),
    ]
    assert len({call.id for call in required.tool_calls}) == 2


@pytest.mark.parametrize(
    ("forced", "text"),
    [
        (ForcedTool("get_time"), '{"zone": "CE'),  # cut by max_tokens
        (ForcedTool("get_time"), "[1, 2]"),
        (ForcedTool(None), '{"name": "get_time", "parameters": {}}'),
        (ForcedTool(None), '[{"name": "get_time"}]'),
        (ForcedTool(None), "[]"),
    ],
)
def test_output_that_is_not_the_forced_shape_is_released_as_content(forced: ForcedTool, text: str) -> None:
    answer = _forced_answer(forced, text, "length")
    assert answer.tool_calls == [] and answer.content == text


# -- end to end: the official openai client, a real frontend, mock workers -------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flavors = zip(MODELS, ("vllm", "sglang"), strict=True)
    workers = [("--model-path", model, "--flavor", flavor) for model, flavor in flavors]
    with mock_cluster(tmp_path_factory.mktemp("structured"), workers, log_level="debug") as running:
        yield running


def _refusal(call: Any) -> tuple[str | None, str]:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.param, refused.value.message  # type: ignore[attr-defined]


def test_refusals_over_http_are_400s_naming_the_param(cluster: Cluster) -> None:
    client = openai_client(cluster)
    create = client.chat.completions.create
    bad_schema = json_schema_format({"type": "objekt"})
    param, message = _refusal(lambda: create(model=MODELS[0], messages=USER, response_format=bad_schema))  # type: ignore[arg-type]
    assert param == "response_format" and "not a valid JSON Schema" in message
    param, message = _refusal(lambda: create(model=MODELS[0], messages=USER, response_format={"type": "xml"}))  # type: ignore[arg-type,typeddict-item]
    assert param == "response_format" and "json_schema" in message
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    param, _ = _refusal(
        lambda: create(model=MODELS[0], messages=USER, tools=[broken], tool_choice="required")
    )  # type: ignore[arg-type,list-item]
    assert param == "tools"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_answers_validate(cluster: Cluster, model: str, stream: bool) -> None:
    client = openai_client(cluster)
    response_format = json_schema_format(CITY)
    if not stream:
        reply = client.chat.completions.create(model=model, messages=USER, response_format=response_format)  # type: ignore[arg-type]
        content = reply.choices[0].message.content or ""
        assert reply.choices[0].finish_reason == "stop"
    else:
        chunks = client.chat.completions.create(
            model=model,
            messages=USER,  # type: ignore[arg-type]
            response_format=response_format,  # type: ignore[arg-type]
            stream=True,
        )
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(content), CITY)


@pytest.mark.parametrize("model", MODELS)
def test_json_object_answers_are_a_json_object(cluster: Cluster, model: str) -> None:
    reply = openai_client(cluster).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


class Step(BaseModel):
    explanation: str
    output: str


class MathAnswer(BaseModel):
    steps: list[Step]
    final_answer: str


def test_the_sdk_s_parse_with_a_pydantic_model(cluster: Cluster) -> None:
    completion = openai_client(cluster).chat.completions.parse(
        model=MODELS[0],
        messages=[{"role": "user", "content": "Solve 8x + 7 = -23."}],
        response_format=MathAnswer,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, MathAnswer)
    jsonschema.validate(parsed.model_dump(), MathAnswer.model_json_schema())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_a_declared_tool_with_valid_arguments(
    cluster: Cluster, model: str, stream: bool
) -> None:
    """``city`` needs 5 characters: the mock's unconstrained call (``"mock"``) would not validate."""
    client = openai_client(cluster)
    asked: dict[str, Any] = {
        "model": model,
        "messages": USER,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
    }
    if not stream:
        reply = client.chat.completions.create(**asked)
        choice = reply.choices[0]
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]  # type: ignore[union-attr]
        finish = choice.finish_reason
    else:
        chunks = list(client.chat.completions.create(**asked, stream=True))
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        for chunk in chunks:
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                if call.function and call.function.arguments:
                    arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
        calls = [(names[index], arguments.get(index, "")) for index in sorted(names)]
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
    assert calls and finish == "tool_calls"
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}  # type: ignore[index]
    for name, text in calls:
        jsonschema.validate(json.loads(text or ""), schemas[name])


@pytest.mark.parametrize("model", MODELS)
def test_a_named_tool_choice_calls_that_tool(cluster: Cluster, model: str) -> None:
    reply = openai_client(cluster).chat.completions.create(
        model=model,
        messages=USER,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = reply.choices[0].message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_time"]  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME["function"]["parameters"])  # type: ignore[union-attr,index]
    assert reply.choices[0].message.content in (None, "")


def test_the_sdk_s_parse_with_a_pydantic_function_tool(cluster: Cluster) -> None:
    class GetTime(BaseModel):
        zone: str

    tool = openai.pydantic_function_tool(GetTime, name="get_time")
    completion = openai_client(cluster).chat.completions.parse(
        model=MODELS[1],
        messages=USER,  # type: ignore[arg-type]
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = completion.choices[0].message.tool_calls or []
    assert len(calls) == 1 and isinstance(calls[0].function.parsed_arguments, GetTime)


def test_the_up_banner_s_structured_request_answers_json_valid_under_its_schema(cluster: Cluster) -> None:
    """``make up`` prints this request (dynamo_prep/cli/up.py): its body, sent as printed."""
    base_url = str(cluster)
    command = shlex.split(structured_curl_command(base_url, MODELS[0]))
    body = json.loads(command[command.index("-d") + 1])
    answer = httpx.post(command[2], json=body, timeout=30, trust_env=False)
    assert answer.status_code == 200, answer.text
    content = answer.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), DEMO_SCHEMA)
