"""Data layer: files -> checked rows -> hashed ids -> ``Batch``.

    TabularDataset(spec.data, base_dir)   read every source into one columnar table
      .split() -> (train, eval)           eval = the last eval_fraction, file order
      .batches(part, B, shuffle, seed, epoch) -> Iterator[Batch]
      .bad_rows                           count, rows_read, first file:line reasons

Formats are found by name (``get_format``), value transforms by name
(``register_transform``), derived-feature kinds by name
(``register_feature_kind``); ids are XXH64 of the value's text seeded per
feature (``hashing``).
"""

from estuary.data.badrows import BadRow, BadRowReport
from estuary.data.errors import BadDataError, DataError, DataFileError, DataWarning
from estuary.data.features import register_feature_kind
from estuary.data.formats import FormatReader, available_formats, get_format, register_format
from estuary.data.hashing import feature_seed, hash_array, hash_feature, missing_id
from estuary.data.tabular import DataPart, TabularDataset
from estuary.data.transforms import register_transform
from estuary.data.types import Batch, JaggedIds

__all__ = [
    "BadDataError",
    "BadRow",
    "BadRowReport",
    "Batch",
    "DataError",
    "DataFileError",
    "DataPart",
    "DataWarning",
    "FormatReader",
    "JaggedIds",
    "TabularDataset",
    "available_formats",
    "feature_seed",
    "get_format",
    "hash_array",
    "hash_feature",
    "missing_id",
    "register_feature_kind",
    "register_format",
    "register_transform",
]
