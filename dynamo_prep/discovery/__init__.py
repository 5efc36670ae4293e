"""Discovery plane: workers announce model cards over ZeroMQ, frontends keep the live model set."""

from dynamo_prep.discovery.broker import Broker, run_broker
from dynamo_prep.discovery.builder import BuiltModel, ModelBuilder, ModelBuildError, PreprocessorBuilder
from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.discovery.files import (
    FileFetchError,
    FileServer,
    ModelFileError,
    ModelFileStore,
    default_cache_dir,
    fetch_file,
)
from dynamo_prep.discovery.publisher import CardPublisher, card_payload
from dynamo_prep.discovery.registry import (
    CardRejected,
    ChecksumMismatch,
    DiscoveryRegistry,
    InstanceAdded,
    InstanceRemoved,
    KeyMismatch,
    LegacyDowngrade,
    ModelFirstSeen,
    ModelRemoved,
    ModelSnapshot,
    RegistryEvent,
    RuntimeConfigConflict,
)
from dynamo_prep.discovery.trust import (
    ZAP_DOMAIN,
    ClientCurve,
    ServerCurve,
    TrustError,
    apply_client_curve,
    apply_server_curve,
    authenticated_key,
    generate_keys,
    start_authenticator,
)
from dynamo_prep.discovery.watcher import DiscoveryWatcher

__all__ = [
    "ZAP_DOMAIN",
    "Broker",
    "BuiltModel",
    "CardPublisher",
    "CardRejected",
    "ChecksumMismatch",
    "ClientCurve",
    "DiscoveryRegistry",
    "DiscoveryWatcher",
    "FileFetchError",
    "FileServer",
    "InstanceAdded",
    "InstanceRemoved",
    "KeyMismatch",
    "LegacyDowngrade",
    "LiveModel",
    "ModelBuildError",
    "ModelBuilder",
    "ModelCatalog",
    "ModelFileError",
    "ModelFileStore",
    "ModelFirstSeen",
    "ModelRemoved",
    "ModelSnapshot",
    "PreprocessorBuilder",
    "RegistryEvent",
    "RuntimeConfigConflict",
    "ServerCurve",
    "TrustError",
    "apply_client_curve",
    "apply_server_curve",
    "authenticated_key",
    "card_payload",
    "default_cache_dir",
    "fetch_file",
    "generate_keys",
    "run_broker",
    "start_authenticator",
]
