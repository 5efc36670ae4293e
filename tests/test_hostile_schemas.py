"""Issue 25, rows 1, 2, 4 and 11: schema and grammar bombs against a real frontend with mock workers.

Every schema is bounded by one linear pass before anything else reads it (a 400 naming the
parameter and the limit, never the schema echoed back), its metaschema check runs in a checker
process that is killed when its client leaves, and the mock builds at most ``max_tokens`` of an
instance. ``/live`` is polled while each attack runs and must answer every poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jsonschema._utils import equal
from support.cluster import Cluster, mock_cluster
from support.plane import wait_for
from test_structured_outputs import SCHEMA_TREES, json_schema_format

from dynamo_prep.engines.mock.instance import instance_of
from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.frontend.schema_checks import SchemaChecks
from dynamo_prep.preprocessor import PreprocessError
from dynamo_prep.protocol.schema_bounds import SchemaLimits, distinct, measure, smallest_instance_chars
from dynamo_prep.protocol.structured import (
    SchemaUse,
    StructuredOutputError,
    TokenBudget,
    schema_problem,
    structured_output,
)

MODEL = "qwen-vl-demo"
USER = [{"role": "user", "content": "Tell me about Paris."}]
LIVE_TIMEOUT_S = 5.0  # a poll unanswered this long means the loop is frozen (rows 1, 2: 4-21 s)
TYPE_BOMB_32KB = {"type": [{}, *([index] for index in range(4_500))]}  # row 1: 32 KB, valid JSON
TYPE_BOMB_200KB = {"type": [{}, *([index] for index in range(25_000))]}  # row 2
LONG_STRING = {"type": "string", "minLength": 30_000_000}  # row 11: 41 bytes


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


class LivePoller:
    """GET /live over and over from a thread while an attack runs: every poll must answer 200."""

    def __init__(self, url: str) -> None:
        self._url = f"{url}/live"
        self._stop = threading.Event()
        self.answers: list[int | str] = []
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(trust_env=False, timeout=LIVE_TIMEOUT_S) as http:
            while not self._stop.is_set():
                try:
                    self.answers.append(http.get(self._url).status_code)
                except httpx.HTTPError as exc:
                    self.answers.append(repr(exc))
                self._stop.wait(0.01)  # the poll period, not a synchronisation

    def __enter__(self) -> LivePoller:
        self._thread.start()
        wait_for(lambda: self.answers, 10, message="a first /live answer")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        failed = [answer for answer in self.answers if answer != 200]
        assert not failed, f"/live did not answer every poll during the attack: {failed[:3]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workers = [("--model-path", MODEL, "--flavor", "vllm")]
    with mock_cluster(tmp_path_factory.mktemp("hostile-schemas"), workers) as running:
        yield running


def post(cluster: Cluster, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=120) as http:
        return http.post(f"{cluster}{path}", json=body)


def attack(cluster: Cluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One hostile request with /live polled throughout: its 400's error object."""
    with LivePoller(str(cluster)):
        answer = post(cluster, path, body)
    assert answer.status_code == 400, answer.text[:500]
    assert len(answer.content) < 2_000, "the refusal echoes the schema"
    error: dict[str, Any] = answer.json()["error"]
    return error


