"""JinjaFormatter: byte-for-byte parity with transformers' apply_chat_template, and its edges.

The parity cases use templates written for this project (tests/data/chat_templates/); the
expected strings were rendered by real transformers (scripts/make_jinja_parity_expected.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_prep.card import ModelCardError
from dynamo_prep.formatter.jinja import ChatTemplateError, JinjaFormatter, special_tokens_from_config
from dynamo_prep.formatter.jinja.environment import _INLINED_READS, _new_environment, template_context
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.prompt import PromptRenderError
from dynamo_prep.protocol.openai import ChatCompletionRequest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = DATA / "chat_templates"
CASES: list[dict[str, Any]] = json.loads((DATA / "jinja_parity_cases.json").read_text(encoding="utf-8"))
EXPECTED: dict[str, Any] = json.loads((DATA / "jinja_parity_expected.json").read_text(encoding="utf-8"))
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def formatter_for(case: dict[str, Any]) -> JinjaFormatter:
    template = (TEMPLATES / case["template"]).read_text(encoding="utf-8")
    return JinjaFormatter.from_template(template, special_tokens=case.get("special_tokens", {}))


def render_case(case: dict[str, Any]) -> dict[str, str]:
    """Our outcome in the expected file's shape: ``{"text": ...}`` or ``{"error": ...}``."""
    try:
        text = formatter_for(case).render_text(
            case["messages"],
            case.get("tools"),
            add_generation_prompt=case.get("add_generation_prompt", False),
            documents=case.get("documents"),
            **case.get("kwargs", {}),
        )
    except PromptRenderError as exc:
        return {"error": str(exc)}
    return {"text": text}


def assert_same_outcome(ours: dict[str, str], theirs: dict[str, str]) -> None:
    if "text" in theirs:
        assert ours == {"text": theirs["text"]}
        return
    assert "error" in ours, f"transformers raised {theirs}, we rendered"
    if theirs["error_type"] == "TemplateError":  # raise_exception: the user sees the template's message
        assert ours["error"] == theirs["error"]


def user_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=fields.pop("messages", USER), **fields)


def write_model_dir(
    path: Path, tokenizer_config: dict[str, Any], config: dict[str, Any] | None = None
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    (path / "config.json").write_text(json.dumps(config or {}), encoding="utf-8")
    return path


# --- parity against committed transformers output ---------------------------------------------


def test_expected_file_covers_every_case() -> None:
    assert EXPECTED["transformers_version"]
    assert sorted(EXPECTED["cases"]) == sorted(case["name"] for case in CASES)
    assert len({case["template"] for case in CASES}) >= 6


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_parity_with_transformers(case: dict[str, Any]) -> None:
    assert_same_outcome(render_case(case), EXPECTED["cases"][case["name"]])


def test_parity_cases_cover_the_quirks() -> None:
    names = {case["name"] for case in CASES}
    errors = [name for name, result in EXPECTED["cases"].items() if "error" in result]
    assert {"chatml/none_valued_keys", "loop/reasoning_aliases", "loop/nested_none_kept"} <= names
    assert {"llama31/bos_overridden_by_args", "mistral/eos_overridden_by_args"} <= names
    assert len(errors) >= 4 and all(
        EXPECTED["cases"][name]["error_type"] == "TemplateError" for name in errors
    )


# --- live parity, only where transformers is installed ----------------------------------------


def load_expected_script() -> ModuleType:
    path = ROOT / "scripts" / "make_jinja_parity_expected.py"
    spec = importlib.util.spec_from_file_location("make_jinja_parity_expected", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def transformers_parts() -> tuple[Any, Any]:
    """PreTrainedTokenizerFast, and a writer of a one-word tokenizer.json (skips without transformers)."""
    transformers = pytest.importorskip("transformers")
    models = pytest.importorskip("tokenizers.models")
    tokenizers = pytest.importorskip("tokenizers")

    def save_word_level(path: Path) -> None:
        tokenizers.Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(path))

    return transformers.PreTrainedTokenizerFast, save_word_level


def test_live_parity_with_installed_transformers() -> None:
    pytest.importorskip("transformers")
    script = load_expected_script()
    for case in CASES:
        assert_same_outcome(render_case(case), script.render_case(case, TEMPLATES))
    dated = {**next(c for c in CASES if c["name"] == "llama31/no_tools"), "kwargs": {}}  # strftime_now
    assert_same_outcome(render_case(dated), script.render_case(dated, TEMPLATES))


def test_live_special_tokens_match_transformers_loading(tmp_path: Path) -> None:
    hf_fast_tokenizer, save_word_level = transformers_parts()

    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "unk_token": None,
        "image_token": "<|image|>",
        "extra_special_tokens": {"audio_token": "<|audio|>"},
        "add_bos_token": True,
    }
    model_dir = write_model_dir(tmp_path / "m", config)
    save_word_level(model_dir / "tokenizer.json")
    hf = hf_fast_tokenizer.from_pretrained(str(model_dir))
    assert special_tokens_from_config(config) == hf.special_tokens_map


