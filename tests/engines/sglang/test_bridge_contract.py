"""Every call the SGLang bridge makes, against SGLang 0.5.23's real classes (no GPU needed):
``async_generate``'s signature binds our keywords, ``SamplingParams`` takes and verifies our
sampling dicts, SGLang's own parser reads a worker's command line (through our two-stage parse),
the tokenizer manager has the methods we call, and the figures the card reads exist."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

from dynamo_prep import cli
from dynamo_prep.engines.kv_config import kv_events_endpoint
from dynamo_prep.engines.sglang.runtime import SglangApi, parse_server_args
from dynamo_prep.engines.sglang.translate import (
    ChunkReader,
    engine_argv,
    engine_facts,
    generate_kwargs,
    sampling_params,
)
from dynamo_prep.protocol.preprocessed import (
    ImageRef,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
)

VOCAB = 8448
EOS = 8194


def request(**sampling: Any) -> PreprocessedRequest:
    stop = StopConditions(max_tokens=32, min_tokens=sampling.pop("min_tokens", None), stop_token_ids=[7])
    stop.stop_token_ids_hidden = [] if sampling.get("ignore_eos") else [EOS]
    stop.ignore_eos = bool(sampling.pop("ignore_eos", False))
    return PreprocessedRequest(
        model="m",
        token_ids=[1, 2, 3],
        stop_conditions=stop,
        sampling_options=SamplingOptions(**sampling),
        eos_token_ids=[EOS],
        images=[ImageRef(url="data:image/png;base64,AAAA", uuid="ab" * 16)],
    )


REQUESTS = {
    "greedy": request(temperature=0.0),
    "sampled": request(temperature=0.8, top_p=0.9, top_k=40, seed=3, presence_penalty=0.5),
    "top_k_off": request(temperature=0.7, top_k=0),
    "min_tokens": request(min_tokens=4, repetition_penalty=1.1),
    "ignore_eos": request(ignore_eos=True, frequency_penalty=-0.5),
    "json_schema": request(structured=StructuredOutput(json_schema='{"type": "array", "maxItems": 2}')),
    "json_object": request(structured=StructuredOutput(json_object=True)),
    "logprobs": msgspec.structs.replace(
        request(), output_options=OutputOptions(logprobs=True, top_logprobs=2)
    ),
}


@pytest.mark.parametrize("name", REQUESTS)
def test_async_generate_binds_the_keywords_the_bridge_passes(name: str) -> None:
    kwargs = generate_kwargs(
        REQUESTS[name], {"temperature": 0.6}, ["decoded image"], "dp-1", uuids=["ab" * 16 + "-" + "cd" * 16]
    )
    inspect.signature(Engine.async_generate).bind(object(), **kwargs)


@pytest.mark.parametrize("name", REQUESTS)
def test_sampling_params_take_and_verify_our_dicts(name: str) -> None:
    params = SamplingParams(**sampling_params(REQUESTS[name], {"top_p": 0.95, "min_p": 0.05}))
    params.verify(VOCAB)
    assert params.max_new_tokens == 32
    assert set(params.stop_token_ids) >= {7}


def test_streamed_logprobs_are_the_chunk_s_own_triples_the_reader_takes() -> None:
    """SGLang slices the output logprob lists per incremental chunk, as (logprob, id, text) triples
    (text None: the bridge does not ask for text); the reader makes one record per id of them."""
    from sglang.srt.managers import tokenizer_manager  # noqa: PLC0415

    keys = tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS
    assert {"output_token_logprobs", "output_top_logprobs"} <= set(keys)
    meta: dict[str, Any] = {
        "output_token_logprobs": [(-9.0, 5, None), (-1.0, 6, None), (-2.0, 7, None)],
        "output_top_logprobs": [[(-0.5, 1, None)], [(-1.0, 6, None)], [(-0.75, 8, None)]],
    }
    tokenizer_manager._slice_streaming_output_meta_info(meta, 1)
    triples = TokenizerManager.detokenize_logprob_tokens(object(), [-1.0, -2.0], [6, 7], False)  # type: ignore[arg-type]
    assert meta["output_token_logprobs"] == triples
    meta["finish_reason"] = {"type": "stop", "matched": 7}
    step = ChunkReader(REQUESTS["logprobs"]).step({"output_ids": [6, 7], "meta_info": meta})
    assert step.token_ids == [6] and step.logprobs is not None  # 7 is the stop id, dropped
    assert (step.logprobs[0].logprob, step.logprobs[0].top) == (-1.0, ((6, -1.0),))


def test_top_k_zero_would_be_refused_so_it_is_sent_as_minus_one() -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=0.7, top_k=0).verify(VOCAB)
    assert sampling_params(REQUESTS["top_k_off"], {})["top_k"] == -1


def test_a_seed_would_be_refused_so_it_is_sent_as_sampling_seed() -> None:
    with pytest.raises(TypeError):
        SamplingParams(seed=3)  # type: ignore[call-arg]
    assert sampling_params(REQUESTS["sampled"], {})["sampling_seed"] == 3


def test_the_tokenizer_manager_and_engine_have_what_the_bridge_calls() -> None:
    inspect.signature(TokenizerManager.abort_request).bind(object(), rid="dp-1")
    inspect.signature(TokenizerManager.auto_create_handle_loop).bind(object())
    inspect.signature(Engine.shutdown).bind(object())
    inspect.signature(Engine.__init__).bind(object(), server_args=object())


def test_sglang_s_parser_reads_a_worker_command_line(engine_model: Path) -> None:
    """``dynamo-prep worker --engine sglang`` with SGLang's own flags: ours are taken, the rest go to
    SGLang's parser unchanged, the model path is added, and streaming is set to deltas."""
    kv = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    args = cli.parse_args(
        [
            "worker", "--engine", "sglang", "--model-path", str(engine_model), "--discovery", "tcp://fe:7555",
            "--drain-timeout", "30", "--page-size", "16", "--tp-size", "1",
            "--kv-events-config", json.dumps(kv), "--context-length", "4096", "--max-running-requests", "8",
        ]
    )  # fmt: skip
    assert args.engine_args[:2] == ["--page-size", "16"] and args.drain_timeout == 30.0
    server_args = parse_server_args(SglangApi.load(), engine_argv(engine_model, args.engine_args))
    assert isinstance(server_args, ServerArgs)
    assert server_args.model_path == str(engine_model)
    assert (server_args.page_size, server_args.tp_size, server_args.context_length) == (16, 1, 4096)
    assert server_args.incremental_streaming_output is True
    assert json.loads(server_args.kv_events_config) == kv
    facts = engine_facts(server_args, {"max_total_num_tokens": 4000}, 4096)
    assert (facts.block_size, facts.total_kv_blocks, facts.max_num_seqs) == (16, 250, 8)
    advertised = kv_events_endpoint(facts.kv_events_config, flavor="sglang", endpoint_host="10.0.0.5")
    assert advertised is not None and advertised.endpoint == "tcp://10.0.0.5:5557"


