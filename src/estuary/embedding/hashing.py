"""64-bit mixing shared by the hash index, the initialisers and shard routing.

Everything here is a pure function of its inputs (no process-level salt such as
Python's ``hash``), so ids land in the same bucket, shard and initial row in every
process and on every run.
"""

from __future__ import annotations

import hashlib

import numpy as np
from numba import njit

from estuary.embedding.types import Int64Array

# splitmix64 constants (Steele, Lea & Flood 2014; the finalizer is Stafford's Mix13).
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
# Shard routing must not reuse the index's probe hash: with 2^k shards every id in
# a shard would share the low k bits of its probe hash and crowd a 1/2^k slice of
# the shard's buckets. XOR-ing a salt before mixing gives an independent hash.
_ROUTE_SALT = np.uint64(0x5851F42D4C957F2D)
# Server routing (which parameter-server process owns an id) is independent of the
# shard routing inside a process: with one salt, every id of server p would land in
# the same shard of that server whenever the counts share a factor.
SERVER_SALT = 0x2545F4914F6CDD1D
_INV_2_53 = 1.0 / 9007199254740992.0  # 2**-53


@njit(cache=True, nogil=True, inline="always")
def mix64(x: np.uint64) -> np.uint64:
    """splitmix64 finalizer: a bijection on uint64 with full avalanche."""
    z = (x ^ (x >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True, inline="always")
def id_hash(key: np.int64) -> np.uint64:
    """Hash of a raw int64 id (every bit pattern allowed, negatives included)."""
    return mix64(np.uint64(key))


@njit(cache=True, nogil=True, inline="always")
def unit_float(seed: np.uint64, key: np.int64, counter: np.uint64) -> float:
    """A uniform double in [0, 1) that depends only on (seed, key, counter).

    Counter-based: the value for one id never depends on which other ids were
    drawn before it, so initial rows and admission coin flips are independent
    of batch order and shard count.
    """
    # Casts keep numba in uint64 arithmetic (int64 op uint64 would promote to float).
    base = mix64(np.uint64(key) ^ np.uint64(seed))
    z = mix64(base + (np.uint64(counter) + np.uint64(1)) * GOLDEN)
    return np.float64(z >> _S11) * _INV_2_53


@njit(cache=True, nogil=True)
def _group_by_part(part: Int64Array, order: Int64Array, offsets: Int64Array) -> None:
    # Counting sort of positions by ``part``: ``offsets`` (P + 1,) zeros in, the
    # part boundaries out; ``order`` the positions, part 0's first, stable.
    for i in range(part.size):
        offsets[part[i] + 1] += 1
    for k in range(offsets.size - 1):
        offsets[k + 1] += offsets[k]
    cursor = offsets[:-1].copy()
    for i in range(part.size):
        p = part[i]
        order[cursor[p]] = i
        cursor[p] += 1


@njit(cache=True, nogil=True)
def _route_kernel(
    ids: Int64Array, n_shards: int, salt: np.uint64, order: Int64Array, offsets: Int64Array
) -> None:
    # Counting sort by shard: two passes over ids, no Python per id.
    shard = np.empty(ids.size, np.int64)
    n_u = np.uint64(n_shards)
    for i in range(ids.size):
        shard[i] = np.int64(mix64(np.uint64(ids[i]) ^ salt) % n_u)
    _group_by_part(shard, order, offsets)


@njit(cache=True, nogil=True)
def _shard_of_kernel(ids: Int64Array, n_shards: int, salt: np.uint64, out: Int64Array) -> None:
    n_u = np.uint64(n_shards)
    for i in range(ids.size):
        out[i] = np.int64(mix64(np.uint64(ids[i]) ^ salt) % n_u)


def route(
    ids: Int64Array, n_shards: int, *, salt: int | None = None
) -> tuple[Int64Array, Int64Array]:
    """Group ids by shard (stable within a shard).

    Args:
        ids: int64 (N,).
        n_shards: number of shards S (>= 1).
        salt: another independent routing (``SERVER_SALT``: parameter-server
            processes); default: the shards of a table.

    Returns:
        ``order`` int64 (N,): positions into ``ids``, shard 0's first;
        ``offsets`` int64 (S + 1,): shard ``s`` owns ``order[offsets[s]:offsets[s+1]]``.
    """
    order = np.empty(ids.size, np.int64)
    offsets = np.zeros(n_shards + 1, np.int64)
    _route_kernel(ids, n_shards, _salt(salt), order, offsets)
    return order, offsets


def shard_of(ids: Int64Array, n_shards: int, *, salt: int | None = None) -> Int64Array:
    """The shard (0..S-1) that owns each id, int64 (N,) (``salt``: as ``route``)."""
    out = np.empty(ids.size, np.int64)
    _shard_of_kernel(ids, n_shards, _salt(salt), out)
    return out


@njit(cache=True, nogil=True)
def _route_owned_kernel(
    ids: Int64Array,
    owners: Int64Array,
    salt: np.uint64,
    order: Int64Array,
    offsets: Int64Array,
) -> None:
    # As _route_kernel, the part of an id being owners[slot] of its slot.
    part = np.empty(ids.size, np.int64)
    n_u = np.uint64(owners.size)
    for i in range(ids.size):
        part[i] = owners[np.int64(mix64(np.uint64(ids[i]) ^ salt) % n_u)]
    _group_by_part(part, order, offsets)


def route_owned(
    ids: Int64Array, owners: Int64Array, n_parts: int, *, salt: int
) -> tuple[Int64Array, Int64Array]:
    """Group ids by the owner of their slot: slot ``splitmix64(id ^ salt) mod S``
    (S = ``owners.size``), part ``owners[slot]`` (each in [0, ``n_parts``)).

    Returns ``order`` and ``offsets`` as ``route`` (``n_parts + 1`` offsets)."""
    order = np.empty(ids.size, np.int64)
    offsets = np.zeros(n_parts + 1, np.int64)
    _route_owned_kernel(ids, owners, np.uint64(salt), order, offsets)
    return order, offsets


def _salt(salt: int | None) -> np.uint64:
    return _ROUTE_SALT if salt is None else np.uint64(salt)


def table_seed(seed: int, name: str) -> int:
    """A 64-bit seed for one table from the job seed and the table name.

    Uses blake2b rather than ``hash(name)``, which Python salts per process.
    Returned as a non-negative Python int < 2**64 (pass to kernels as uint64).
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def as_ids(ids: object) -> Int64Array:
    """``ids`` as a contiguous int64 (N,) array (no copy when it already is one)."""
    arr = np.ascontiguousarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    return arr
