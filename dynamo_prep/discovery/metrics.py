"""Prometheus metrics of the discovery plane, registered in a registry the caller owns.

The frontend owns one ``CollectorRegistry`` per process and hands it to each component; nothing
here touches prometheus_client's global default registry, so several frontends (tests) can live
in one Python process. Names carry Dynamo's ``dynamo_frontend_`` prefix so existing dashboards fit.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["PREFIX", "DiscoveryMetrics", "GaugeByModel"]

PREFIX = "dynamo_frontend_"


class GaugeByModel(Collector):
    """A gauge labelled by model, read from a plain dict at scrape time.

    A prometheus_client child per model is three objects the garbage collector walks on every full
    collection (a 10,000-name flood made those pauses last 70 ms); a dict of numbers is none.
    """

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.values: dict[str, float] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=["model"])
        for model, value in self.values.items():
            family.add_metric([model], value)
        yield family


class DiscoveryMetrics:
    """What the watcher saw: live instances and models, messages by kind, refusals by reason."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.instances = GaugeByModel(f"{PREFIX}discovery_instances", "Live instances per model")
        reg.register(self.instances)
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
        self.listener_failures = Counter(
            f"{PREFIX}discovery_listener_failures",
            "Instance changes a listener (the KV router) failed to take; the watcher went on",
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
            self.instances.values[model] = instances
        else:
            self.instances.values.pop(model, None)

    def note_unregistered(self, unregistered_token: str | None) -> None:
        """Count a preprocessor whose declared token was found unregistered (``new_with_parts``)."""
        if unregistered_token is not None:
            self.unregistered_tokens.inc()
