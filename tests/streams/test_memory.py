"""The in-process reference backend passes the conformance suite."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from estuary.testing.streams import StreamConformance


@dataclass
class MemoryBroker:
    """A private namespace of the in-process broker (nothing to kill)."""

    url: str

    def kill(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError


class TestMemoryConformance(StreamConformance):
    kind = "memory"
    target_field = "key"
    restartable = False

    @pytest.fixture
    def broker(self) -> MemoryBroker:
        return MemoryBroker(f"memory://{uuid.uuid4().hex[:8]}")

    @pytest.fixture
    def fresh_broker(self, broker: MemoryBroker) -> MemoryBroker:
        return broker
