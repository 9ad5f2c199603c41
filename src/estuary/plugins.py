"""The registries of Estuary's plugin kinds, with the built-in implementations.

Each kind is one ``estuary.registry.Registry``; built-ins are ``"module:attr"``
strings imported on first use (so this module imports nothing heavy and the
config loader can check names against it), and third-party packages add
implementations under the entry-point group named here. The implementation
modules keep their ``register_*`` functions, which add to these registries.

Registry (entry-point group): the job-file field that names an implementation

- ``MODELS`` (``estuary.models``): ``model.type``
- ``OPTIMIZERS`` (``estuary.optimizers``): ``model.embedding.*.optimizer.name``
- ``INITIALIZERS`` (``estuary.initializers``): ``model.embedding.*.initializer.name``
- ``DENSE_OPTIMIZERS`` (``estuary.dense_optimizers``): ``train.dense_optimizer.name``
- ``FORMATS`` (``estuary.formats``): ``data.sources[i].format``, dataset sources' ``format``
- ``STREAM_BACKENDS`` (``estuary.streams``): a stream source's ``stream.kind``; each
  entry also declares its section's fields (``Registry.section``)
- ``SOURCE_TYPES`` (``estuary.source_types``): ``data.dataset.streams.*.sources[i].type``
- ``FEATURE_KINDS`` (``estuary.feature_kinds``): ``data.schema.features[i].kind``
- ``TRANSFORMS`` (``estuary.transforms``): ``data.schema.transforms.*``, a feature's
  ``transform``
- ``SEQUENCE_POOLINGS`` (``estuary.sequence_poolings``):
  ``model.params.sequence_pooling.*.type``
- ``RUNTIMES`` (``estuary.runtimes``): ``runtime.backend`` (a ``Runtime`` class,
  built without arguments)
- ``RENDERERS`` (``estuary.renderers``): ``estuary render TARGET`` (an
  ``estuary.deploy.Renderer``)

A new kind is one more line::

    SERVERS: Registry[Any] = Registry("serving backend", group="estuary.servers")
"""

from __future__ import annotations

from typing import Any

from estuary.registry import Registry

__all__ = [
    "DENSE_OPTIMIZERS",
    "FEATURE_KINDS",
    "FORMATS",
    "INITIALIZERS",
    "MODELS",
    "OPTIMIZERS",
    "RENDERERS",
    "SEQUENCE_POOLINGS",
    "SOURCE_TYPES",
    "STREAM_BACKENDS",
    "TRANSFORMS",
]

# The registries hold classes, factories and objects of upper layers; each is
# typed where it is used (``make_optimizer``, ``build_model``, ...) so that this
# module, which the config loader reads, imports none of them.

MODELS: Registry[Any] = Registry(
    "model", group="estuary.models", unknown="unknown {kind} {name!r} (available: {known})"
)
MODELS.register("dlrm", "estuary.nn.models:DLRM")
MODELS.register("deepfm", "estuary.nn.models:DeepFM")
MODELS.register("dcnv2", "estuary.nn.models:DCNv2")
MODELS.register("logreg", "estuary.nn.models:LogisticRegression")
MODELS.register("mixture", "estuary.nn.mixture:mixture")

OPTIMIZERS: Registry[Any] = Registry("sparse optimizer", group="estuary.optimizers")
OPTIMIZERS.register("sgd", "estuary.embedding.optimizers:SGD")
OPTIMIZERS.register("adagrad", "estuary.embedding.optimizers:Adagrad")
OPTIMIZERS.register("adam", "estuary.embedding.optimizers:Adam")
OPTIMIZERS.register("ftrl", "estuary.embedding.optimizers:FTRL")
OPTIMIZERS.register("rowwise_adagrad", "estuary.embedding.optimizers:RowwiseAdagrad")
OPTIMIZERS.register("rowwise_adagrad_elem", "estuary.embedding.optimizers:RowwiseAdagradElem")
OPTIMIZERS.register("rowwise_adam", "estuary.embedding.optimizers:RowwiseAdam")

