"""deltad: streams fresh embedding rows from an online TorchRec trainer to many predictors.

The public API is imported from here::

    from deltad import SegmentPublisher, PublisherConfig          # trainer side
    from deltad import DeltaConsumer, ConsumerConfig, PullOptions  # predictor side

Names load on first use (PEP 562), so ``import deltad`` and ``deltad --help`` stay cheap and
a predictor-only process never imports the trainer side.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# gRPC's C core writes its INFO lines to stderr unthrottled when nothing configured its logging
# (one per failed TLS handshake: a client without a certificate retrying every second filled a
# sidecar's log). deltad logs what it sees itself; gRPC's own errors still show. Read once,
# when gRPC is first imported: GRPC_VERBOSITY=INFO (or DEBUG) in the environment wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # configuration and vocabulary
    "TrackerConfig": "deltad.config",
    "PublisherConfig": "deltad.config",
    "ServerConfig": "deltad.config",
    "ConsumerConfig": "deltad.config",
    "PullOptions": "deltad.config",
    "Form": "deltad.types",
    "WireDtype": "deltad.types",
    "TrainLoop": "deltad.types",
    "Cursor": "deltad.types",
    "Shard": "deltad.types",
    # errors (every class of deltad.errors; one root, DeltadError)
    "DeltadError": "deltad.errors",
    "ConfigError": "deltad.errors",
    "UnsupportedModelError": "deltad.errors",
    "SpoolError": "deltad.errors",
    "SegmentCorruptError": "deltad.errors",
    "GenerationChangedError": "deltad.errors",
    "OffsetStoreError": "deltad.errors",
    "StaleCursorError": "deltad.errors",
    "UpstreamError": "deltad.errors",
    "ConsumerError": "deltad.errors",
    "SidecarUnavailableError": "deltad.errors",
    "OverloadedError": "deltad.errors",
    "StreamDecodeError": "deltad.errors",
    "WindowRefused": "deltad.errors",
    "HeldStateRefused": "deltad.errors",
    "RolloutError": "deltad.errors",
    "RolloutRefused": "deltad.errors",
    "OwedBudgetError": "deltad.errors",
    # publish side
    "DeltaTracker": "deltad.publish.tracker",
    "SegmentPublisher": "deltad.publish.publisher",
    # consume side
    "DeltaConsumer": "deltad.consume.client",
    "PullResult": "deltad.consume.result",
    "RankDelta": "deltad.consume.window",
    "ShardUpdate": "deltad.consume.window",
    "SliceUpdate": "deltad.consume.window",  # the former name of ShardUpdate (not in __all__)
    "Applier": "deltad.consume.appliers",
    "TensorDictApplier": "deltad.consume.appliers",
    "TorchRecApplier": "deltad.consume.appliers",
    "QuantApplier": "deltad.consume.quant",
    "quantize_model": "deltad.consume.quant",
    "export_torchscript": "deltad.consume.export",
    "ServeDtype": "deltad.types",
    "ApplyConsistency": "deltad.types",
}

__all__ = [
    "Applier",
    "ApplyConsistency",
    "ConfigError",
    "ConsumerConfig",
    "ConsumerError",
    "Cursor",
    "DeltaConsumer",
    "DeltaTracker",
    "DeltadError",
    "Form",
    "GenerationChangedError",
    "HeldStateRefused",
    "OffsetStoreError",
    "OverloadedError",
    "OwedBudgetError",
    "PublisherConfig",
    "PullOptions",
    "PullResult",
    "QuantApplier",
    "RankDelta",
    "RolloutError",
    "RolloutRefused",
    "SegmentCorruptError",
    "SegmentPublisher",
    "ServeDtype",
    "ServerConfig",
    "Shard",
    "ShardUpdate",
    "SidecarUnavailableError",
    "SpoolError",
    "StaleCursorError",
    "StreamDecodeError",
    "TensorDictApplier",
    "TorchRecApplier",
    "TrackerConfig",
    "TrainLoop",
    "UnsupportedModelError",
    "UpstreamError",
    "WindowRefused",
    "WireDtype",
    "__version__",
    "export_torchscript",
    "quantize_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from deltad.config import (
        ConsumerConfig,
        PublisherConfig,
        PullOptions,
        ServerConfig,
        TrackerConfig,
    )
    from deltad.consume.appliers import Applier, TensorDictApplier, TorchRecApplier
    from deltad.consume.client import DeltaConsumer
    from deltad.consume.export import export_torchscript
    from deltad.consume.quant import QuantApplier, quantize_model
    from deltad.consume.result import PullResult
    from deltad.consume.window import RankDelta, ShardUpdate
    from deltad.errors import (
        ConfigError,
        ConsumerError,
        DeltadError,
        GenerationChangedError,
        HeldStateRefused,
        OffsetStoreError,
        OverloadedError,
        OwedBudgetError,
        RolloutError,
        RolloutRefused,
        SegmentCorruptError,
        SidecarUnavailableError,
        SpoolError,
        StaleCursorError,
        StreamDecodeError,
        UnsupportedModelError,
        UpstreamError,
        WindowRefused,
    )
    from deltad.publish.publisher import SegmentPublisher
    from deltad.publish.tracker import DeltaTracker
    from deltad.types import (
        ApplyConsistency,
        Cursor,
        Form,
        ServeDtype,
        Shard,
        TrainLoop,
        WireDtype,
    )