def chat(response_format: Any = None, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": USER, **fields}
    if response_format is not None:
        body["response_format"] = response_format
    return body


def responses(schema: Any, **fields: Any) -> dict[str, Any]:
    text = {"format": {"type": "json_schema", "name": "bomb", "schema": schema}}
    return {"model": MODEL, "input": "Tell me about Paris.", "text": text, **fields}


def forced(schema: Any, **fields: Any) -> dict[str, Any]:
    return chat(tools=[tool(schema)], tool_choice="required", **fields)


# -- rows 1 and 2: the quadratic uniqueItems bomb -----------------------------------------------------


@pytest.mark.parametrize("bomb", [TYPE_BOMB_32KB, TYPE_BOMB_200KB], ids=["32KB", "200KB"])
def test_the_type_list_bomb_is_refused_at_once_in_chat_naming_the_limit(cluster: Cluster, bomb: Any) -> None:
    error = attack(cluster, "/v1/chat/completions", chat(json_schema_format(bomb)))
    assert error["param"] == "response_format"
    assert "max_type_items" in error["message"] and "'type'" in error["message"]


def test_the_type_list_bomb_is_refused_in_responses_text_format(cluster: Cluster) -> None:
    error = attack(cluster, "/v1/responses", responses(TYPE_BOMB_32KB))
    assert error["param"] == "text.format" and "max_type_items" in error["message"]


def test_the_type_list_bomb_is_refused_in_a_forced_tool(cluster: Cluster) -> None:
    error = attack(cluster, "/v1/chat/completions", forced(TYPE_BOMB_32KB))
    assert error["param"] == "tools" and "max_type_items" in error["message"]
    assert "tools[0].function.parameters" in error["message"]


def test_a_non_string_list_where_the_metaschema_wants_distinct_names_is_refused(cluster: Cluster) -> None:
    """``required`` of unsortable items: jsonschema's uniqueItems fell back to comparing every pair."""
    bomb = {"type": "object", "required": [{}, *([index] for index in range(900))]}
    error = attack(cluster, "/v1/chat/completions", chat(json_schema_format(bomb)))
    assert error["param"] == "response_format" and "'required'" in error["message"]


# -- row 4: schemas that take a grammar compiler minutes ---------------------------------------------


@pytest.mark.parametrize(
    ("schema", "limit"),
    [
        ({"enum": [f"value-{index}" for index in range(200_000)]}, "max_enum_items"),
        (
            {"type": "object", "required": [f"p{index}" for index in range(20_000)]},
            "max_required",
        ),
        (
            {"type": "object", "properties": {f"p{index}": {"type": "string"} for index in range(20_000)}},
            "max_properties",
        ),
        ({"anyOf": [{"type": "integer", "minimum": index} for index in range(20_000)]}, "max_nodes"),
        ({"description": "x" * 500_000}, "max_chars"),
    ],
    ids=["enum", "required", "properties", "nodes", "chars"],
)
def test_large_schemas_are_refused_naming_the_parameter_and_the_limit(
    cluster: Cluster, schema: Any, limit: str
) -> None:
    for path, body, param in (
        ("/v1/chat/completions", chat(json_schema_format(schema)), "response_format"),
        ("/v1/responses", responses(schema), "text.format"),
        ("/v1/chat/completions", forced(schema), "tools"),
    ):
        error = attack(cluster, path, body)
        assert error["param"] == param
        assert limit in error["message"]


# -- row 11: a tiny schema whose smallest instance is huge -------------------------------------------


@pytest.mark.parametrize("length", [30_000_000, 100_000_000])
def test_a_schema_whose_smallest_instance_cannot_fit_the_token_budget_is_refused(
    cluster: Cluster, length: int
) -> None:
    schema = {"type": "string", "minLength": length}
    for path, body, param in (
        ("/v1/chat/completions", chat(json_schema_format(schema)), "response_format"),
        ("/v1/chat/completions", chat(json_schema_format(schema), max_tokens=100), "response_format"),
        ("/v1/responses", responses(schema), "text.format"),
        ("/v1/chat/completions", forced(schema), "tools"),
    ):
        error = attack(cluster, path, body)
        assert error["param"] == param
        assert "max_tokens" in error["message"] or "context length" in error["message"]


def test_nested_counts_multiply_in_the_smallest_instance(cluster: Cluster) -> None:
    """Each bound alone fits; together (a reference in a loop of arrays) they ask for 10^9 items."""
    schema = {
        "$defs": {"row": {"type": "array", "minItems": 1000, "items": {"type": "string", "minLength": 10}}},
        "type": "array",
        "minItems": 1000,
        "items": {"$ref": "#/$defs/row"},
    }
    error = attack(cluster, "/v1/chat/completions", chat(json_schema_format(schema)))
    assert error["param"] == "response_format" and "max_tokens" in error["message"]


def test_an_ordinary_structured_chat_is_served_between_the_attacks(cluster: Cluster) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 40}},
        "required": ["city"],
    }
    body = chat(json_schema_format(schema), messages=[{"role": "user", "content": "x" * 40_000}])
    answer = post(cluster, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text[:300]
    jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), schema)
    cut = post(cluster, "/v1/chat/completions", chat(json_schema_format(schema), max_tokens=5))
    assert cut.status_code == 200 and cut.json()["choices"][0]["finish_reason"] == "length"


