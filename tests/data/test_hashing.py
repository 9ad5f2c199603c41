"""Ids must be the same in every process, on every platform, for every release:
checkpoints are keyed by them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.data.hashing import (
    feature_seed,
    hash_array,
    hash_bytes,
    hash_feature,
    missing_id,
    xxh64,
)

from .xxh64_reference import xxh64_reference

# Published XXH64 test vectors (seed 0), from the xxHash project and python-xxhash.
KNOWN_XXH64 = {
    b"": 0xEF46DB3751D8E999,
    b"a": 0xD24EC4F1A98C6E5B,
    b"abc": 0x44BC2CF5AD770999,
    b"Nobody inspects the spammish repetition": 0xFBCEA83C8A378BF1,
}

# Frozen ids (also computed with the pure-Python reference). If one of these
# changes, every stored embedding table is invalidated: fix the code, not the test.
FROZEN_IDS = {
    ("C1", "68fd1e64"): 6601481875315734487,
    ("C1", "15706"): -4995068693209626950,
    ("C1", ""): 3861981521770203694,
    ("site_id", "1fbe01fe"): 5565301987838184032,
    ("hour", "00"): -2143089703490700037,
}


@pytest.mark.parametrize(("data", "expected"), KNOWN_XXH64.items())
def test_xxh64_matches_published_vectors(data: bytes, expected: int) -> None:
    assert xxh64(data) == expected


@pytest.mark.parametrize(("feature", "value"), FROZEN_IDS)
def test_feature_ids_are_frozen(feature: str, value: str) -> None:
    expected = FROZEN_IDS[(feature, value)]
    assert hash_bytes(value, feature_seed(feature)) == expected
    assert hash_feature(pa.array([value.encode()], pa.binary()), feature)[0] == expected


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200), seed=st.integers(0, 2**64 - 1))
def test_xxh64_matches_reference_for_any_bytes_and_seed(data: bytes, seed: int) -> None:
    assert xxh64(data, seed) == xxh64_reference(data, seed)


def test_array_hash_equals_scalar_hash_for_every_length() -> None:
    # Lengths 0..70 cover the 32-byte stripe loop, 8- and 4-byte tails and single bytes.
    values = [bytes(range(n)) for n in range(71)]
    seed = feature_seed("f")
    ids = hash_array(pa.array(values, pa.binary()), seed)
    assert ids.dtype == np.int64
    assert ids.tolist() == [hash_bytes(v, seed) for v in values]


def test_integer_column_hashes_like_its_text() -> None:
    ints = [15706, 0, -1, 2**63 - 1, -(2**63), 7]
    seed = feature_seed("C14")
    from_text = hash_array(pa.array([str(i) for i in ints]), seed)
    for kind in (pa.int64(),):
        assert hash_array(pa.array(ints, kind), seed).tolist() == from_text.tolist()
    small = [1005, 0, 7]
    for kind in (pa.int16(), pa.int32(), pa.uint32(), pa.uint64()):
        assert (
            hash_array(pa.array(small, kind), seed).tolist()
            == hash_array(pa.array([str(i) for i in small]), seed).tolist()
        )
    assert hash_array(pa.array([2**64 - 1], pa.uint64()), seed)[0] == hash_bytes(
        "18446744073709551615", seed
    )
    assert hash_bytes(15706, seed) == from_text[0]


def test_missing_values_get_the_features_missing_id() -> None:
    seed = feature_seed("C3")
    ids = hash_array(pa.array(["", None, "x"]), seed)
    assert ids[0] == ids[1] == missing_id("C3") == hash_bytes(b"", seed)
    assert ids[2] != ids[0]
    int_ids = hash_array(pa.array([None, 3], pa.int64()), seed)
    assert int_ids[0] == missing_id("C3")
    assert missing_id("C3") != missing_id("C4")  # per feature


def test_features_get_independent_ids_for_the_same_value() -> None:
    values = pa.array(["a", "b"])
    assert not set(hash_feature(values, "C1")) & set(hash_feature(values, "C2"))


def test_string_types_slices_and_chunks_agree() -> None:
    values = ["x", "", "yy", "zzz" * 20, None, "Ünïcödé"]
    seed = feature_seed("f")
    expected = hash_array(pa.array(values, pa.string()), seed)
    for kind in (pa.binary(), pa.large_string(), pa.large_binary(), pa.string_view()):
        assert hash_array(pa.array(values, kind), seed).tolist() == expected.tolist()
    sliced = pa.array(values, pa.string()).slice(2, 3)
    assert hash_array(sliced, seed).tolist() == expected[2:5].tolist()
    chunked = pa.chunked_array([values[:2], values[2:]], pa.string())
    assert hash_array(chunked, seed).tolist() == expected.tolist()
    dictionary = pa.array(values, pa.string()).dictionary_encode()
    assert hash_array(dictionary, seed).tolist() == expected.tolist()


def test_invalid_utf8_is_hashed_as_bytes() -> None:
    seed = feature_seed("f")
    ids = hash_array(pa.array([b"\xff\xfe", b"\xff"], pa.binary()), seed)
    assert ids.tolist() == [hash_bytes(b"\xff\xfe", seed), hash_bytes(b"\xff", seed)]


def test_sliced_nullable_columns_hash_like_their_python_values() -> None:
    # Null slots are read from the validity bitmap at the slice's bit offset.
    seed = feature_seed("f")
    raw: list[str | None] = [None if i % 3 == 0 else str(i) for i in range(40)]
    expected = [hash_bytes((v or "").encode(), seed) for v in raw]
    ints = pa.array([None if v is None else int(v) for v in raw], pa.int64())
    words = pa.array(raw, pa.string()).dictionary_encode()
    for column in (ints, words, pa.array(raw, pa.string())):
        for start, length in ((0, 40), (5, 20), (11, 29)):
            ids = hash_array(column.slice(start, length), seed)
            assert ids.tolist() == expected[start : start + length]


def test_dictionary_null_slots_and_null_entries_get_the_missing_id() -> None:
    seed = feature_seed("f")
    column = pa.DictionaryArray.from_arrays(
        pa.array([0, None, 2, 1, 0], pa.int32()), pa.array([b"a", b"", None])
    )
    a, gone = hash_bytes(b"a", seed), hash_bytes(b"", seed)
    assert hash_array(column, seed).tolist() == [a, gone, gone, gone, a]
    empty = pa.DictionaryArray.from_arrays(
        pa.array([None, None], pa.int32()), pa.array([], pa.binary())
    )
    assert hash_array(empty, seed).tolist() == [gone, gone]


def test_ids_written_into_a_strided_column() -> None:
    #   ids (R=4, F=2), feature 1 written in place; column 0 untouched
    seed = feature_seed("f")
    ids = np.zeros((4, 2), dtype=np.int64)
    column = pa.array(["x", None, "y", "x"]).dictionary_encode()
    assert hash_array(column, seed, out=ids[:, 1]) is not None
    assert ids[:, 1].tolist() == hash_array(column, seed).tolist()
    assert ids[:, 0].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="out"):
        hash_array(column, seed, out=ids[:3, 1])
