"""KvRouting in-process: a mixed pool (two declarations) decided on one index, and the load it tracks."""

from __future__ import annotations

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.kv_events import BlockStored
from dynamo_prep.protocol.preprocessed import PreprocessedRequest, StopConditions
from dynamo_prep.routing.kv import KvRouting
from dynamo_prep.routing.router import Route, RoutingPrompt

MEDIA_PAD = "<|media_pad|>"


def test_a_text_prompt_is_matched_for_every_declaration_of_a_mixed_pool() -> None:
    card = ModelDeploymentCard.from_model_dir(resolve_model_dir("kimi-k3-demo"))
    size = card.kv_cache_block_size
    routing = KvRouting()
    sglang = Instance(instance_id="sglang", endpoint="tcp://127.0.0.1:1", declared_token=MEDIA_PAD)
    vllm = Instance(instance_id="vllm", endpoint="tcp://127.0.0.1:2")
    for instance in (sglang, vllm):
        routing.instance_added(card, instance)
    tokens = list(range(100, 100 + 4 * size + 1))  # 4 full blocks and a partial one
    request = PreprocessedRequest(
        model=card.display_name, token_ids=tokens, stop_conditions=StopConditions(max_tokens=8)
    )
    prompts = {MEDIA_PAD: RoutingPrompt(request, [7]), None: RoutingPrompt(request, [8])}
    for cached, other in ((vllm, sglang), (sglang, vllm)):
        routing.reset(other.instance_id)
        stored = BlockStored(
            block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=tokens[: 4 * size], block_size=size
        )
        routing.apply(cached.instance_id, [stored])
        for order in ([sglang, vllm], [vllm, sglang]):  # whichever declaration is hashed first
            decision = routing.decide(card.display_name, order, prompts)
            assert (decision.instance_id, decision.overlap_blocks) == (cached.instance_id, 4)
            assert len(decision.block_hashes) == 4 and decision.prompt_blocks == 5
        routing.reset(cached.instance_id)
    route = Route({"sglang": sglang, "vllm": vllm}[decision.instance_id], decision)
    routing.dispatch(card.display_name, "r1", route)
    routing.dispatch(card.display_name, "r2", route)
    assert routing.active_blocks(card.display_name) == {decision.instance_id: 4 + 2}
    routing.release(card.display_name, "r1")
    routing.release(card.display_name, "r2")
    assert routing.active_blocks(card.display_name) == {}