def test_live_demo_model_dirs_match_transformers(tmp_path: Path) -> None:
    """Each Jinja demo model, loaded by transformers from the same files, renders the same prompts."""
    hf_fast_tokenizer, save_word_level = transformers_parts()

    demos = [d for d in sorted(DEMO_MODELS_DIR.iterdir()) if (d / "chat_template.jinja").is_file()]
    if not demos:
        pytest.skip("no Jinja demo model generated yet")
    for demo in demos:
        copy = Path(shutil.copytree(demo, tmp_path / demo.name))
        save_word_level(copy / "tokenizer.json")
        hf = hf_fast_tokenizer.from_pretrained(str(copy))
        ours = JinjaFormatter.from_model_dir(demo)
        for case in CASES:
            kwargs = {"add_generation_prompt": case["add_generation_prompt"], **case["kwargs"]}
            try:
                theirs = {
                    "text": hf.apply_chat_template(case["messages"], case["tools"], tokenize=False, **kwargs)
                }
            except Exception as exc:
                theirs = {"error": str(exc), "error_type": type(exc).__name__}
            try:
                mine = {"text": ours.render_text(case["messages"], case["tools"], **kwargs)}
            except PromptRenderError as exc:
                mine = {"error": str(exc)}
            assert_same_outcome(mine, theirs)


# --- from_model_dir ---------------------------------------------------------------------------


def test_qwen_vl_demo_from_model_dir() -> None:
    if not (DEMO_MODELS_DIR / "qwen-vl-demo" / "tokenizer_config.json").is_file():
        pytest.skip("qwen-vl-demo is not generated yet")
    formatter = JinjaFormatter.from_model_dir("qwen-vl-demo")
    assert formatter.kind == "jinja"
    assert formatter.rendered_token == "<|image_pad|>"
    content = [
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "What is this?"},
    ]
    prompt = formatter.render(user_request(messages=[{"role": "user", "content": content}]))
    assert prompt.image_count == 1 and prompt.segments is not None  # injection-safe segments by default
    assert "".join(segment.text for segment in prompt.segments) == prompt.text
    assert "What is this?" in prompt.text


def test_named_template_list_uses_default_and_tool_use(tmp_path: Path) -> None:
    templates = [{"name": "default", "template": "D:{{ bos_token }}"}, {"name": "tool_use", "template": "T"}]
    model_dir = write_model_dir(tmp_path / "m", {"chat_template": templates, "bos_token": "<s>"})
    formatter = JinjaFormatter.from_model_dir(model_dir)
    assert formatter.render_text(USER) == "D:<s>"
    assert formatter.render_text(USER, [WEATHER]) == "T"  # transformers picks tool_use when tools are given
    assert formatter.render_text(USER, []) == "T"


def test_named_template_list_without_default_is_refused(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "m", {"chat_template": [{"name": "rag", "template": "R"}]})
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        JinjaFormatter.from_model_dir(model_dir)