def test_a_wrong_engine_flag_is_refused_by_sglang_s_parser() -> None:
    with pytest.raises(SystemExit):
        parse_server_args(SglangApi.load(), ["--model-path", "/m", "--no-such-flag"])


def test_the_declared_token_path_exists_on_sglang_s_processor_types() -> None:
    """``engine.tokenizer_manager.mm_processor.mm_tokens.image_token``: the attribute names our
    declaration reads are SGLang's own."""
    from sglang.srt.multimodal.processors.base_processor import MultimodalSpecialTokens  # noqa: PLC0415

    tokens = MultimodalSpecialTokens(image_token="<|media_pad|>")
    assert tokens.image_token == "<|media_pad|>"
    source = inspect.getsource(TokenizerManager)
    assert "self.mm_processor" in source
    assert SimpleNamespace(mm_tokens=tokens).mm_tokens.image_token == "<|media_pad|>"


def test_every_reasoning_parser_a_worker_passes_on_is_one_sglang_has() -> None:
    from sglang.srt.parser.reasoning_parser import ReasoningParser  # noqa: PLC0415

    from dynamo_prep.engines.registry import bridge  # noqa: PLC0415
    from dynamo_prep.parsing import REASONING_PARSERS  # noqa: PLC0415

    passed = {flags[1] for name in REASONING_PARSERS if (flags := bridge("sglang").reasoning_flags(name, ()))}
    assert "mistral" in passed
    assert passed <= set(ReasoningParser.DetectorMap)
