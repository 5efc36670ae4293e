"""The flags of ``render``, ``up``, ``watch``, ``broker`` and ``keys generate``, each declared once
(``worker``'s are ``worker.options``, ``frontend``'s ``frontend.options``): the parser is built from
a table and the handler's keywords are its values. Light on purpose: defaults only."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from dynamo_prep.cli import up as up_defaults
from dynamo_prep.frontend.config import DEFAULT_HTTP_PORT
from dynamo_prep.options import CURVE_ALLOW_DIR, NAMESPACE, Option, Options, addresses
from dynamo_prep.protocol.discovery import DEFAULT_BROKER_XPUB, DEFAULT_BROKER_XSUB
from dynamo_prep.worker.options import MODEL_PATH_HELP

__all__ = ["BROKER_OPTIONS", "KEYS_GENERATE_OPTIONS", "RENDER_OPTIONS", "UP_OPTIONS", "WATCH_OPTIONS"]

RENDER_OPTIONS: Final = Options(
    (
        Option("--model-path", MODEL_PATH_HELP, key="model_path", spec={"required": True}),
        Option("--served-name", "model name (default: the directory name)", key="served_name"),
        Option(
            "--declared-token",
            "the per-image token a worker would declare (default: none, the checkpoint default)",
            key="declared_token",
            aliases=("--image-token",),
            spec={"dest": "declared_token"},
        ),
        Option(
            "--hosted", "Kimi-K3: stop before the channel opener", key="hosted", spec={"action": "store_true"}
        ),
        Option(
            "--jinja-tokenization",
            "Jinja templates: 'segmented' keeps user text from becoming special tokens (default); "
            "'hf' encodes the whole prompt like Hugging Face (user text may spell special tokens)",
            key="strict_hf_tokenization",
            default="segmented",
            convert=lambda value: value == "hf",
            spec={"choices": ["segmented", "hf"]},
        ),
        # The request is read by the handler (a file or stdin), not passed on as its path.
        Option("request", "OpenAI chat completion request JSON ('-' for stdin)", spec={"type": Path}),
    )
)

UP_OPTIONS: Final = Options(
    (
        Option(
            "--http-port",
            "the frontend's HTTP port",
            key="http_port",
            default=DEFAULT_HTTP_PORT,
            env="DYN_HTTP_PORT",
            spec={"type": int},
        ),
        Option(
            "--discovery-bind",
            f"the frontend's embedded plane (default {up_defaults.DEFAULT_UP_DISCOVERY})",
            key="discovery_bind",
            default=up_defaults.DEFAULT_UP_DISCOVERY,
        ),
        Option(
            "--model",
            f"demo model directory or name (default {up_defaults.DEFAULT_UP_MODEL})",
            key="model",
            default=up_defaults.DEFAULT_UP_MODEL,
        ),
        Option("--log-dir", "child logs go here (default: a temp dir)", key="log_dir", spec={"type": Path}),
        Option(
            "--watch-address",
            "workers also announce here, for `dynamo-prep watch --bind ADDR` "
            f"(default {up_defaults.DEFAULT_WATCH_ADDRESS})",
            key="watch_address",
            default=up_defaults.DEFAULT_WATCH_ADDRESS,
        ),
    )
)

BROKER_OPTIONS: Final = Options(
    (
        Option(
            "--xsub",
            f"workers connect here (default {DEFAULT_BROKER_XSUB})",
            key="xsub",
            default=DEFAULT_BROKER_XSUB,
        ),
        Option(
            "--xpub",
            f"frontends connect here (default {DEFAULT_BROKER_XPUB})",
            key="xpub",
            default=DEFAULT_BROKER_XPUB,
        ),
        Option(
            "--curve-secret-key",
            "this broker's CURVE secret key file (XSUB side)",
            key="curve_secret_key",
            spec={"type": Path},
        ),
        CURVE_ALLOW_DIR,
    )
)

WATCH_OPTIONS: Final = Options(
    (
        Option(
            "--discovery",
            "connect to brokers' XPUB ADDR[,ADDR]",
            key="discovery",
            default=[],
            spec={"type": addresses},
        ),
        Option(
            "--bind",
            "bind ADDR[,ADDR]; workers connect here",
            key="bind",
            default=[],
            spec={"type": addresses},
        ),
        NAMESPACE,
        Option(
            "--json",
            "one JSON line per change instead of the table",
            key="json_lines",
            spec={"action": "store_true"},
        ),
        Option(
            "--once-after",
            "watch this long, then print the table (or a JSON snapshot line) and exit 0",
            key="once_after",
            spec={"type": float, "metavar": "SECONDS"},
        ),
    )
)

KEYS_GENERATE_OPTIONS: Final = Options(
    (
        Option(
            "directory",
            "where to write the key pair (created if missing)",
            key="directory",
            spec={"type": Path},
        ),
        Option(
            "--name",
            "file name stem: NAME.key and NAME.key_secret (default dynamo-prep)",
            key="name",
            default="dynamo-prep",
        ),
    )
)
