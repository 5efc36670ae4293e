"""Every ``dynamo-prep worker`` flag, declared once: the CLI builds its parser from this table and
passes ``WORKER_OPTIONS.values(args)`` to ``WorkerConfig.from_options``, which validates them.

Light on purpose (the CLI reads it to build its parser): defaults come from ``worker.config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from dynamo_prep.engines.base import REPLY_FORMATS
from dynamo_prep.engines.registry import DEFAULT_ENGINE, ENGINES, FLAVORS
from dynamo_prep.options import NAMESPACE, Option, Options, addresses, listed
from dynamo_prep.protocol.discovery import DEFAULT_HEARTBEAT_S, DEFAULT_TTL_MS
from dynamo_prep.worker import config as defaults

__all__ = ["WORKER_DESCRIPTION", "WORKER_OPTIONS"]

WORKER_DESCRIPTION: Final = (
    "Flags not listed here go to the engine's own parser unchanged (--engine vllm or "
    "sglang: --tensor-parallel-size, --block-size / --page-size, --kv-events-config, --seed, ...)."
)
MODEL_PATH_HELP: Final = "model directory, or kimi-k3-demo / qwen-vl-demo / llama3-demo"


def _answer_parser(flag: str, key: str, what: str) -> Option:
    """vLLM's flags and names, with every engine: the card carries them, the frontend parses answers."""
    return Option(
        flag,
        f"how the frontend reads {what} in this model's answers, by vLLM's parser name (README "
        "lists them; default: the model family's); an unknown name is refused",
        key=key,
        spec={"metavar": "NAME"},
    )


_IDENTITY: Final = (
    Option("--model-path", MODEL_PATH_HELP, key="model_path", spec={"required": True}),
    Option("--served-name", "model name (default: the directory name)", key="served_name"),
    Option(
        "--declare-image-token",
        "per-image token the engine expects (default: what the engine's processor declares)",
        key="declared_image_token",
        exclusive="declaration",
    ),
    Option(
        "--legacy-expands-image-pad-token",
        "publish the pre-declaration card key (to exercise rolling upgrades)",
        key="legacy_expands_image_pad_token",
        exclusive="declaration",
        spec={"action": "store_true"},
    ),
)

_ANNOUNCE: Final = (
    Option(
        "--discovery",
        "ADDR[,ADDR] of frontends or brokers",
        key="discovery",
        spec={"type": addresses, "required": True},
    ),
    Option(
        "--endpoint-host",
        "address to bind the request plane on, advertised in the card",
        key="endpoint_host",
        default=defaults.DEFAULT_ENDPOINT_HOST,
        env="DYN_ENDPOINT_HOST",
    ),
    Option(
        "--heartbeat",
        f"seconds between announces (default {DEFAULT_HEARTBEAT_S:g})",
        key="heartbeat_s",
        default=DEFAULT_HEARTBEAT_S,
        spec={"type": float, "metavar": "SECONDS"},
    ),
    Option(
        "--ttl-ms",
        f"how long frontends keep this instance without news (default {DEFAULT_TTL_MS})",
        key="ttl_ms",
        default=DEFAULT_TTL_MS,
        spec={"type": int},
    ),
)

_ENGINE: Final = (
    Option(
        "--engine",
        "the engine behind the worker: the GPU-free mock (default), or a real vLLM or SGLang engine "
        "in this process, built from the engine flags with --model-path as its model unless they name one",
        key="engine",
        default=DEFAULT_ENGINE,
        spec={"choices": ENGINES},
    ),
    Option(
        "--flavor",
        "mock engine: whose image contract it enforces (default sglang)",
        key="flavor",
        spec={"choices": FLAVORS},
    ),
    Option(
        "--token-delay",
        f"mock engine delay per token (default {defaults.DEFAULT_TOKEN_DELAY_S:g})",
        key="token_delay_s",
        spec={"type": float, "metavar": "SECONDS"},
    ),
    Option(
        "--replies",
        'mock engine: scripted replies, JSON Lines {"when": SUBSTRING, ...} with one of segments, '
        "text or token_ids; the first whose when occurs in the last user message is streamed",
        key="replies",
        spec={"type": Path, "metavar": "FILE"},
    ),
    Option(
        "--reply-format",
        "mock engine, when no scripted reply matches: the echo in the model's own answer format "
        "(think channel, response, a call of the first declared tool; the default), or as plain text",
        key="reply_format",
        spec={"choices": REPLY_FORMATS},
    ),
    _answer_parser("--tool-call-parser", "tool_call_parser", "tool calls"),
    _answer_parser("--reasoning-parser", "reasoning_parser", "reasoning"),
    Option(
        "--enable-auto-tool-choice",
        "accepted as vllm serve takes it (calls are parsed whenever a tool-call parser is in effect)",
        spec={"action": "store_true"},
    ),
)