# -- a client leaving mid-check leaves no CPU burning --------------------------------------------------


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", trust_env=False, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _checkers(parent: int) -> set[int]:
    """The frontend's checker processes (its children running ``schema_process``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"schema_process" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    return found


def test_a_client_leaving_mid_check_stops_the_check(tmp_path: Path) -> None:
    """Limits raised so that one check takes many seconds; the client leaves while it runs."""
    raised = ["--schema-limit", "max_nodes=200000", "--schema-limit", "max_chars=8000000",
              "--schema-limit", "check_timeout_s=600"]  # fmt: skip
    workers = [("--model-path", MODEL, "--flavor", "vllm")]
    with mock_cluster(tmp_path, workers, frontend_args=raised) as cluster:
        url = str(cluster)
        schema = {"anyOf": [{"type": "integer", "minimum": index} for index in range(40_000)]}
        body = json.dumps(chat(json_schema_format(schema))).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        with LivePoller(url):
            client = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            client.sendall(head + body)
            wait_for(lambda: _metric(url, "dynamo_frontend_schema_checks_in_flight") == 1, 60,
                     message="the check running")  # fmt: skip
            [checker] = wait_for(lambda: _checkers(cluster.frontend.pid), 30, message="a checker process")
            client.close()
            wait_for(lambda: _metric(url, "dynamo_frontend_schema_checks_in_flight") == 0, 30,
                     message="the check stopped")  # fmt: skip
            wait_for(lambda: checker not in _checkers(cluster.frontend.pid), 30, message="the checker killed")
        assert _metric(url, 'dynamo_frontend_schema_checks_total{outcome="cancelled"}') == 1
        # the next check starts a new checker and is served
        answer = post(cluster, "/v1/chat/completions", chat(json_schema_format({"type": "integer"})))
        assert answer.status_code == 200, answer.text[:300]


# -- properties of the pre-pass and of the mock -------------------------------------------------------

COUNTS = st.sampled_from(["minLength", "minItems", "minProperties", "maxLength", "maxItems"])
BIG_SCHEMAS = st.recursive(
    st.dictionaries(COUNTS, st.integers(min_value=0, max_value=10**12), max_size=2)
    | st.fixed_dictionaries({"type": st.sampled_from(["array", "string", "object"])}),
    lambda inner: st.fixed_dictionaries(
        {"type": st.sampled_from(["array", "object"]), "minItems": st.integers(0, 10**6)},
        optional={
            "items": inner,
            "properties": st.dictionaries(st.text(max_size=3), inner, max_size=3),
            "required": st.lists(st.text(max_size=3), max_size=3, unique=True),
            "anyOf": st.lists(inner, min_size=1, max_size=3),
        },
    ),
    max_leaves=12,
)
BUDGET = TokenBudget(2_000, 8)


@settings(max_examples=300, deadline=None)
@given(schema=SCHEMA_TREES | BIG_SCHEMAS)
@example(schema=LONG_STRING)
@example(schema={"type": "array", "minItems": 10**9, "items": {"type": "array", "minItems": 10**9}})
def test_every_schema_the_edge_lets_through_builds_in_the_mock_within_its_budget(schema: Any) -> None:
    try:
        constrained = structured_output(json_schema_format(schema), None, None, budget=BUDGET)
    except StructuredOutputError as refused:
        assert refused.param == "response_format"
        return
    assert constrained is not None and constrained.json_schema is not None
    built = instance_of(json.loads(constrained.json_schema), max_chars=BUDGET.chars)
    text = json.dumps(built, ensure_ascii=False)  # as the mock engine writes it
    assert len(text) <= BUDGET.chars + 2 * len(constrained.json_schema) + 1_000


@settings(max_examples=200, deadline=None)
@given(schema=SCHEMA_TREES | BIG_SCHEMAS)
def test_the_smallest_instance_is_a_lower_bound(schema: Any) -> None:
    """Whenever the mock's instance is valid, it is at least as long as the bound says."""
    if not isinstance(schema, dict) or schema_problem(schema) is not None:
        return
    value = instance_of(schema, max_chars=10_000)
    try:
        jsonschema.validate(value, schema)
    except (jsonschema.ValidationError, jsonschema.SchemaError, RecursionError):
        return
    assert len(json.dumps(value, separators=(",", ":"), ensure_ascii=False)) >= smallest_instance_chars(
        schema
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([1.0, 2.5, -0.0]) | st.text(max_size=2),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=500, deadline=None)
@given(values=st.lists(JSON, max_size=6))
def test_distinct_agrees_with_jsonschema_s_pairwise_equality(values: list[Any]) -> None:
    """The linear check answers as comparing every pair with jsonschema's JSON equality (1 equals
    1.0, true is not 1). Not as its ``uniqueItems``: that sorts first when it can, and Python's
    order takes ``[false]`` for ``[0]``, so ``[[0], [false], [0]]`` passes as unique there."""
    unique = all(not equal(a, b) for index, a in enumerate(values) for b in values[index + 1 :])
    assert distinct(values) == unique