def test_chat_template_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "m", {"chat_template": "from config"})
    (model_dir / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert JinjaFormatter.from_model_dir(model_dir).render_text(USER) == "from file"


def test_added_token_dict_form_and_model_specific_tokens(tmp_path: Path) -> None:
    config = {
        "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ image_token }}"
        "|{{ unk_token is defined }}",
        "bos_token": {"__type": "AddedToken", "content": "<|begin|>", "lstrip": False},
        "eos_token": {"content": "<|end|>"},
        "pad_token": "<pad>",
        "unk_token": None,
        "extra_special_tokens": {"image_token": "<|img|>"},
    }
    formatter = JinjaFormatter.from_model_dir(write_model_dir(tmp_path / "m", config))
    assert formatter.render_text(USER) == "<|begin|>|<|end|>|<pad>|<|img|>|False"


def test_image_token_from_config_or_added_tokens_decoder(tmp_path: Path) -> None:
    decoder = {"7": {"content": "<|image_pad|>", "special": True}}
    by_id = write_model_dir(
        tmp_path / "a", {"chat_template": "x", "added_tokens_decoder": decoder}, {"image_token_id": 7}
    )
    assert JinjaFormatter.from_model_dir(by_id).rendered_token == "<|image_pad|>"
    by_name = write_model_dir(
        tmp_path / "b", {"chat_template": "x"}, {"image_token": "<image>", "image_token_id": 7}
    )
    assert JinjaFormatter.from_model_dir(by_name).rendered_token == "<image>"
    neither = write_model_dir(tmp_path / "c", {"chat_template": "x"})
    assert JinjaFormatter.from_model_dir(neither).rendered_token is None


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "m", {"eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        JinjaFormatter.from_model_dir(model_dir)


def test_syntax_error_names_the_file(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "m", {})
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}", encoding="utf-8")
    with pytest.raises(ModelCardError, match=r"chat_template\.jinja: chat template syntax error at line 1"):
        JinjaFormatter.from_model_dir(model_dir)


def test_demo_dir_copy_loads_like_the_original(tmp_path: Path) -> None:
    source = DEMO_MODELS_DIR / "qwen-vl-demo"
    if not source.is_dir():
        pytest.skip("qwen-vl-demo is not generated yet")
    copy = Path(shutil.copytree(source, tmp_path / "copy"))
    assert JinjaFormatter.from_model_dir(copy).render_text(USER) == JinjaFormatter.from_model_dir(
        source
    ).render_text(USER)


# --- render(request) --------------------------------------------------------------------------

PARTS_TEMPLATE = (
    "{% for m in messages %}{% for p in m.content %}{{ p | tojson }};{% endfor %}{% endfor %}"
    "{% if 'image_url' in messages[0].content[0] %}URL{% endif %}"
)


def test_render_converts_image_url_parts_and_counts_images() -> None:
    formatter = JinjaFormatter.from_template(PARTS_TEMPLATE, image_token='"image"')
    content = [
        {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
        {"type": "text", "text": "two pictures"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    request = user_request(messages=[{"role": "user", "content": content}])
    prompt = formatter.render(request)
    assert prompt.text == '{"type": "image"};{"type": "text", "text": "two pictures"};{"type": "image"};'
    assert prompt.image_count == 2
    assert request.messages[0]["content"][0]["type"] == "image_url"  # the request is not modified


def test_render_without_image_token_counts_nothing() -> None:
    prompt = JinjaFormatter.from_template("<image><image>").render(user_request())
    assert prompt.image_count == 0 and prompt.segments is not None


TOOLS_TEMPLATE = (
    "{{ tools | tojson }}|{{ add_generation_prompt }}|{{ flavour | default('-') }}|{{ eos_token }}"
)


@pytest.mark.parametrize(
    ("exclude", "tool_choice", "expected_tools"),
    [(True, "none", "null"), (True, "auto", "[1]"), (False, "none", "[1]"), (True, None, "[1]")],
)
def test_tools_dropped_only_on_tool_choice_none(
    exclude: bool, tool_choice: str | None, expected_tools: str
) -> None:
    formatter = JinjaFormatter.from_template(TOOLS_TEMPLATE, exclude_tools_when_tool_choice_none=exclude)
    tools = [WEATHER]
    text = formatter.render(user_request(tools=tools, tool_choice=tool_choice)).text
    rendered_tools = text.split("|")[0]
    assert rendered_tools == ("null" if expected_tools == "null" else json.dumps(tools, ensure_ascii=False))


def test_render_template_args_order_and_overrides() -> None:
    formatter = JinjaFormatter.from_template(TOOLS_TEMPLATE, eos_token="</s>")
    request = user_request(
        add_generation_prompt=False,
        chat_template_kwargs={"flavour": "kwargs"},
        chat_template_args={"flavour": "args"},
    )
    assert formatter.render(request).text == "null|False|args|</s>"
    # transformers lets keyword arguments override special tokens; a caller still can, a request cannot
    assert formatter.render_text([{"role": "user", "content": "hi"}], eos_token="<k>").endswith("|<k>")
    with pytest.raises(PromptRenderError, match="eos_token") as refused:
        formatter.render(user_request(chat_template_kwargs={"eos_token": "<k>"}))
    assert refused.value.param == "chat_template_kwargs"
    # vLLM merges the request's own add_generation_prompt over the template arguments
    overridden = user_request(chat_template_kwargs={"add_generation_prompt": False})
    assert formatter.render(overridden).text == "null|True|-|</s>"
    assert formatter.render(user_request()).text == "null|True|-|</s>"


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it() -> None:
    formatter = JinjaFormatter.from_template(
        "{{ reasoning_effort | default('-') }}|{{ enable_thinking | default('-') }}"
    )
    assert formatter.render(user_request()).text == "-|-"
    assert formatter.render(user_request(reasoning_effort="low")).text == "low|True"
    assert formatter.render(user_request(reasoning_effort="none")).text == "none|False"
    kept = user_request(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert formatter.render(kept).text == "high|False"


@pytest.mark.parametrize("key", ["messages", "tools"])
def test_render_refuses_template_args_that_replace_request_fields(key: str) -> None:
    formatter = JinjaFormatter.from_template("x")
    with pytest.raises(PromptRenderError, match=key):
        formatter.render(user_request(chat_template_args={key: []}))


# --- errors, sandbox and environment ----------------------------------------------------------


def test_raise_exception_becomes_prompt_render_error() -> None:
    formatter = JinjaFormatter.from_template("{{ raise_exception('Roles must alternate!') }}")
    with pytest.raises(PromptRenderError) as info:
        formatter.render(user_request())
    assert str(info.value) == "Roles must alternate!"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content.missing.deeper }}",
        "{{ messages[5].content }}",
        "{{ undefined_thing + 1 }}",
        "{{ messages[0].content + 3 }}",
        "{% for x in 5 %}{% endfor %}",
        "{{ 1 / 0 }}",
    ],
)
def test_template_misuse_is_a_prompt_render_error(template: str) -> None:
    with pytest.raises(PromptRenderError, match="chat template error"):
        JinjaFormatter.from_template(template).render_text(USER)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_secret=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ dict.__class__ }}{{ dict.__class__.__init__.__globals__ }}",
    ],
)
def test_sandbox_refuses_escapes(template: str) -> None:
    with pytest.raises(PromptRenderError):
        JinjaFormatter.from_template(template).render_text(USER)


