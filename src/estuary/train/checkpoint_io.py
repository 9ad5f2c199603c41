"""File-level pieces of a checkpoint: checksums, fsync (a file, then its folder,
so a rename is durable), and a torch optimizer state dict as safetensors tensors
plus JSON-able scalars (no pickle)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from estuary.embedding.files import fsync, sha256

__all__ = ["fsync", "optimizer_from_flat", "optimizer_to_flat", "sha256"]


def optimizer_to_flat(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a torch optimizer state dict into tensors and JSON-able scalars."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param_id}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(param_id), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_flat(
    tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]
) -> dict[str, Any]:
    """A torch optimizer state dict back from ``optimizer_to_flat``'s two parts."""
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        param_id, key = name.split(".", 1)
        state.setdefault(int(param_id), {})[key] = tensor
    for param_id, values in meta.get("scalars", {}).items():
        state.setdefault(int(param_id), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}
