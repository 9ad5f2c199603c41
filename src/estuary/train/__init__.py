"""Training: the loop, sparse update modes, prefetching, checkpoints."""

from estuary.train.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from estuary.train.checkpoint_chain import CheckpointError, CheckpointWarning
from estuary.train.sparse_updates import SparseUpdater
from estuary.train.trainer import FitResult, Trainer, TrainingStopped

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "FitResult",
    "SparseUpdater",
    "Trainer",
    "TrainingStopped",
    "load_checkpoint",
    "save_checkpoint",
]