INITIALIZERS: Registry[Any] = Registry("initializer", group="estuary.initializers")
INITIALIZERS.register("uniform", "estuary.embedding.initializers:UniformInitializer")
INITIALIZERS.register("normal", "estuary.embedding.initializers:NormalInitializer")
INITIALIZERS.register(
    "truncated_normal", "estuary.embedding.initializers:TruncatedNormalInitializer"
)
INITIALIZERS.register("zeros", "estuary.embedding.initializers:ZerosInitializer")

DENSE_OPTIMIZERS: Registry[Any] = Registry("dense optimizer", group="estuary.dense_optimizers")
DENSE_OPTIMIZERS.register("adam", "torch.optim:Adam")
DENSE_OPTIMIZERS.register("adamw", "torch.optim:AdamW")
DENSE_OPTIMIZERS.register("adagrad", "torch.optim:Adagrad")
DENSE_OPTIMIZERS.register("sgd", "torch.optim:SGD")


def _instance(reader: Any) -> Any:
    """Format entries name reader classes; the registry holds one instance each."""
    return reader() if isinstance(reader, type) else reader


FORMATS: Registry[Any] = Registry("format", group="estuary.formats", adapt=_instance)
FORMATS.register("criteo_tsv", "estuary.data.formats.criteo_tsv:CriteoTsvReader")
FORMATS.register("csv", "estuary.data.formats.delimited:CsvReader")
FORMATS.register("tsv", "estuary.data.formats.delimited:TsvReader")
FORMATS.register("parquet", "estuary.data.formats.parquet:ParquetReader")
FORMATS.register("jsonl", "estuary.data.formats.jsonl:JsonlReader")

STREAM_BACKENDS: Registry[Any] = Registry("stream kind", group="estuary.streams")
# Each backend declares the fields of its stream section in a light module
# (``section``), so a job loads without the backend's client package.
STREAM_BACKENDS.register(
    "nats",
    "estuary.data.streams.nats:BACKEND",
    extra="streams",
    package="nats-py",
    section="estuary.config.streams:NatsSection",
)
STREAM_BACKENDS.register(
    "redis",
    "estuary.data.streams.redis:BACKEND",
    extra="streams",
    package="redis",
    section="estuary.config.streams:RedisSection",
)
STREAM_BACKENDS.register(
    "memory", "estuary.data.streams.memory:BACKEND", section="estuary.config.streams:MemorySection"
)

SOURCE_TYPES: Registry[Any] = Registry("source type", group="estuary.source_types")
SOURCE_TYPES.register("files", "estuary.data.graph.sources:FileSource")
SOURCE_TYPES.register("stream", "estuary.data.graph.streams:StreamSource")

# Feature kinds and transforms register themselves (with their options) when their
# module is imported; the entries here name that module.
FEATURE_KINDS: Registry[Any] = Registry("feature kind", group="estuary.feature_kinds")
for _kind in ("cross", "bucketize", "modulo", "sequence", "transform"):
    FEATURE_KINDS.register(_kind, f"estuary.data.features:_{_kind}")

TRANSFORMS: Registry[Any] = Registry(
    "transform", group="estuary.transforms", unknown="unknown {kind} {name!r} (registered: {known})"
)
for _name in ("identity", "hour_of_day", "day_of_week"):
    TRANSFORMS.register(_name, f"estuary.data.transforms:_{_name}")

SEQUENCE_POOLINGS: Registry[Any] = Registry("sequence pooling", group="estuary.sequence_poolings")
SEQUENCE_POOLINGS.register("attention", "estuary.nn.sequence_pooling:_attention")
SEQUENCE_POOLINGS.register("target_attention", "estuary.nn.sequence_pooling:_target_attention")

RUNTIMES: Registry[Any] = Registry(
    "runtime backend",
    group="estuary.runtimes",
    unknown="unknown backend {name!r} (known: {known})",
)
RUNTIMES.register("local", "estuary.runtime.local:LocalRuntime")
RUNTIMES.register("ray", "estuary.runtime.ray:RayRuntime", extra="ray", package="ray")

RENDERERS: Registry[Any] = Registry("render target", group="estuary.renderers")
RENDERERS.register("k8s", "estuary.deploy.kuberay:RENDERER")
RENDERERS.register("yarn", "estuary.deploy.yarn:RENDERER")
