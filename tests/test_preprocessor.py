"""The preprocessor: formatter + tokenizer joined, exact ids, one warning, clear 400s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.formatter import (
    DEFAULT_IMAGE_PLACEHOLDER,
    JinjaFormatter,
    KimiK3Formatter,
    checkpoint_image_placeholder,
    is_kimi_k3,
    kimi_k3_formatter_for,
    prompt_formatter_for,
)
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    OpenAIPreprocessor,
    PreprocessError,
    stop_strings,
)
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.tokenizer import Tokenizer

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
DATA_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def k3_preprocessor(model_dir: str | Path, token: str | None = None) -> OpenAIPreprocessor:
    card = ModelDeploymentCard.from_model_dir(
        model_dir, runtime_config=ModelRuntimeConfig(image_placeholder_token=token)
    )
    return OpenAIPreprocessor.new(card, model_dir)


@pytest.fixture(scope="module")
def k3() -> OpenAIPreprocessor:
    return k3_preprocessor("kimi-k3-demo")


@pytest.fixture(scope="module")
def k3_sglang() -> OpenAIPreprocessor:
    return k3_preprocessor("kimi-k3-demo", "<|media_pad|>")


@pytest.fixture(scope="module")
def qwen() -> OpenAIPreprocessor:
    return OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir("qwen-vl-demo"), "qwen-vl-demo")


# --- construction and the declared-token check ------------------------------------------------


def test_new_builds_k3_and_jinja_formatters(k3: OpenAIPreprocessor, qwen: OpenAIPreprocessor) -> None:
    assert isinstance(k3.formatter, KimiK3Formatter)
    assert isinstance(qwen.formatter, JinjaFormatter)
    assert k3.formatter.rendered_token == "<|kimi_image_placeholder|>"


def test_unregistered_declared_token_warns_once_per_preprocessor_not_per_request() -> None:
    tokenizer = Tokenizer.from_model_dir("kimi-k3-demo")
    card = ModelDeploymentCard.from_model_dir(
        "kimi-k3-demo", runtime_config=ModelRuntimeConfig(image_placeholder_token="<|not_a_token|>")
    )
    formatter = prompt_formatter_for(card, "kimi-k3-demo", image_placeholder_token="<|not_a_token|>")
    with structlog.testing.capture_logs() as logs:
        preprocessor = OpenAIPreprocessor.new_with_parts(card, formatter, tokenizer)
        for _ in range(3):
            preprocessor.preprocess(chat(user([IMAGE, {"type": "text", "text": "hi"}])))
    warnings = [entry for entry in logs if entry["event"] == "declared_image_token_unregistered"]
    assert len(warnings) == 1
    warning = warnings[0]
    assert warning["log_level"] == "warning"
    assert warning["model"] == card.display_name
    assert warning["token"] == "<|not_a_token|>"
    assert warning["ids"] == tokenizer.encode("<|not_a_token|>")
    assert len(warning["ids"]) > 1
    assert warning["rendered"] is True
    assert warning["formatter"] == "kimi_k3"


def test_registered_declared_token_does_not_warn() -> None:
    with structlog.testing.capture_logs() as logs:
        k3_preprocessor("kimi-k3-demo", "<|media_pad|>")
        k3_preprocessor("kimi-k3-demo", None)
    assert not [entry for entry in logs if entry["event"] == "declared_image_token_unregistered"]


# --- the declared token, exactly -------------------------------------------------------------


def test_declared_media_pad_is_one_id_per_image(k3_sglang: OpenAIPreprocessor) -> None:
    tokenizer = k3_sglang.tokenizer
    media_pad = tokenizer.token_to_id("<|media_pad|>")
    request = chat(user([{"type": "text", "text": "a "}, IMAGE, {"type": "text", "text": " b"}, DATA_IMAGE]))
    out = k3_sglang.preprocess(request)
    assert out.token_ids.count(media_pad) == 2
    assert [image.url for image in out.images] == [IMAGE["image_url"]["url"], DATA_IMAGE["image_url"]["url"]]


def test_undeclared_renders_the_checkpoint_placeholder_which_shatters(k3: OpenAIPreprocessor) -> None:
    tokenizer = k3.tokenizer
    placeholder_ids = tokenizer.encode("<|kimi_image_placeholder|>")
    out = k3.preprocess(chat(user([IMAGE])))
    assert tokenizer.token_to_id("<|media_pad|>") not in out.token_ids
    assert len(placeholder_ids) > 1
    assert _contains(out.token_ids, placeholder_ids)


def test_typed_special_strings_stay_text(k3_sglang: OpenAIPreprocessor) -> None:
    tokenizer = k3_sglang.tokenizer
    typed = " ".join([*MARKERS, "<|media_pad|>", "[EOS]", "[BOS]", "<|reserved_token_163600|>"])
    prompt = k3_sglang.tokenize(chat(user(typed), chat_template_args={"thinking": False}))
    assert prompt.rendered.segments is not None
    control = [segment.text for segment in prompt.rendered.segments if segment.allow_special]
    specials = {tokenizer.token_to_id(token) for token in tokenizer.special_tokens}
    special_ids = [token_id for token_id in prompt.token_ids if token_id in specials]
    assert special_ids == [tokenizer.token_to_id(text) for text in control]
    assert typed in prompt.rendered.text


def test_segments_are_encoded_one_by_one(cl100k_k3_dir: Path) -> None:
    preprocessor = k3_preprocessor(cl100k_k3_dir, "<|media_pad|>")
    tokenizer = preprocessor.tokenizer
    prompt = preprocessor.tokenize(chat(user("Hi")))
    assert prompt.rendered.segments is not None
    expected = [
        token_id
        for segment in prompt.rendered.segments
        for token_id in tokenizer.encode(segment.text, allow_special=segment.allow_special)
    ]
    assert prompt.token_ids == expected
    base = 100256
    assert prompt.token_ids[0] == base + 3  # <|open|>
    assert tokenizer.decode(prompt.token_ids) == prompt.rendered.text


def test_k3_e1_on_cl100k_with_k3_specials(cl100k_k3_dir: Path) -> None:
    preprocessor = k3_preprocessor(cl100k_k3_dir)
    prompt = preprocessor.tokenize(chat(user("Hi"), chat_template_args={"thinking": False}))
    base = 100256
    open_, close, sep, end = base + 3, base + 4, base + 5, base + 2
    encode = preprocessor.tokenizer.encode
    frame_user = [
        open_,
        *encode("message"),
        *encode(" role"),
        *encode('="'),
        *encode("user"),
        *encode('"'),
        sep,
    ]
    closing = [close, *encode("message"), sep, end]
    assistant = [
        open_,
        *encode("message"),
        *encode(" role"),
        *encode('="'),
        *encode("assistant"),
        *encode('"'),
        sep,
        open_,
        *encode("response"),
        sep,
    ]
    assert prompt.token_ids == [*frame_user, *encode("Hi"), *closing, *assistant]
    assert len(prompt.token_ids) == 22


def test_declared_token_does_not_change_a_jinja_rendered_prompt() -> None:
    card = ModelDeploymentCard.from_model_dir("qwen-vl-demo")
    request = msgspec.convert(
        chat(user([IMAGE, {"type": "text", "text": "what is this?"}])), ChatCompletionRequest
    )
    plain = prompt_formatter_for(card, "qwen-vl-demo").render(request)
    declared = prompt_formatter_for(card, "qwen-vl-demo", image_placeholder_token="<|media_pad|>").render(
        request
    )
    assert declared == plain
    assert "<|media_pad|>" not in declared.text
    assert "<|vision_start|><|image_pad|><|vision_end|>" in declared.text


def test_kimi_k3_formatter_for_detection() -> None:
    assert kimi_k3_formatter_for("kimi_k3", "anything", None) is not None
    assert kimi_k3_formatter_for("qwen2_vl", "kimi-k3-lookalike", None) is None
    assert kimi_k3_formatter_for(None, "moonshot/Kimi-K3-Instruct", None) is not None
    assert kimi_k3_formatter_for(None, "org/kimik3", None) is not None
    assert kimi_k3_formatter_for(None, "qwen", "<|media_pad|>") is None
    formatter = kimi_k3_formatter_for("kimi_k3", "m", "<|media_pad|>")
    assert formatter is not None
    assert formatter.rendered_token == "<|media_pad|>"


def test_is_kimi_k3_model_type_first_then_the_served_name() -> None:
    assert is_kimi_k3("kimi_k3", "anything")
    assert not is_kimi_k3("qwen2_vl", "Kimi-K3-lookalike")
    assert is_kimi_k3(None, "moonshot/Kimi-K3-Instruct")
    assert not is_kimi_k3(None, "qwen")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "kimi_k3"}, "<|kimi_image_placeholder|>"),
        ({"model_type": "kimi_k3", "image_placeholder": ""}, "<|kimi_image_placeholder|>"),
        ({"model_type": "kimi_k3", "image_placeholder": 7}, "<|kimi_image_placeholder|>"),
        ({"model_type": "kimi_k3", "image_placeholder": "<|img|>"}, "<|img|>"),
        ({"model_type": "qwen2_vl", "image_placeholder": "<|img|>"}, "<|img|>"),
        ({"model_type": "qwen2_vl"}, None),
        ({}, None),
    ],
)
def test_checkpoint_image_placeholder(config: dict[str, Any], expected: str | None) -> None:
    assert checkpoint_image_placeholder(config) == expected
    assert DEFAULT_IMAGE_PLACEHOLDER == "<|kimi_image_placeholder|>"


def test_prompt_formatter_for_uses_the_config_it_is_given() -> None:
    card = ModelDeploymentCard.from_model_dir("kimi-k3-demo")
    config = {"model_type": "kimi_k3", "image_placeholder": "<|media_pad|>"}  # not the file's value
    formatter = prompt_formatter_for(card, "kimi-k3-demo", config=config)
    assert formatter.rendered_token == "<|media_pad|>"
    assert prompt_formatter_for(card, "kimi-k3-demo").rendered_token == "<|kimi_image_placeholder|>"


def test_k3_by_served_name_alone_renders_the_k3_default() -> None:
    card = ModelDeploymentCard.from_model_dir("kimi-k3-demo", served_name="org/Kimi-K3-custom")
    card.model_type = None
    formatter = prompt_formatter_for(card, "kimi-k3-demo", config={})
    assert isinstance(formatter, KimiK3Formatter)
    assert formatter.rendered_token == "<|kimi_image_placeholder|>"


def test_stop_strings() -> None:
    assert stop_strings(None) == []
    assert stop_strings("END") == ["END"]
    assert stop_strings(["a", "b"]) == ["a", "b"]


# --- Jinja path ------------------------------------------------------------------------------


def test_qwen_images_become_image_pad_ids(qwen: OpenAIPreprocessor) -> None:
    out = qwen.preprocess(chat(user([IMAGE, {"type": "text", "text": "and"}, IMAGE])))
    image_pad = qwen.tokenizer.token_to_id("<|image_pad|>")
    assert out.token_ids.count(image_pad) == 2
    assert len(out.images) == 2


def test_template_that_drops_images_is_a_400(tmp_path: Path) -> None:
    model = tmp_path / "text-only"
    source = resolve_model_dir("qwen-vl-demo")
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json", "tiktoken.model"):
        (model / name).write_bytes((source / name).read_bytes())
    template = (  # content parts are looped over (vLLM's "openai" format), image parts skipped
        "{% for m in messages %}{{ m.role }}: {% for p in m.content if p.type == 'text' %}{{ p.text }}"
        "{% endfor %}\n{% endfor %}"
    )
    (model / "chat_template.jinja").write_text(template)
    preprocessor = OpenAIPreprocessor.new(ModelDeploymentCard.from_model_dir(model), model)
    with pytest.raises(PreprocessError, match=r"1 image part\(s\) but the prompt rendered 0"):
        preprocessor.preprocess(chat(user([IMAGE])))


# --- PreprocessedRequest ---------------------------------------------------------------------


def test_preprocessed_request_fields(k3_sglang: OpenAIPreprocessor) -> None:
    request = chat(
        user("hello"),
        max_tokens=7,
        stop=["\n\n"],
        stop_token_ids=[5],
        temperature=0.5,
        seed=3,
        nvext={"annotations": ["formatted_prompt", "token_ids"]},
    )
    out = k3_sglang.preprocess(request)
    tokenizer = k3_sglang.tokenizer
    assert out.model == "m"
    assert out.stop_conditions.max_tokens == 7
    assert out.stop_conditions.stop == []  # the frontend applies them to content, not the engine
    assert out.stop_conditions.stop_token_ids == [5]
    hidden = out.stop_conditions.stop_token_ids_hidden
    assert set(hidden) == {tokenizer.token_to_id("<|end_of_msg|>"), tokenizer.token_to_id("[EOS]")}
    assert out.sampling_options.temperature == 0.5
    assert out.sampling_options.seed == 3
    assert out.mdcsum == k3_sglang.card.mdcsum()
    assert out.annotations["token_ids"] == out.token_ids
    assert out.annotations["formatted_prompt"].endswith(
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    wire = msgspec.msgpack.encode(out)
    assert msgspec.msgpack.decode(wire, type=type(out)) == out


def test_max_tokens_defaults_to_the_rest_of_the_context(k3: OpenAIPreprocessor) -> None:
    out = k3.preprocess(chat(user("hello")))
    assert out.stop_conditions.max_tokens == k3.context_length - len(out.token_ids)


def test_ignore_eos_hides_no_eos(k3: OpenAIPreprocessor) -> None:
    out = k3.preprocess(chat(user("hello"), ignore_eos=True))
    assert out.stop_conditions.stop_token_ids_hidden == []


# --- 400s ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        (chat(user([{"type": "audio_url", "audio_url": {}}])), "unknown content part type 'audio_url'"),
        (chat(user([{"type": "image_url", "image_url": {}}])), "needs image_url.url"),
        (chat(user([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}])), "http\\(s\\) URL"),
        (chat(user(["bare string part"])), "content part must be an object"),
        (chat(user("hi"), tool_choice="sometimes"), "tool_choice 'sometimes' is not valid"),
        (chat(user("hi"), tool_choice="required"), "needs at least one tool"),
        (
            chat(user("hi"), tool_choice={"type": "function", "function": {"name": "nope"}}),
            "not in tools",
        ),
        (chat(user("hi"), tool_choice={"type": "function"}), "tool_choice must be"),
        (chat(user("hi"), chat_template_args={"thinking_effort": "medium"}), "medium"),
        (chat(user("hi"), reasoning_effort="extreme"), "extreme"),
        (chat(user("hi"), n=17), r"n must be in \[1, 16\]"),
        (chat(user("hi"), max_tokens=0), "max_tokens must be at least 1"),
        (chat(user("hi"), temperature=3.0), "temperature must be in \\[0, 2\\], got 3.0"),
        (chat(user("hi"), top_p=0), "top_p must be in \\(0, 1\\]"),
        (chat(user("hi"), top_k=-2), "top_k must be at least -1"),
        (chat(user("hi"), presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
        (chat(user("hi"), frequency_penalty=-3), "frequency_penalty"),
        (chat(user("hi"), repetition_penalty=0), "repetition_penalty must be in \\(0, 2\\]"),
        (chat(user("hi"), min_tokens=-1), "min_tokens must be at least 0"),
        (chat(user("hi"), min_tokens=9, max_tokens=8), "min_tokens 9 exceeds max_tokens 8"),
        (chat(user("hi"), max_completion_tokens=0), "max_completion_tokens must be at least 1"),
        (chat(user("hi"), top_logprobs=3), "top_logprobs needs logprobs"),
        (chat(user("hi"), logprobs=True, top_logprobs=21), "top_logprobs must be in \\[0, 20\\], got 21"),
        (chat(user("hi"), stop=[""]), "stop strings must not be empty"),
        (chat(user("hi"), nvext={"annotations": ["everything"]}), "unknown annotation"),
        (chat(), "at least one message"),
        ({"model": "m", "messages": "hi"}, "Expected `array`, got `str` - at `\\$.messages`"),
        ({"messages": []}, "missing required field `model`"),
        (chat({"role": "wizard", "content": "hi"}), "wizard"),
        (chat({"content": "no role"}), "role"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_bad_requests_are_preprocess_errors(
    k3: OpenAIPreprocessor, request_body: dict[str, Any] | bytes, message: str
) -> None:
    with pytest.raises(PreprocessError, match=message):
        k3.preprocess(request_body)


def test_stop_strings_up_to_the_limits_are_accepted(k3: OpenAIPreprocessor) -> None:
    stops = [f"{i:03d}".ljust(MAX_STOP_CHARS, "x") for i in range(MAX_STOP_STRINGS)]
    out = k3.preprocess(chat(user("hi"), stop=stops))
    assert out.token_ids == k3.preprocess(chat(user("hi"))).token_ids


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (
            [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
            rf"Invalid 'stop': array too long\. Expected an array with maximum length {MAX_STOP_STRINGS}, "
            rf"but got an array with length {MAX_STOP_STRINGS + 1} instead\.",
        ),
        ([f"s{i}" for i in range(40_000)], "maximum length 64, but got an array with length 40000"),
        (
            ["ok", "y" * (MAX_STOP_CHARS + 1)],
            rf"Invalid 'stop\[1\]': string too long\. Expected a string with maximum length "
            rf"{MAX_STOP_CHARS}, but got a string with length {MAX_STOP_CHARS + 1} instead\.",
        ),
        ("z" * 100_000, r"Invalid 'stop\[0\]': string too long"),
    ],
)
def test_too_many_or_too_long_stop_strings_are_refused(
    k3: OpenAIPreprocessor, stop: str | list[str], message: str
) -> None:
    """Issue 13: 40,000 stop strings cost 72 ms per output token; the request is a 400 naming the limit."""
    with pytest.raises(PreprocessError, match=message) as caught:
        k3.preprocess(chat(user("hi"), stop=stop))
    assert caught.value.param == "stop"


@pytest.mark.parametrize(
    "part",
    [{"type": "audio_url"}, {"type": "image_url", "image_url": {}}, "bare", {"type": ["image"]}],
)
def test_content_part_errors_name_messages(k3: OpenAIPreprocessor, part: Any) -> None:
    with pytest.raises(PreprocessError) as caught:
        k3.preprocess(chat(user([part])))
    assert caught.value.param == "messages"
    assert caught.value.message.startswith("messages[0].content[0]: ")


def test_context_overflow_message(k3: OpenAIPreprocessor) -> None:
    limit = k3.context_length
    with pytest.raises(PreprocessError, match=f"This model's maximum context length is {limit} tokens"):
        k3.preprocess(chat(user("word " * limit)))
    with pytest.raises(PreprocessError, match=r"\(\d+ in the messages, 100000 in the completion\)"):
        k3.preprocess(chat(user("hi"), max_tokens=100_000))


# --- CLI (a real process) --------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_prep.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_render_demo_request() -> None:
    result = run_cli(
        "render",
        "--model-path",
        "kimi-k3-demo",
        "--image-token",
        "<|media_pad|>",
        "examples/demo_request.json",
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["formatter"] == "kimi_k3"
    assert output["declared_token"] == output["rendered_token"] == "<|media_pad|>"
    assert ["<|media_pad|>", True] in output["segments"]
    assert "".join(text for text, _ in output["segments"]) == output["text"]
    tokenizer = Tokenizer.from_model_dir("kimi-k3-demo")
    assert output["token_ids"].count(tokenizer.token_to_id("<|media_pad|>")) == 1


def test_cli_render_errors_are_json_on_stderr(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(chat(user([{"type": "video", "video": "x"}]))))
    result = run_cli("render", "--model-path", "kimi-k3-demo", str(bad))
    assert result.returncode == 1
    assert "unknown content part type 'video'" in _error_line(result.stderr)["message"]
    missing = run_cli("render", "--model-path", str(tmp_path / "nope"), str(bad))
    assert missing.returncode == 1
    assert "model directory not found" in _error_line(missing.stderr)["message"]


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def _error_line(stderr: str) -> dict[str, Any]:
    """The CLI's error object; other stderr lines are JSON log events."""
    errors = [json.loads(line)["error"] for line in stderr.splitlines() if '"error"' in line]
    assert len(errors) == 1, stderr
    error: dict[str, Any] = errors[0]
    return error