def test_environment_helpers() -> None:
    template = (
        "{{ strftime_now('%Y-%m-%d') }}|{{ dict(a=1) | tojson }}"
        "|{{ {'b': '<&>', 'a': 'é'} | tojson(sort_keys=true) }}"
        "|{% set ns = namespace(n=0) %}{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}"
        "{% if i == 4 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"
        "|{% generation %}gen{% endgeneration %}"
    )
    before = datetime.now().strftime("%Y-%m-%d")
    text = JinjaFormatter.from_template(template).render_text(USER)
    assert text.split("|")[0] in {before, datetime.now().strftime("%Y-%m-%d")}
    assert text.split("|", 1)[1] == '{"a": 1}|{"a": "é", "b": "<&>"}|5|gen'


def test_trim_and_lstrip_blocks() -> None:
    template = "A\n  {% if true %}\n  B\n  {% endif %}\nC"
    assert JinjaFormatter.from_template(template).render_text(USER) == "A\n  B\nC"


def test_render_text_does_not_touch_its_inputs() -> None:
    messages = [{"role": "assistant", "content": None, "reasoning": "r"}]
    snapshot = json.dumps(messages)
    text = JinjaFormatter.from_template("{{ messages[0] | tojson }}").render_text(messages)
    assert text == '{"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}'
    assert json.dumps(messages) == snapshot


def test_bad_inputs_are_prompt_render_errors() -> None:
    formatter = JinjaFormatter.from_template("x")
    with pytest.raises(PromptRenderError, match="empty conversation"):
        formatter.render_text([])
    with pytest.raises(PromptRenderError, match="should be dicts"):
        formatter.render_text(["hello"])  # type: ignore[list-item]
    with pytest.raises(PromptRenderError, match="Tools should be"):
        formatter.render_text(USER, ["get_weather"])  # type: ignore[list-item]
    request = ChatCompletionRequest(model="m", messages=USER, chat_template_args={"messages": []})
    with pytest.raises(PromptRenderError, match="cannot set messages"):
        formatter.render(request)
    assert formatter.render_text(messages=USER) == formatter.render_text(USER)


