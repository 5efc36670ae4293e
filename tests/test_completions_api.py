"""``POST /v1/completions`` with the official ``openai`` client against a real frontend and mock
workers: every prompt shape (a string, strings, ids, lists of ids), streamed and not, ``n`` and a
batch (index = prompt_index * n + i), ``echo``, stop strings, ``max_tokens``' default of 16, usage
(each prompt counted once), logprobs, refusals naming ``param`` (suffix, best_of, echo with logprobs,
n, ids outside the vocabulary or the context), and a fuzz of the request body (never a 500).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.preprocessor import MAX_CHOICES, MAX_N
from dynamo_prep.protocol.completions import DEFAULT_MAX_TOKENS

QWEN = "qwen-vl-demo"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workers = [("--model-path", QWEN)] * 2
    with mock_cluster(tmp_path_factory.mktemp("completions"), workers) as running:
        yield running


CHATML = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"


def tokenize(url: str, text: str) -> list[int]:
    """The ids the frontend's /tokenize gives ``text`` with special tokens parsed (as completions do)."""
    body = {"model": QWEN, "prompt": text, "add_special_tokens": True}
    tokens: list[int] = httpx.post(f"{url}/tokenize", json=body, trust_env=False).json()["tokens"]
    return tokens


def refusal(url: str, **body: Any) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/completions", json={"model": QWEN, **body}, trust_env=False, timeout=30)
    assert answer.status_code == 400, answer.text
    error: dict[str, Any] = answer.json()["error"]
    return error


def test_a_string_prompt_is_tokenized_as_it_is_special_token_text_included(cluster: str) -> None:
    answer = client(cluster).completions.create(model=QWEN, prompt=CHATML, max_tokens=200)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    [choice] = answer.choices
    # the mock read a user turn: the special-token text became the special tokens
    assert "You said: hello there" in choice.text and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.text  # plain text: special ids are never text
    assert answer.usage is not None and answer.usage.prompt_tokens == len(tokenize(cluster, CHATML))
    assert answer.usage.completion_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_every_prompt_shape_gives_the_same_answer(cluster: str) -> None:
    ids = tokenize(cluster, CHATML)
    api = client(cluster)
    texts = {
        kind: [c.text for c in api.completions.create(model=QWEN, prompt=prompt, max_tokens=200).choices]
        for kind, prompt in {
            "string": CHATML, "strings": [CHATML, CHATML], "ids": ids, "lists of ids": [ids, ids],
        }.items()
    }  # fmt: skip
    [text] = texts["string"]
    assert texts == {"string": [text], "strings": [text, text], "ids": [text], "lists of ids": [text, text]}


def test_a_batch_with_n_indexes_choices_and_counts_each_prompt_once(cluster: str) -> None:
    other = CHATML.replace("hello there", "good night")
    api = client(cluster)
    one = {p: api.completions.create(model=QWEN, prompt=p, max_tokens=200) for p in (CHATML, other)}
    answer = api.completions.create(model=QWEN, prompt=[CHATML, other], n=2, max_tokens=200)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    expected = [one[CHATML].choices[0].text] * 2 + [one[other].choices[0].text] * 2
    assert [choice.text for choice in answer.choices] == expected
    assert answer.usage is not None
    singles = [one[p].usage for p in (CHATML, other)]
    assert answer.usage.prompt_tokens == sum(u.prompt_tokens for u in singles if u)
    assert answer.usage.completion_tokens == 2 * sum(u.completion_tokens for u in singles if u)


def test_streamed_chunks_add_up_to_the_answer_with_usage_last(cluster: str) -> None:
    api = client(cluster)
    whole = api.completions.create(model=QWEN, prompt=[CHATML, CHATML], n=2, max_tokens=200)
    stream = api.completions.create(
        model=QWEN, prompt=[CHATML, CHATML], n=2, max_tokens=200, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {choice.index: choice.text for choice in whole.choices}
    assert finishes == {index: ["stop"] for index in range(4)}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_one_done_and_no_usage_unless_asked(cluster: str) -> None:
    body = {"model": QWEN, "prompt": CHATML, "n": 3, "stream": True, "max_tokens": 200}
    answer = httpx.post(f"{cluster}/v1/completions", json=body, trust_env=False, timeout=30)
    assert answer.status_code == 200 and answer.text.count("data: [DONE]") == 1
    assert answer.text.endswith("data: [DONE]\n\n") and '"usage":{' not in answer.text


def test_echo_prepends_the_prompt_text(cluster: str) -> None:
    api = client(cluster)
    plain = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200).choices[0].text
    echoed = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200, echo=True).choices[0].text
    assert echoed == CHATML + plain
    ids = api.completions.create(model=QWEN, prompt=tokenize(cluster, CHATML), max_tokens=200, echo=True)
    assert ids.choices[0].text == CHATML + plain  # ids are echoed as their text
    stream = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200, echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == CHATML + plain