_SERVING: Final = (
    Option(
        "--migration-limit",
        "times a request may move to another instance (card)",
        key="migration_limit",
        default=0,
        spec={"type": int},
    ),
    Option(
        "--drain-timeout",
        f"on SIGTERM, how long in-flight requests may finish (default {defaults.DEFAULT_DRAIN_TIMEOUT_S:g})",
        key="drain_timeout_s",
        default=defaults.DEFAULT_DRAIN_TIMEOUT_S,
        spec={"type": float, "metavar": "SECONDS"},
    ),
    Option(
        "--engine-stall-timeout",
        "requests in flight and no engine step for this long: the engine is hung, the worker "
        "withdraws, fails its requests over (503) and exits 1 (0: off; "
        f"default {defaults.DEFAULT_ENGINE_STALL_TIMEOUT_S:g})",
        key="engine_stall_timeout_s",
        default=defaults.DEFAULT_ENGINE_STALL_TIMEOUT_S,
        spec={"type": float, "metavar": "SECONDS"},
    ),
    Option(
        "--slots",
        "mock engine: at most N requests generate at once, the others wait in order without a "
        "token, as in an engine's queue (its card says max_num_seqs N; default: no bound)",
        key="slots",
        spec={"type": int, "metavar": "N"},
    ),
    Option(
        "--metrics-port",
        "serve dynamo_worker_* Prometheus metrics on this port (default off; 0: a free port, logged)",
        key="metrics_port",
        spec={"type": int},
    ),
    Option(
        "--kv-events",
        "mock engine: keep a paged prefix cache (blocks of the card's kv_cache_block_size) and publish "
        "its KV events (vLLM's wire; the addresses go into the announce)",
        key="kv_events",
        spec={"action": "store_true"},
    ),
    Option(
        "--kv-blocks",
        "with --kv-events: cache capacity in blocks, unused ones evicted least recently used first "
        f"(default {defaults.DEFAULT_KV_BLOCKS})",
        key="kv_blocks",
        spec={"type": int, "metavar": "N"},
    ),
    Option(
        "--prefill-ms-per-1k",
        "with --kv-events: prefill time per 1000 prompt tokens not in the cache; prefills queue "
        "one after another, as on a GPU "
        f"(default {defaults.DEFAULT_PREFILL_MS_PER_1K:g})",
        key="prefill_ms_per_1k",
        spec={"type": float, "metavar": "MS"},
    ),
)

# Where the worker fetches request images from, whatever its engine (docs/engines.md).
_MEDIA: Final = (
    Option(
        "--allowed-media-domains",
        "fetch request images only from these host names, exact matches, as vLLM's flag "
        "(space- or comma-separated; default: any host whose addresses are allowed)",
        key="allowed_media_domains",
        convert=listed,
        spec={"nargs": "+", "action": "extend", "metavar": "DOMAIN"},
    ),
    Option(
        "--allowed-media-networks",
        "private networks request images may also come from, e.g. 10.0.0.0/8 or 127.0.0.1/32 "
        "(default none: only globally reachable addresses; 0.0.0.0 and multicast never)",
        key="allowed_media_networks",
        default=[],
        convert=lambda values: listed(values) or (),
        spec={"nargs": "+", "action": "extend", "metavar": "CIDR"},
    ),
)

_DISCOVERY_CLIENT: Final = (
    NAMESPACE,
    Option(
        "--curve-secret-key",
        "this process's CURVE secret key file",
        key="curve_secret_key",
        spec={"type": Path},
    ),
    Option(
        "--curve-server-key",
        "the receiving side's public key file",
        key="curve_server_key",
        spec={"type": Path},
    ),
)

WORKER_OPTIONS: Final = Options((*_IDENTITY, *_ANNOUNCE, *_ENGINE, *_SERVING, *_MEDIA, *_DISCOVERY_CLIENT))
