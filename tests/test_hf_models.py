"""The Hugging Face model directories of scripts/make_hf_models.py, and the transformers reference.

Every built directory loads with AutoTokenizer (and its processor, where one runs without torch),
ships the files its family ships, puts its special tokens at the family's ids, and renders a chat
(tools, images) through transformers as vLLM would feed it; the `tokenizers` library reads each
tokenizer.json to the same ids as transformers; the bad directories are bad in the way they say;
two builds are byte-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from PIL import Image
from support import hf_reference as ref
from support.hf_models import FAMILIES, built_models, script
from tokenizers import Tokenizer
from transformers import AutoTokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BASE = 100256  # cl100k_base: the byte-level families' specials start here
SHARED_TEMPLATES = Path("/work/shared/data/chat_templates")
TOOLS = [
    {
        "type": "function",
        "function": {
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "name": "get_weather",
            "description": "The weather in a city",
        },
    }
]
# Special tokens at the family's ids (above the cl100k base where the real base is larger).
SPECIAL_IDS: dict[str, dict[str, int]] = {
    "llama3": {"<|begin_of_text|>": BASE, "<|start_header_id|>": BASE + 6, "<|eom_id|>": BASE + 8},
    "llama4": {
        "<|header_start|>": BASE + 5,
        "<|eot|>": BASE + 8,
        "<|image|>": BASE + 90,
        "<|patch|>": BASE + 92,
    },
    "qwen2_5": {"<|im_start|>": BASE + 1, "<|im_end|>": BASE + 2, "<tool_call>": BASE + 14},
    "qwen3": {
        "<|im_end|>": BASE + 2,
        "<tool_response>": BASE + 22,
        "<think>": BASE + 24,
        "</think>": BASE + 25,
    },
    "qwen2_vl": {"<|vision_start|>": BASE + 9, "<|image_pad|>": BASE + 12, "<|video_pad|>": BASE + 13},
    "mistral_v1": {"<unk>": 0, "<s>": 1, "</s>": 2},
    "mistral_v3": {"[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5, "[AVAILABLE_TOOLS]": 6, "[TOOL_RESULTS]": 8},
    "mistral_v7": {"[INST]": 3, "[SYSTEM_PROMPT]": 16, "[/SYSTEM_PROMPT]": 17, "[TOOL_CONTENT]": 18},
    "mistral_nemo": {"[INST]": 3, "[AVAILABLE_TOOLS]": 5, "[TOOL_RESULTS]": 7, "[TOOL_CALLS]": 9},
    "pixtral": {"[IMG]": 10, "[IMG_BREAK]": 12, "[IMG_END]": 13},
    "mistral_small_3": {
        "[SYSTEM_PROMPT]": 17,
        "[TOOL_CONTENT]": 19,
        "[ARGS]": 32,
        "[CALL_ID]": 33,
        "[THINK]": 34,
    },
    "deepseek_v3": {
        "<｜begin▁of▁sentence｜>": BASE,
        "<｜end▁of▁sentence｜>": BASE + 1,
        "<｜User｜>": BASE + 8,
    },
    "gemma3": {"<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106, "<image_soft_token>": 32768},
    "phi3_5": {"<|endoftext|>": 32000, "<|assistant|>": 32001, "<|end|>": 32007, "<|user|>": 32010},
    "llava": {"<image>": 32000, "<pad>": 32001},
    "gpt_oss": {
        "<|return|>": BASE + 4,
        "<|channel|>": BASE + 7,
        "<|start|>": BASE + 8,
        "<|call|>": BASE + 14,
    },
    "kimi_k2": {
        "<|im_end|>": BASE + 2,
        "<|tool_calls_section_begin|>": BASE + 11,
        "<|tool_call_end|>": BASE + 15,
        "<|im_middle|>": BASE + 17,
    },
    "glm45": {"[gMASK]": BASE + 2, "<|user|>": BASE + 7, "<think>": BASE + 21, "<arg_value>": BASE + 29},
}
# Added tokens that are NOT special, as the real families ship them.
NOT_SPECIAL = {
    "qwen2_5": ("<tool_call>", "</tool_call>", "<|fim_prefix|>"),
    "qwen3": ("<tool_call>", "<tool_response>", "<think>", "</think>"),
    "deepseek_v3": ("<｜User｜>", "<｜Assistant｜>", "<think>", "<｜tool▁calls▁begin｜>"),
}
FILES = {
    "llama3": {"config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json"},
    "llama4": {"chat_template.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json"},
    "qwen2_5": {"merges.txt", "vocab.json", "tokenizer.json", "generation_config.json"},
    "qwen3": {"merges.txt", "vocab.json", "tokenizer.json", "generation_config.json"},
    "qwen2_vl": {
        "chat_template.json",
        "preprocessor_config.json",
        "merges.txt",
        "vocab.json",
        "tokenizer.json",
    },
    "mistral_v1": {"tokenizer.model", "tokenizer.json", "special_tokens_map.json"},
    "mistral_v3": {"tokenizer.model", "tokenizer.model.v3", "tokenizer.json"},
    "mistral_v7": {"tokenizer.model", "tokenizer.json"},
    "mistral_nemo": {"tokenizer.json", "special_tokens_map.json"},
    "pixtral": {"chat_template.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json"},
    "mistral_small_3": {"chat_template.jinja", "preprocessor_config.json", "processor_config.json"},
    "deepseek_v3": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"},
    "gemma3": {"added_tokens.json", "chat_template.json", "preprocessor_config.json", "tokenizer.model"},
    "phi3_5": {"added_tokens.json", "tokenizer.model", "tokenizer.json"},
    "llava": {"added_tokens.json", "chat_template.json", "preprocessor_config.json", "processor_config.json"},
    "gpt_oss": {"chat_template.jinja", "tokenizer.json", "special_tokens_map.json"},
    "kimi_k2": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"},
    "glm45": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"},
}
# Texts that probe prefix spaces, byte fallback, specials inside text, rstrip, CJK and digits.
PROBES = (
    "Hello world",
    " Hello  world\n\nfoo",
    "[INST] hi [/INST]",
    "<s>x</s> y",
    "a<|im_start|>b <|im_end|> c",
    "<|user|>\nHi<|end|>\n<|assistant|>\n",
    "<image>\nWhat is this?",
    "数字 12345 and émigré 🙂",
    "<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>",
    "<｜User｜>hi<｜Assistant｜>",
    "<start_of_turn>user\nhey<end_of_turn>\n",
    "[IMG][IMG_BREAK] [TOOL_CALLS]",
    "  leading\ttab\r\n",
    "Hello , world ! it 's",
)


def tool_chat(image: bool = False) -> dict[str, Any]:
    """A chat with tools: a call (arguments as a JSON string), its result, a follow-up question."""
    question: Any = "What is the weather in Paris?"
    if image:
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        question = [picture, {"type": "text", "text": "Where is this? And the weather in Paris?"}]
    call = {
        "id": "call00001",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00001", "content": "sunny, 21C"},
            {"role": "assistant", "content": "Sunny, 21C."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": TOOLS,
    }


def plain_chat(image: bool = False) -> dict[str, Any]:
    question: Any = "Hello there."
    if image:
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        question = [picture, {"type": "text", "text": "What is in this picture?"}]
    return {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Bye."},
        ]
    }


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


GOOD = tuple(FAMILIES)


@pytest.fixture(scope="session")
def models() -> dict[str, Path]:
    """Every built directory by name (built once, cached across sessions)."""
    return built_models()


MULTIMODAL = tuple(name for name, family in FAMILIES.items() if family.image)
PROCESSORS = tuple(name for name, family in FAMILIES.items() if family.processor)


def test_the_script_builds_every_family_described() -> None:
    assert set(script().FAMILIES) == set(FAMILIES) == set(SPECIAL_IDS) == set(FILES)
    assert all(name.startswith("bad_") for name in script().BAD)


@pytest.mark.parametrize("name", GOOD)
def test_directory_loads_with_its_family_files_and_ids(models: dict[str, Path], name: str) -> None:
    directory = models[name]
    family = FAMILIES[name]
    files = {path.name for path in directory.iterdir()}
    assert FILES[name] | {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert {name for name in family.templates} <= files
    tokenizer = ref.tokenizer(directory)
    assert {
        content: tokenizer.convert_tokens_to_ids(content) for content in SPECIAL_IDS[name]
    } == SPECIAL_IDS[name]
    decoder = tokenizer.added_tokens_decoder
    for content in NOT_SPECIAL.get(name, ()):
        assert decoder[tokenizer.convert_tokens_to_ids(content)].special is False, content
    added = read_json(directory / "tokenizer.json")["added_tokens"]
    config = read_json(directory / "config.json")
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]
    assert max(token["id"] for token in added) < vocab_size
    assert len(tokenizer) <= vocab_size


@pytest.mark.parametrize("name", GOOD)
def test_tokenizer_kind_is_the_family_kind(models: dict[str, Path], name: str) -> None:
    data = read_json(models[name] / "tokenizer.json")
    decoder = json.dumps(data["decoder"])
    if FAMILIES[name].kind == "sentencepiece":
        assert (
            data["model"]["byte_fallback"] is True
            and "ByteFallback" in decoder
            and "ByteLevel" not in decoder
        )
    else:
        assert data["decoder"]["type"] == "ByteLevel" and "ByteLevel" in json.dumps(data["pre_tokenizer"])
        fillers = [token for token in data["added_tokens"] if token["content"].startswith("<SPECIAL_")]
        assert (len(data["added_tokens"]) == 1000 and bool(fillers)) == (FAMILIES[name].kind == "tekken")


@pytest.mark.parametrize("name", GOOD)
def test_tokenizers_library_reads_the_same_ids_as_transformers(models: dict[str, Path], name: str) -> None:
    """The `tokenizers` library on tokenizer.json alone agrees with transformers (BOS from the
    post-processor, specials, prefix spaces, rstrip), and decodes the same text."""
    raw = Tokenizer.from_file(str(models[name] / "tokenizer.json"))
    for text in PROBES:
        for special in (True, False):
            ids = ref.encode(models[name], text, add_special_tokens=special)
            assert raw.encode(text, add_special_tokens=special).ids == ids, (text, special)
            for skip in (True, False):
                assert raw.decode(ids, skip_special_tokens=skip) == ref.decode(models[name], ids, skip), text


@pytest.mark.parametrize("name", GOOD)
def test_chat_renders_through_transformers(models: dict[str, Path], name: str) -> None:
    """A chat (with tools where the family's template has them) renders, and its ids are the
    rendered text encoded without added special tokens."""
    directory, family = models[name], FAMILIES[name]
    if name == "pixtral":  # no tokenizer template: vLLM renders tools only with the tokenizer's
        with pytest.raises(ref.ReferenceError, match="no chat template"):
            ref.chat_ids(directory, {**plain_chat(), "tools": TOOLS})
    request = tool_chat() if family.tools else plain_chat()
    text = ref.chat_text(directory, request)
    assert ref.chat_ids(directory, request) == ref.encode(directory, text, add_special_tokens=False)
    if family.tools:
        assert "get_weather" in text and "Paris" in text and "sunny, 21C" in text
        assert text.count("get_weather") >= 2  # the tool list and the call
    assert "You are terse." in text and text.rstrip() != ""


@pytest.mark.parametrize("name", MULTIMODAL)
def test_image_part_renders_as_the_family_image_token(models: dict[str, Path], name: str) -> None:
    family = FAMILIES[name]
    assert family.image is not None
    request = tool_chat(image=True) if family.tools else plain_chat(image=True)
    text = ref.chat_text(models[name], request)
    assert text.count(family.image) == 1
    assert "image_url" not in text and "base64" not in text


IMAGE_RUNS = {  # a 200x120 image: how many of each id its placeholder becomes
    "qwen2_vl": {"<|image_pad|>": 28},
    "gemma3": {"<image_soft_token>": 256, "<start_of_image>": 1, "<end_of_image>": 1},
    "llava": {"<image>": 576},
    "pixtral": {"[IMG]": 8 * 13, "[IMG_BREAK]": 7, "[IMG_END]": 1},
    "mistral_small_3": {"[IMG]": 5 * 8, "[IMG_BREAK]": 4, "[IMG_END]": 1},
}


@pytest.mark.parametrize("name", PROCESSORS)
def test_processor_expands_one_image(models: dict[str, Path], name: str) -> None:
    directory = models[name]
    request = tool_chat(image=True) if FAMILIES[name].tools else plain_chat(image=True)
    text = ref.chat_text(directory, request)
    expanded = ref.image_placeholder_ids(directory, text, Image.new("RGB", (200, 120), (30, 90, 200)))
    tokenizer = ref.tokenizer(directory)
    counts = {token: expanded.count(tokenizer.convert_tokens_to_ids(token)) for token in IMAGE_RUNS[name]}
    assert counts == IMAGE_RUNS[name]
    assert len(expanded) > len(ref.chat_ids(directory, request))


def test_gemma_and_llava_processors_load_without_torch(models: dict[str, Path]) -> None:
    assert type(ref.processor(models["gemma3"])).__name__ == "Gemma3Processor"
    assert type(ref.processor(models["llava"])).__name__ == "LlavaProcessor"
    assert ref.processor(models["llama3"]) is None  # a tokenizer, not a processor


def test_named_template_list_picks_tool_use_with_tools(models: dict[str, Path]) -> None:
    directory = models["mistral_v3"]
    config = read_json(directory / "tokenizer_config.json")
    assert [entry["name"] for entry in config["chat_template"]] == ["default", "tool_use"]
    with_tools = ref.chat_text(directory, tool_chat())
    assert "[AVAILABLE_TOOLS]" in with_tools
    assert "[AVAILABLE_TOOLS]" not in ref.chat_text(directory, plain_chat())


def test_qwen3_thinking_switch(models: dict[str, Path]) -> None:
    directory = models["qwen3"]
    thinking = ref.chat_text(directory, plain_chat())
    quiet = ref.chat_text(directory, {**plain_chat(), "chat_template_kwargs": {"enable_thinking": False}})
    assert quiet == thinking + "<think>\n\n</think>\n\n"


def test_request_fields_override_chat_template_kwargs(models: dict[str, Path]) -> None:
    """vLLM merges the request's add_generation_prompt over chat_template_kwargs."""
    directory = models["qwen2_5"]
    request = {**plain_chat(), "chat_template_kwargs": {"add_generation_prompt": False}}
    assert ref.chat_text(directory, request).endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------
# vLLM's conversion of OpenAI messages, as hf_reference replays it


def test_content_format_detection() -> None:
    assert ref.content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert (
        ref.content_format(
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
        )
        == "openai"
    )
    macro = "{% macro r(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    assert ref.content_format(macro + "{% for m in messages %}{{ r(m.content) }}{% endfor %}") == "openai"
    assert ref.content_format(macro + "{% for m in messages %}{{ r(m.role) }}{% endfor %}") == "string"
    sliced = "{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content | list %}x{% endfor %}"
    sliced += "{% endfor %}"
    assert ref.content_format(sliced) == "openai"


@pytest.mark.parametrize("name", GOOD)
def test_family_template_content_format(models: dict[str, Path], name: str) -> None:
    template = ref.chat_template(models[name], TOOLS if FAMILIES[name].tools else None)
    openai = {"llama3", "llama4", "qwen2_vl", "pixtral", "mistral_small_3", "gemma3", "llava"}
    assert ref.content_format(template) == ("openai" if name in openai else "string")


def test_messages_become_what_templates_expect() -> None:
    request = tool_chat(image=True)
    openai = ref.template_messages(request["messages"], "openai")
    assert openai[0] == {"role": "system", "content": [{"type": "text", "text": "You are terse."}]}
    assert openai[1]["content"][0] == {"type": "image"}
    call = openai[2]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris"} and openai[2]["content"] == []
    assert openai[3] == {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call00001"}
    string = ref.template_messages(tool_chat()["messages"], "string")
    assert string[1] == {"role": "user", "content": "What is the weather in Paris?"}
    assert string[2]["content"] == ""
    with pytest.raises(ref.ReferenceError, match="string-format"):
        ref.template_messages(request["messages"], "string")
    assert (
        request["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    )  # not mutated


def test_tool_arguments_that_are_not_an_object_become_empty() -> None:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}
        for i, arguments in enumerate(("", "not json", "[1]", '{"a": 1}'))
    ]
    converted = ref.template_messages([{"role": "assistant", "content": "x", "tool_calls": calls}], "string")
    assert [call["function"]["arguments"] for call in converted[0]["tool_calls"]] == [{}, {}, {}, {"a": 1}]
    no_calls = ref.template_messages([{"role": "assistant", "content": "x", "tool_calls": []}], "string")
    assert "tool_calls" not in no_calls[0]


def test_tools_are_normalised_as_vllm_dumps_them() -> None:
    tools = ref.template_tools([{"type": "function", "function": {"name": "f", "extra": 1}}])
    assert tools == [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]
    assert tools is not None and list(ref.template_tools(TOOLS)[0]["function"]) == [
        "name",
        "description",
        "parameters",
    ]


# ---------------------------------------------------------------------------------------------
# Bad directories


def test_bad_directories_are_bad_as_named(models: dict[str, Path]) -> None:
    def load(name: str) -> Any:
        return AutoTokenizer.from_pretrained(str(models[name]), local_files_only=True)

    files = {name: {path.name for path in models[name].iterdir()} for name in script().BAD}
    assert not files["bad_no_tokenizer"] & {"tokenizer.json", "tokenizer.model", "tiktoken.model"}
    with pytest.raises(ValueError, match="instantiate the backend tokenizer"):
        load("bad_no_tokenizer")
    assert (
        "tokenizer.model" in files["bad_sentencepiece_only"]
        and "tokenizer.json" not in files["bad_sentencepiece_only"]
    )
    assert load("bad_sentencepiece_only").encode("Hello world") == ref.encode(
        models["mistral_v1"], "Hello world"
    )
    assert {"tokenizer.json", "tiktoken.model"} <= files["bad_two_tokenizers"]
    with pytest.raises(json.JSONDecodeError):
        read_json(models["bad_malformed_json"] / "tokenizer.json")
    with pytest.raises(Exception, match="EOF while parsing"):
        load("bad_malformed_json")
    decoder = read_json(models["bad_added_out_of_range"] / "tokenizer_config.json")["added_tokens_decoder"]
    stray = max(int(token_id) for token_id in decoder)
    assert stray >= read_json(models["bad_added_out_of_range"] / "config.json")["vocab_size"]
    # transformers does not refuse it: the token lands at the next free id instead
    assert load("bad_added_out_of_range").convert_tokens_to_ids("<|stray|>") == 32000
    with pytest.raises(jinja2.exceptions.UndefinedError, match="turn_markers"):
        ref.chat_text(models["bad_template_undefined"], plain_chat())


# ---------------------------------------------------------------------------------------------
# The build itself


def test_build_is_deterministic(tmp_path: Path, models: dict[str, Path]) -> None:
    """A second build (cl100k, Qwen's vocab.json/merges.txt, renamed SentencePiece pieces and proto,
    renamed tekken specials, a bad directory) is byte-identical to the cached one."""
    names = ["llama3", "qwen2_vl", "gemma3", "mistral_small_3", "bad_added_out_of_range"]
    fresh = script().build(names, tmp_path)
    for name in names:
        cached = models[name]
        assert sorted(path.name for path in fresh[name].iterdir()) == sorted(
            path.name for path in cached.iterdir()
        )
        for path in fresh[name].iterdir():
            assert path.read_bytes() == (cached / path.name).read_bytes(), f"{name}/{path.name}"


def test_unknown_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model directories"):
        script().build(["llama5"], tmp_path)


# Our templates follow each family's format: without tools, they render a plain chat exactly as
# the real (third-party) template does. Local only: the real templates are not part of the repo.
PARITY = {
    "qwen2_vl": "qwen2_vl.jinja",
    "gemma3": "gemma3.jinja",
    "llava": "llava.jinja",
    "phi3_5": "phi3_5_mini.jinja",
    "qwen3": "qwen3.jinja",
    "llama3": "llama3_1_json.jinja",
    "llama4": "llama4_pythonic.jinja",
}


@pytest.mark.skipif(not SHARED_TEMPLATES.is_dir(), reason="the real chat templates are not on this machine")
@pytest.mark.parametrize("name", sorted(PARITY))
def test_family_template_matches_the_real_format(models: dict[str, Path], name: str) -> None:
    directory = models[name]
    real = (SHARED_TEMPLATES / PARITY[name]).read_text(encoding="utf-8")
    image = FAMILIES[name].image is not None
    for chat in (plain_chat(), plain_chat(image=image)):
        request = {**chat, "chat_template_kwargs": {"date_string": "26 Jul 2024"}}
        ours = ref.chat_text(directory, request)
        assert ref.chat_text(directory, {**request, "chat_template": real}) == ours