def test_stop_strings_and_the_default_max_tokens(cluster: str) -> None:
    api = client(cluster)
    plain = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200).choices[0]
    stopped = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200, stop=["You said"]).choices[0]
    assert stopped.text == plain.text[: plain.text.index("You said")] and stopped.finish_reason == "stop"
    short = api.completions.create(model=QWEN, prompt=CHATML)
    assert short.usage is not None and short.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert short.choices[0].finish_reason == "length"


def test_logprobs_of_every_generated_token(cluster: str) -> None:
    api = client(cluster)
    answer = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and answer.usage is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == answer.usage.completion_tokens
    assert all(value is not None and value <= 0 for value in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and all(0 < len(top) <= 2 for top in logprobs.top_logprobs)
    stream = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200, logprobs=2, stream=True)
    streamed = [
        t
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.tokens or []
    ]
    assert streamed == logprobs.tokens


def test_a_batch_with_logprobs_is_one_exact_json_answer(cluster: str) -> None:
    """The answer is written in pieces (each choice's logprobs apart from the rest): its length
    header is exact, its NULs in text stay text, and each choice equals its stream."""
    said = "<|im_start|>user\nsay \x00 and \x00\x00<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": QWEN, "prompt": [said, CHATML], "n": 2, "max_tokens": 60, "logprobs": 2}
    answer = httpx.post(f"{cluster}/v1/completions", json=body, trust_env=False, timeout=30)
    assert answer.status_code == 200 and int(answer.headers["content-length"]) == len(answer.content)
    choices = answer.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3] and "\x00" in choices[0]["text"]
    streamed = client(cluster).completions.create(**body, stream=True)  # type: ignore[call-overload]
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in streamed:
        for part in chunk.choices:
            texts[part.index] = texts.get(part.index, "") + part.text
            tokens.setdefault(part.index, []).extend(part.logprobs.tokens if part.logprobs else [])
    assert texts == {choice["index"]: choice["text"] for choice in choices}
    assert tokens == {choice["index"]: choice["logprobs"]["tokens"] for choice in choices}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"prompt": ["a"] * (MAX_CHOICES // 2 + 1), "n": 2}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"prompt": 7}, "prompt"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_refusals_name_the_parameter(cluster: str, body: dict[str, Any], param: str) -> None:
    error = refusal(cluster, **{"prompt": "hi", **body})
    assert error["param"] == param and error["message"], error


def test_a_prompt_longer_than_the_context_is_refused_naming_prompt(cluster: str) -> None:
    context = httpx.post(f"{cluster}/tokenize", json={"model": QWEN, "prompt": "x"}, trust_env=False).json()[
        "max_model_len"
    ]
    error = refusal(cluster, prompt=[tokenize(cluster, "hello")[0]] * (context + 1))
    assert error["param"] == "prompt" and str(context) in error["message"]


def test_the_request_is_recorded_with_its_summed_usage(cluster: Cluster) -> None:
    answer = httpx.post(
        f"{cluster}/v1/completions",
        json={"model": QWEN, "prompt": [CHATML, CHATML], "n": 2, "max_tokens": 200},
        headers={"x-request-id": "cmpl-record-1"}, trust_env=False, timeout=30,
    )  # fmt: skip
    usage = answer.json()["usage"]
    line = cluster.frontend.wait_event("request_finished", request_id="cmpl-record-1")
    assert line["path"] == "/v1/completions" and line["status"] == 200
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


_ids = st.lists(st.integers(min_value=-5, max_value=200_000), max_size=6)
_prompt = st.one_of(
    st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3), _ids, st.lists(_ids, max_size=3),
    st.integers(), st.none(), st.just([[1, "a"]]),
)  # fmt: skip
_body = st.fixed_dictionaries(
    {"model": st.sampled_from([QWEN, "nope"]), "prompt": _prompt},
    optional={
        "max_tokens": st.integers(min_value=-2, max_value=70_000),
        "n": st.integers(min_value=-1, max_value=20),
        "best_of": st.integers(min_value=0, max_value=4),
        "echo": st.booleans(),
        "logprobs": st.integers(min_value=-1, max_value=22),
        "suffix": st.one_of(st.none(), st.text(max_size=3)),
        "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "temperature": st.floats(min_value=-1, max_value=3, allow_nan=False),
        "seed": st.integers(min_value=-(2**63), max_value=2**63 - 1),
        "top_p": st.floats(allow_nan=False, allow_infinity=False),
        "stop_token_ids": _ids,
        "min_tokens": st.integers(min_value=-1, max_value=30),
    },
)


