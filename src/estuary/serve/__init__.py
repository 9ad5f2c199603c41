"""Serving: export a checkpoint, answer predictions over HTTP, follow a run live.

- ``export``: ``export_checkpoint`` (a checkpoint -> a folder of a torch.export
  program, safetensors tables, the feature pipeline as JSON and a manifest of
  checksums) and ``load_export``.
- ``pipeline``: ``FeaturePipeline``, raw rows -> ``Batch`` with the training code.
- ``model``: ``ServingModel``, tables + dense network, updated atomically.
- ``batching``: ``MicroBatcher``, concurrent requests -> one forward.
- ``app``: the ASGI application (``/predict``, ``/healthz``, ``/metrics``).
- ``follow``: ``Follower``, applies a run's new checkpoints on a thread while serving
  (``--prepare thread``).
- ``process_follow``: ``ProcessFollower``, the same with each update prepared in a
  child process (``prepare_process``: ``Preparer`` checks each delta, ``slots``
  writes it into the slot file the server does not serve, by what that slot
  missed) and swapped in whole (``LiveTable`` over ``slot_table.SlotTable``; the
  default); a hung child is killed at a progress deadline and replaced.
- ``ray_serve``: the same application as a Ray Serve deployment.

See docs/serving.md.
"""

from estuary.serve.export import ExportError, export_checkpoint, load_export
from estuary.serve.model import Prediction, ServingModel
from estuary.serve.pipeline import FeaturePipeline, RequestError

__all__ = [
    "ExportError",
    "FeaturePipeline",
    "Prediction",
    "RequestError",
    "ServingModel",
    "export_checkpoint",
    "load_export",
]
