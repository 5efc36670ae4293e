"""Prometheus metrics of the discovery plane, registered in a registry the caller owns.

The frontend owns one ``CollectorRegistry`` per process and hands it to each component; nothing
here touches prometheus_client's global default registry, so several frontends (tests) can live
in one Python process. Names carry Dynamo's ``dynamo_frontend_`` prefix so existing dashboards fit.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["PREFIX", "DiscoveryMetrics"]

PREFIX = "dynamo_frontend_"


class DiscoveryMetrics:
    """What the watcher saw: live instances and models, messages by kind, refusals by reason."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.instances = Gauge(
            f"{PREFIX}discovery_instances", "Live instances per model", ["model"], registry=reg
        )
        self.models = Gauge(
            f"{PREFIX}discovery_models", "Models with at least one live instance", registry=reg
        )
        self.messages = Counter(
            f"{PREFIX}discovery_messages",
            "Discovery messages received, by kind (announce, withdraw, invalid, other_topic)",
            ["kind"],
            registry=reg,
        )
        self.rejected = Counter(
            f"{PREFIX}discovery_rejected",
            "Refused discovery messages and cards, by reason",
            ["reason"],
            registry=reg,
        )
        self.legacy_downgrades = Counter(
            f"{PREFIX}legacy_card_downgrades", "Instances announcing a legacy card key", registry=reg
        )
        self.unregistered_tokens = Counter(
            f"{PREFIX}declared_image_token_unregistered",
            "Preprocessors built for a declared image token that is not a special token",
            registry=reg,
        )
        self.runtime_config_conflicts = Counter(
            f"{PREFIX}runtime_config_conflicts",
            "runtime_config fields of a later instance that differ from the model's first card",
            registry=reg,
        )

    def set_model(self, model: str, instances: int) -> None:
        """Follow one model's instance count; a model with none left drops its label set."""
        if instances > 0:
            self.instances.labels(model=model).set(instances)
        else:
            self.instances.remove(model)  # a no-op when the label set is absent

    def note_unregistered(self, unregistered_token: str | None) -> None:
        """Count a preprocessor whose declared token was found unregistered (``new_with_parts``)."""
        if unregistered_token is not None:
            self.unregistered_tokens.inc()