def test_fuzzed_bodies_are_answered_or_refused_never_a_500(cluster: Cluster) -> None:
    with httpx.Client(trust_env=False, timeout=30) as http:

        @settings(
            max_examples=150,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(_body)
        def run(body: dict[str, Any]) -> None:
            answer = http.post(f"{cluster}/v1/completions", json=body)
            assert answer.status_code in (200, 400, 404), (body, answer.text)
            if answer.status_code != 200:
                assert answer.json()["error"]["message"]
            elif body.get("stream"):
                assert answer.text.endswith("data: [DONE]\n\n") and '"error"' not in answer.text
            else:
                choices = answer.json()["choices"]
                assert sorted(choice["index"] for choice in choices) == list(range(len(choices)))

        run()


# -- the chat path's routing and migration serve completions too -------------------------------------


@pytest.fixture
def procs() -> Iterator[list[DynamoProcess]]:
    started: list[DynamoProcess] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.stop()


def _pool(
    tmp_path: Path, procs: list[DynamoProcess], *frontend_args: str, worker_args: tuple[str, ...]
) -> tuple[DynamoProcess, str, dict[str, DynamoProcess]]:
    """A frontend (debug logs: ``request_routed``) and two same-flavor Qwen workers by instance id."""
    port, discovery = free_port(), tcp_endpoint()
    frontend = start_dynamo(
        "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
        "--cache-dir", str(tmp_path / "cache"), *frontend_args,
    )  # fmt: skip
    procs.append(frontend)
    workers: dict[str, DynamoProcess] = {}
    for _ in range(2):
        worker = start_dynamo("worker", "--model-path", QWEN, "--discovery", discovery, *worker_args)
        procs.append(worker)
        workers[worker.wait_event("worker_started")["instance_id"]] = worker
    wait_for(lambda: len(frontend.find("instance_added")) >= 2, 30, message="both workers")
    wait_for(lambda: frontend.find("model_added"), 30, message="the model")
    return frontend, f"http://127.0.0.1:{port}", workers


def test_a_completion_migrates_when_its_worker_dies_mid_stream(
    tmp_path: Path, procs: list[DynamoProcess]
) -> None:
    options = ("--token-delay", "0.04", "--heartbeat", "0.2", "--ttl-ms", "800", "--migration-limit", "1")
    frontend, url, workers = _pool(tmp_path, procs, worker_args=options)
    api = client(url)
    expected = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200).choices[0].text
    routed_before = len(frontend.find("request_routed"))
    text = ""
    stream = api.completions.create(model=QWEN, prompt=CHATML, max_tokens=200, stream=True)
    for count, chunk in enumerate(stream, start=1):
        text += "".join(choice.text for choice in chunk.choices)
        if count == 3:
            routed = frontend.find("request_routed")[routed_before]
            workers[routed["instance_id"]].kill()
    assert text == expected  # the continuation picked up exactly where it stopped
    assert frontend.find("request_migrated")


def test_kv_routing_hashes_a_completion_prompt(tmp_path: Path, procs: list[DynamoProcess]) -> None:
    kv = ("--token-delay", "0", "--kv-events", "--kv-blocks", "4096")
    frontend, url, _ = _pool(tmp_path, procs, "--router-mode", "kv", worker_args=kv)
    prompt = "The archivist of a very old library answers with care and cites shelves. " * 12
    with httpx.Client(trust_env=False, timeout=30) as http:

        def ask(request_id: str) -> dict[str, Any]:
            body = {"model": QWEN, "prompt": prompt, "max_tokens": 4}
            answer = http.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id})
            assert answer.status_code == 200, answer.text
            return frontend.wait_event("request_finished", request_id=request_id)

        def applied() -> bool:
            text = http.get(f"{url}/metrics").text
            return any(
                line.startswith('dynamo_frontend_kv_blocks_applied_total{kind="stored"}')
                and float(line.rsplit(" ", 1)[1]) > 0
                for line in text.splitlines()
            )

        first = ask("kv-cmpl-1")
        wait_for(applied, 20, message="the first prompt's blocks in the frontend's index")
        again = ask("kv-cmpl-2")
    assert first["prompt_blocks"] > 0 and again["kv_overlap_blocks"] > 0
    assert again["instance_id"] == first["instance_id"]
