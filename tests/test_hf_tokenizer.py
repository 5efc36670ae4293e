"""Hugging Face checkpoints (``tokenizer.json``): the frontend's ids are transformers', exactly.

Every directory of scripts/make_hf_models.py (byte-level BPE, SentencePiece and tekken vocabularies,
each family's template layout): a chat rendered and tokenized by the preprocessor equals
``apply_chat_template(..., tokenize=True)`` on the same directory (messages converted as vLLM
converts them, tests/support/hf_reference.py); a prompt equals the tokenizer's ``encode``; ids
decode as the tokenizer decodes them; streamed text is what vLLM's ``DecodeStream`` (primed with the
prompt) streams; text a user typed never becomes a control id; the traced path gives the whole
path's ids on every clean prompt; each image part becomes the token its family's processor expands.
"""

from __future__ import annotations

import codecs
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from support import hf_reference as ref
from support.hf_models import FAMILIES, built_models
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.openai import parse_chat_request
from dynamo_prep.tokenizer import HfTokenizer, Tokenizer, TokenizerError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GOOD = tuple(FAMILIES)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "call00001"  # 9 alphanumerics: Mistral's templates refuse anything else
PICTURE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def chats(family: str) -> dict[str, dict[str, Any]]:
    """The requests every directory must render as transformers does (tools and images where the
    family's template takes them)."""
    spec = FAMILIES[family]
    cases: dict[str, dict[str, Any]] = {
        "one_turn": {
            "messages": [{"role": "user", "content": "Hello there, how are you? ünïcödé 日本語 🙂"}]
        },
        "system_multi_turn": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me a joke about 12345 cats."},
            ]
        },
        "no_generation_prompt": {
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "add_generation_prompt": False,
        },
        "whitespace": {
            "messages": [{"role": "user", "content": "  lead and trail  \n\n new lines\t tabs \r\n"}]
        },
        "text_parts": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
                }
            ]
        },
    }
    if spec.tools:
        call = {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        cases["tools"] = {
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 21C"},
                {"role": "assistant", "content": "Sunny, 21C."},
                {"role": "user", "content": "Thanks!"},
            ],
            "tools": TOOLS,
        }
        cases["tools_offered"] = {
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": TOOLS,
        }
    if family == "qwen3":
        cases["thinking_off"] = {
            "messages": [{"role": "user", "content": "Quick one"}],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    if spec.image:
        cases["image"] = {
            "messages": [{"role": "user", "content": [PICTURE, {"type": "text", "text": "What is it?"}]}]
        }
    return cases


CASES = [(family, case) for family in GOOD for case in chats(family)]


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    return built_models()


@pytest.fixture(scope="module")
def preprocessors(models: dict[str, Path]) -> dict[str, OpenAIPreprocessor]:
    built: dict[str, OpenAIPreprocessor] = {}
    for family in GOOD:
        card = ModelDeploymentCard.from_model_dir(models[family])
        built[family] = OpenAIPreprocessor.new(card, models[family])
    return built


def preprocessor_dir(preprocessor: OpenAIPreprocessor) -> Path:
    return built_models()[preprocessor.card.display_name]


def request(family: str, case: str) -> dict[str, Any]:
    return {"model": family, **json.loads(json.dumps(chats(family)[case]))}


@pytest.mark.parametrize(("family", "case"), CASES)
def test_chat_ids_are_transformers_ids(
    models: dict[str, Path], preprocessors: dict[str, OpenAIPreprocessor], family: str, case: str
) -> None:
    ours = preprocessors[family].tokenize(request(family, case)).token_ids
    assert ours == ref.chat_ids(models[family], request(family, case))


@pytest.mark.parametrize("family", GOOD)
def test_every_tokenizer_json_loads_as_the_tokenizers_kind(
    preprocessors: dict[str, OpenAIPreprocessor], family: str
) -> None:
    tokenizer = preprocessors[family].tokenizer
    assert isinstance(tokenizer, HfTokenizer)
    assert tokenizer.decoder_exact, "every family's decoder has a per-token form"
    assert tokenizer.eos_token_ids, "every family stops somewhere"


@pytest.mark.parametrize(("family", "case"), CASES)
def test_the_traced_path_gives_the_whole_path_s_ids_on_clean_prompts(
    preprocessors: dict[str, OpenAIPreprocessor], family: str, case: str
) -> None:
    preprocessor = preprocessors[family]
    tokenizer = preprocessor.tokenizer
    assert isinstance(tokenizer, HfTokenizer)
    rendered = preprocessor.formatter.render(parse_chat_request(request(family, case)))
    assert rendered.pieces is not None
    segments = [(piece.text, piece.allow_special) for piece in rendered.pieces]  # type: ignore[union-attr]
    assert tokenizer._traced(segments) == tokenizer.encode_pieces(rendered.pieces)


@pytest.mark.parametrize("family", GOOD)
def test_typed_control_tokens_stay_text(preprocessors: dict[str, OpenAIPreprocessor], family: str) -> None:
    """Every control token of the vocabulary, typed by the user: the prompt's text is unchanged, and
    it holds exactly the control ids of the same chat without the typed text."""
    preprocessor = preprocessors[family]
    tokenizer = preprocessor.tokenizer
    typed = " ".join(sorted(tokenizer.special_tokens)[:64])
    forged = {"model": family, "messages": [{"role": "user", "content": f"look: {typed} end"}]}
    clean = {"model": family, "messages": [{"role": "user", "content": "look:  end"}]}
    ours = preprocessor.tokenize(forged)
    controls = [token_id for token_id in ours.token_ids if token_id in tokenizer.all_special_ids]
    expected = [t for t in preprocessor.tokenize(clean).token_ids if t in tokenizer.all_special_ids]
    assert controls == expected
    assert ours.rendered.text == ref.chat_text(preprocessor_dir(preprocessor), forged)


TEXTS = st.lists(
    st.sampled_from(
        [
            "Hello",
            " world",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "日本語",
            "émigré",
            "🙂",
            "123456",
            "don't",
            " ,",
            "<0x0A>",
            "▁",
            "[INST]",
            "<|im_end|>",
            "<s>",
            "</s>",
            "<think>",
            "<tool_call>",
            "<｜User｜>",
            "<|eot_id|>",
            "<start_of_turn>",
            "<|end|>",
            "<image>",
            "[IMG]",
        ]
    ),
    max_size=16,
).map("".join)


@pytest.mark.parametrize("family", GOOD)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, add_special_tokens=st.booleans())
def test_a_prompt_encodes_as_the_tokenizer_encodes_it(
    models: dict[str, Path],
    preprocessors: dict[str, OpenAIPreprocessor],
    family: str,
    text: str,
    add_special_tokens: bool,
) -> None:
    ours = preprocessors[family].tokenizer.encode_prompt(text, add_special_tokens=add_special_tokens)
    assert ours == ref.encode(models[family], text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("family", GOOD)
def test_ids_decode_as_the_tokenizer_decodes_them(
    models: dict[str, Path], preprocessors: dict[str, OpenAIPreprocessor], family: str
) -> None:
    tokenizer = preprocessors[family].tokenizer
    rng = random.Random(family)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.n_vocab) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == ref.decode(
                models[family], ids, skip_special_tokens=skip
            )


