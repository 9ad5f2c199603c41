"""How a slot map's ``members`` name the job's servers after a split or merge
(``PSClient.member``, ``member_identity``, ``connect_member``): by address and
key over sockets, by actor name on the Ray actor plane, and a clear error when
a client of one plane is handed a server of the other."""

from __future__ import annotations

import pytest

from estuary.ps import PSClient, ShardedPSClient
from estuary.ps.client import connect_member, member_identity
from estuary.ps.types import PSError


def test_a_socket_member_is_its_address_whether_a_tuple_or_a_json_list() -> None:
    client = PSClient(("127.0.0.1", 4000), b"\x01\x02", timeout_s=5)
    member = client.member()
    assert member == {"address": ("127.0.0.1", 4000), "authkey": "0102"}
    # Through a JSON header the tuple comes back as a list: the same server.
    assert member_identity({"address": ["127.0.0.1", 4000], "authkey": "0102"}) == client.identity
    assert member_identity({"address": ["127.0.0.1", 4001]}) != client.identity
    joined = connect_member({"address": ["127.0.0.1", 4001], "authkey": "0a"}, 7.0)
    assert joined.address == ("127.0.0.1", 4001) and joined.authkey == b"\n"
    assert joined.timeout_s == 7.0


def test_an_actor_member_is_its_actor_not_its_address() -> None:
    actor = {"address": ["10.0.0.1", 4000], "authkey": "", "actor": "ps-1", "namespace": "n"}
    assert member_identity(actor) == ("actor", "n", "ps-1")
    assert member_identity(actor) != member_identity({"address": ["10.0.0.1", 4000]})
    assert member_identity({**actor, "namespace": "other"}) != member_identity(actor)


def test_a_socket_client_handed_an_actor_server_says_so() -> None:
    actor = {"address": ["10.0.0.1", 4000], "authkey": "", "actor": "ps-1", "namespace": "n"}
    with pytest.raises(PSError, match="'ps-1' joined as a Ray actor"):
        connect_member(actor, 5.0)
    sharded = ShardedPSClient([PSClient(("127.0.0.1", 4000), b"k", timeout_s=5)])
    with pytest.raises(PSError, match="joined as a Ray actor"):
        sharded._set_members([actor], ())


def test_a_client_without_a_key_cannot_name_its_server() -> None:
    with pytest.raises(PSError, match="no socket address and key"):
        PSClient(("127.0.0.1", 4000), b"", timeout_s=5).member()


def test_known_servers_are_kept_and_a_joined_one_connected_by_the_connect_hook() -> None:
    first = PSClient(("127.0.0.1", 4000), b"k", timeout_s=5)
    made: list[tuple[str, float]] = []

    def connect(member: object, timeout_s: float) -> PSClient:
        assert isinstance(member, dict)
        made.append((member["address"][0], timeout_s))
        return PSClient(tuple(member["address"]), b"j", timeout_s=timeout_s)  # type: ignore[arg-type]

    sharded = ShardedPSClient([first], connect=connect)
    members = [first.member(), {"address": ["127.0.0.2", 4001], "authkey": "6a"}]
    assert sharded._set_members(members, ()) == []
    assert sharded.clients[0] is first and sharded.servers == 2
    assert made == [("127.0.0.2", 5)]