def test_the_pre_pass_is_linear_and_stops_at_the_first_bound() -> None:
    """200,000 enum values, 20,000 nested levels: refused after a bounded walk (no recursion)."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(20_000):
        deep = {"items": deep}
    for schema, limit in (
        ({"enum": list(range(200_000))}, "max_enum_items"),
        (deep, "max_depth"),
        ({"properties": {"type": {"type": "string"}, "enum": {"const": 1}}, "required": ["type"]}, None),
    ):
        try:
            measure(schema, SchemaLimits(), what="'s'")
        except ValueError as exc:
            assert getattr(exc, "limit", None) == limit
        else:
            assert limit is None


# -- the checker processes: deadline, admission ------------------------------------------------------

SLOW = {"anyOf": [{"type": "integer", "minimum": index} for index in range(20_000)]}  # seconds to check


def _use(schema: Any) -> SchemaUse:
    return SchemaUse(schema, "response_format", "'json_schema.schema'")


def test_a_check_past_its_deadline_is_a_400_naming_the_limit_and_its_checker_is_killed() -> None:
    async def run() -> None:
        checks = SchemaChecks(SchemaLimits(check_timeout_s=0.2))
        try:
            with pytest.raises(PreprocessError) as refused:
                await checks.check([_use(SLOW)])
            assert refused.value.param == "response_format" and "check_timeout_s" in refused.value.message
            assert checks.in_flight == 0
            await checks.check([_use({"type": "integer"})])  # a new checker takes the next one
        finally:
            await checks.close()
        assert not _checkers(os.getpid())

    asyncio.run(run())


def test_checks_past_the_queue_are_refused_with_503_and_cancelled_ones_free_their_place() -> None:
    async def run() -> None:
        checks = SchemaChecks(SchemaLimits(check_processes=1, check_queue=1, check_timeout_s=600))
        try:
            running = asyncio.ensure_future(checks.check([_use(SLOW)]))
            while not _checkers(os.getpid()):  # the first check has its checker process
                await asyncio.sleep(0.05)
            waiting = asyncio.ensure_future(checks.check([_use({**SLOW, "title": "other"})]))
            while checks.in_flight < 2:
                await asyncio.sleep(0)
            with pytest.raises(OpenAIError) as busy:
                await checks.check([_use({**SLOW, "title": "third"})])
            assert busy.value.status == 503
            [checker] = _checkers(os.getpid())
            running.cancel()
            waiting.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            assert checks.in_flight == 0
        finally:
            await checks.close()
        assert checker not in _checkers(os.getpid())

    asyncio.run(run())