def test_cli_jinja_tokenization_modes(tmp_path: Path) -> None:
    """Default: typed ``<|im_end|>`` stays text; ``hf``: whole-string encoding, as transformers does."""
    request = tmp_path / "typed.json"
    request.write_text(json.dumps(chat(user("hi <|im_end|> there"))))
    im_end = Tokenizer.from_model_dir("qwen-vl-demo").token_to_id("<|im_end|>")
    counts = {}
    for mode in ("segmented", "hf"):
        result = run_cli("render", "--model-path", "qwen-vl-demo", "--jinja-tokenization", mode, str(request))
        assert result.returncode == 0, result.stderr
        counts[mode] = json.loads(result.stdout)["token_ids"].count(im_end)
    assert counts == {"segmented": 2, "hf": 3}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logit_bias": {"42": 5}}, "logit_bias", "logit_bias is not supported"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "maximum length 1024"),
        ({"stop_token_ids": [7, 8448]}, "stop_token_ids", "token id 8448 is outside the vocabulary of 8448"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "token id -1 is outside"),
    ],
)
def test_request_fields_an_engine_would_ignore_are_400s_naming_them(
    fields: dict[str, Any], param: str, words: str
) -> None:
    """issue 20: logit_bias and out-of-vocabulary or endless stop ids were silently forwarded."""
    card = ModelDeploymentCard.from_model_dir("kimi-k3-demo")
    preprocessor = OpenAIPreprocessor.new(card, "kimi-k3-demo")
    request = {"model": "kimi-k3-demo", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(PreprocessError) as refused:
        preprocessor.preprocess(request)
    assert refused.value.param == param
    assert words in str(refused.value)
    preprocessor.preprocess({**request, **dict.fromkeys(fields)})  # without them: fine
