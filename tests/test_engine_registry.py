"""Engines are plug-ins: every registered engine provides every part, in its own folder."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from dynamo_prep.engines.bridge import EngineBridge, KvDialect
from dynamo_prep.engines.kv_config import kv_events_endpoint
from dynamo_prep.engines.registry import BRIDGES, DEFAULT_ENGINE, DEFAULT_FLAVOR, ENGINES, FLAVORS, bridge
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.tokenizer import Tokenizer

ENGINES_DIR = Path(__file__).resolve().parent.parent / "dynamo_prep" / "engines"
K3 = resolve_model_dir("kimi-k3-demo")


@pytest.mark.parametrize("name", ENGINES)
def test_every_engine_provides_every_part(name: str) -> None:
    engine = BRIDGES[name]
    assert isinstance(engine, EngineBridge)
    assert engine.name == name
    assert (ENGINES_DIR / name / "bridge.py").is_file(), "one folder per engine, its bridge in it"
    assert engine.start.startswith(f"dynamo_prep.engines.{name}."), "it starts from its own folder"
    started = engine.load_start()
    assert inspect.isclass(started)
    engine.check_options((), {})
    assert isinstance(engine.engine_argv(K3, ()), list)
    assert engine.reasoning_flags(None, ()) == ()
    assert engine.declared_image_token(None) is None
    if engine.real:
        assert callable(getattr(started, "start", None)), "a real engine's runtime starts itself"
        assert isinstance(engine.kv_dialect, KvDialect)
        assert engine.emulate is not None, "the mock can enforce every real engine's contract"
        with pytest.raises(ValueError, match=f"--slots: options of --engine mock, not of --engine {name}"):
            engine.check_options((), {"--slots": 2})
    else:
        assert engine.kv_dialect is None and engine.emulate is None
        with pytest.raises(ValueError, match=f"unrecognized arguments for --engine {name}: --seed 0"):
            engine.check_options(("--seed", "0"), {})


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_mock_emulates_each_real_engines_contract(flavor: str) -> None:
    emulate = bridge(flavor).emulate
    assert emulate is not None
    contract = emulate(K3, Tokenizer.from_model_dir(K3))
    assert contract.pattern, "kimi-k3-demo takes images under every engine"
    assert str(2) in contract.mismatch(2, 1)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_each_real_engine_reads_its_own_kv_events_config(flavor: str) -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    advertised = kv_events_endpoint(config, flavor=flavor, endpoint_host="10.0.0.1")
    assert advertised is not None and advertised.endpoint == "tcp://10.0.0.1:5557"


def test_the_defaults_and_an_unknown_engine() -> None:
    assert DEFAULT_ENGINE in ENGINES and not bridge(DEFAULT_ENGINE).real
    assert DEFAULT_FLAVOR in FLAVORS
    assert set(FLAVORS) == {name for name in ENGINES if bridge(name).real}
    with pytest.raises(ValueError, match=r"unknown --engine 'trtllm' \(known: "):
        bridge("trtllm")
    with pytest.raises(ValueError, match="takes no --kv-events-config"):
        kv_events_endpoint({}, flavor=DEFAULT_ENGINE, endpoint_host="127.0.0.1")