def test_unset_special_tokens_are_undefined_not_none() -> None:
    template = "{{ bos_token is defined }}{{ pad_token is defined }}{{ bos_token }}"
    assert JinjaFormatter.from_template(template, bos_token="<s>").render_text(USER) == "TrueFalse<s>"


def test_templates_compile_once() -> None:
    first = JinjaFormatter.from_template("{{ messages | length }}")
    second = JinjaFormatter.from_template("{{ messages | length }}")
    assert first._template is second._template


def test_attribute_reads_match_the_plain_sandbox() -> None:
    """Attribute reads of plain dicts are inlined by the code generator: every shape reads as in
    Jinja's own sandbox (keys, missing keys, dict method names, chains, loop and namespace
    attributes, inside macros and call blocks)."""
    template = (
        "{% macro show(m) %}{{ m.role }}:{{ m.content.text if m.content.text is defined else m.content }}"
        "{% if caller is defined %}[{{ caller() }}]{% endif %}{% endmacro %}"
        "{% set ns = namespace(last=messages[0].role) %}"
        "{% for m in messages %}{{ loop.index }}{{ loop.previtem.role if not loop.first }}"
        "{{ loop.cycle('a', 'b') }}{{ loop.depth0 }}{{ loop.last }}{{ loop.nextitem is defined }}"
        "{{ loop.missing is defined }}"
        "{{ show(m) }}|{{ m.missing is defined }}|{{ m.get('role') }}|{{ m['role'] }}"
        "{{ m['nope'] is defined }}{{ m['items'] is defined }}{{ m['meta']['deep'] if m['meta'] is defined }}"
        "|{{ m.items() | list | length }}|{{ m.meta.deep.key if m.meta is defined else '-' }}"
        "{% call show(m) %}{{ m.role }}{% endcall %}{% set ns.last = m.role %}{% endfor %}{{ ns.last }}"
        "{{ messages.0.role }}"
    )
    messages = [
        {"role": "user", "content": {"text": "hi"}, "meta": {"deep": {"key": "k"}}},
        {"role": "assistant", "content": "yo", "items": "shadowed"},
    ]
    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    expected = reference.render(messages=messages)
    assert "user:hi|False|user|userFalseTrue{'key': 'k'}|3|k" in expected
    assert JinjaFormatter.from_template(template).render_text(messages) == expected


class _Loud(str):
    def upper(self) -> str:  # type: ignore[override]
        return "not plain"


class _Count(int):
    def __str__(self) -> str:
        return "not plain"


def test_messages_reach_the_template_as_plain_data() -> None:
    """Plain messages are passed as they are (a template cannot change them); anything else is
    rebuilt from plain types, nested values included."""
    template = (
        "{% for m in messages %}{{ m.content.upper() }}|{{ m.meta.n }}|{{ m.extra | tojson }};{% endfor %}"
    )
    plain = {"role": "user", "content": "hi", "meta": {"n": 3}, "extra": [1, None]}
    subclassed = {"role": "user", "content": _Loud("hi"), "meta": {"n": _Count(3)}, "extra": (1, None)}
    formatter = JinjaFormatter.from_template(template)
    assert formatter.render_text([plain, subclassed]) == "HI|3|[1, null];HI|3|[1, null];"
    context = template_context(
        [plain, subclassed, {**plain, "name": None}],
        None,
        None,
        add_generation_prompt=False,
        variables={},
        overrides={},
    )
    assert context["messages"][0] is plain
    assert context["messages"][1] is not subclassed and type(context["messages"][1]["content"]) is str
    assert context["messages"][2] == plain


def test_reads_past_the_inlined_ones_render_the_same() -> None:
    """A template's first reads are inlined, the rest compile to calls (either way the same value)."""
    template = "{{ messages[0].role }}{{ messages[0]['content'] }}," * 600
    source = _new_environment().compile(template, raw=True)
    assert source.count("is dict and") == _INLINED_READS
    assert JinjaFormatter.from_template(template).render_text(USER) == "userhi," * 600