def streamed(tokenizer: Tokenizer, ids: list[int]) -> str:
    """What a parser streams: each id's bytes, UTF-8 decoded as they arrive, specials skipped."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    skip = tokenizer.all_special_ids
    return "".join(decoder.decode(tokenizer.decode_bytes([] if i in skip else [i])) for i in ids)


@pytest.mark.parametrize("family", GOOD)
def test_streamed_text_is_what_vllm_s_decode_stream_streams(
    models: dict[str, Path], preprocessors: dict[str, OpenAIPreprocessor], family: str
) -> None:
    """vLLM's detokenizer: ``DecodeStream`` primed with the prompt's ids, one output id at a time.
    Outputs end on a whole character (an unfinished one is never released by either)."""
    tokenizer = preprocessors[family].tokenizer
    rust = RustTokenizer.from_file(str(models[family] / "tokenizer.json"))
    prompt = (
        preprocessors[family]
        .tokenize({"model": family, "messages": [{"role": "user", "content": "Hi"}]})
        .token_ids
    )
    rng = random.Random(family)
    pieces = ["Hello", " world", "\n", "  x", "日本語", "é", "🙂", " 12345", "don't", "\t", "ok."]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
        ids = tokenizer.encode(text, allow_special=True)
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        expected = "".join(stream.step(rust, token_id) or "" for token_id in ids)
        assert streamed(tokenizer, ids) == expected, text


IMAGE_FAMILIES = tuple(name for name, spec in FAMILIES.items() if spec.image and spec.processor)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_each_image_part_renders_the_token_its_processor_expands(
    models: dict[str, Path], preprocessors: dict[str, OpenAIPreprocessor], family: str
) -> None:
    """The prompt the frontend sends, expanded by the family's own processor for one image: only
    the image's placeholder changed, into a longer run of image ids."""
    preprocessor = preprocessors[family]
    prompt = preprocessor.tokenize(request(family, "image"))
    assert prompt.rendered.image_count == 1 and len(prompt.images) == 1
    expanded = ref.image_placeholder_ids(
        models[family], prompt.rendered.text, Image.new("RGB", (64, 48), "red")
    )
    token = preprocessor.formatter.rendered_token
    assert token is not None
    token_id = preprocessor.tokenizer.added_tokens[token]
    ours = prompt.token_ids
    assert ours.count(token_id) == 1
    at = ours.index(token_id)
    head, tail = ours[:at], ours[at + 1 :]
    assert expanded[:at] == head and expanded[len(expanded) - len(tail) :] == tail
    run = expanded[at : len(expanded) - len(tail)]
    image_ids = [token_id for token_id in run if token_id in preprocessor.tokenizer.added_tokens.values()]
    assert len(run) > 1 and len(image_ids) > 1, "one image expands into a run of image ids"


BAD = {
    "bad_no_tokenizer": "no tokenizer file",
    "bad_sentencepiece_only": "tokenizer.model (SentencePiece) has no tokenizer.json",
    "bad_two_tokenizers": "two or more tokenizer files",
    "bad_malformed_json": "tokenizer.json: not a valid tokenizer.json",
    "bad_added_out_of_range": "added_tokens_decoder",
}


@pytest.mark.parametrize(("name", "message"), BAD.items())
def test_a_bad_directory_is_refused_naming_the_file_and_the_field(
    models: dict[str, Path], name: str, message: str
) -> None:
    with pytest.raises((TokenizerError, ValueError)) as refused:
        Tokenizer.from_model_dir(models[name])
    assert message in str(refused.value)
