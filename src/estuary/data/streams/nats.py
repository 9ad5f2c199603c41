"""``nats``: NATS JetStream, through nats-py (``pip install 'estuary[streams]'``).

nats-py is asynchronous; each connector or publisher runs its client on a
private event loop thread (``_Loop``) and exposes a blocking API, so callers
need no asyncio.

Offsets are JetStream **stream sequences** (int). Reading uses an ephemeral
pull consumer without acks (``AckPolicy.NONE``) that starts at *our* position
(``BY_START_SEQUENCE``, position + 1); the broker keeps no progress for us.
Whatever goes wrong (a fetch that fails or times out mid-way, a reconnect, a
server restart that dropped the consumer), the consumer is thrown away and
recreated from our position; messages at or before the position are never
returned again, so nothing is lost or repeated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import re
import threading
import time
import warnings
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from estuary.config.streams import NatsSection, StartPosition, StreamSourceSpec
from estuary.data.errors import DataWarning
from estuary.data.streams._retry import Outage
from estuary.data.streams.types import Offset, StreamError, StreamMessage

__all__ = ["BACKEND", "NatsBackend", "NatsConnector", "NatsPublisher"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_CONNECT_TIMEOUT_S = 10.0  # the first connection waits at most this (and reconnect_timeout_s)
_CALL_MARGIN_S = 10.0  # extra wait on the loop thread beyond a call's own timeout
_CONSUMER_IDLE_S = 300.0  # the server deletes our consumer after this long unused
_MIN_FETCH_S = 0.01  # nats-py refuses a zero fetch timeout
# Errors after which we rebuild the consumer from our position and retry.
_RETRYABLE: tuple[type[BaseException], ...] = (
    nats.errors.Error,
    asyncio.TimeoutError,
    concurrent.futures.TimeoutError,
    ConnectionError,
    OSError,
)


class _Loop:
    """An asyncio event loop on a daemon thread; ``run`` blocks the caller."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coroutine`` on the loop; blocks this thread until it is done."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)  # sync point: waits for the loop thread
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


async def _connect(
    url: str, what: str, timeout_s: float = _CONNECT_TIMEOUT_S, on_reconnect: Any = None
) -> Client:
    async def on_error(error: Exception) -> None:
        logger.debug("%s: %s", what, error)  # the connector retries; nothing to do here

    async def on_disconnect() -> None:
        logger.info("%s: disconnected; reconnecting", what)

    async def on_reconnected() -> None:
        logger.info("%s: reconnected", what)
        if on_reconnect is not None:
            on_reconnect()

    connect = nats.connect(
        url,
        name="estuary",
        allow_reconnect=True,
        max_reconnect_attempts=-1,  # we decide when to give up (reconnect_timeout_s)
        reconnect_time_wait=0.1,
        connect_timeout=2,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnected,
    )
    try:
        return await asyncio.wait_for(connect, timeout_s)
    except (TimeoutError, nats.errors.Error, OSError) as e:
        raise StreamError(f"{what}: cannot connect within {timeout_s:g} s: {e!r}") from e


def _parse_offset(value: Offset) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a JetStream stream sequence, got {value!r}")
    number = int(value) if isinstance(value, int) or value.isdigit() else -1
    if number < 0:
        raise ValueError(f"expected a JetStream stream sequence (int >= 0), got {value!r}")
    return number


class NatsConnector:
    """Reads one subject of a JetStream stream (see ``StreamConnector``)."""

    kind = "nats"

    def __init__(self, spec: StreamSourceSpec) -> None:
        section: NatsSection = spec.section
        self.spec = spec
        self.subject = section.subject
        self.what = f"nats {spec.url} subject {section.subject!r}"
        self._loop: _Loop | None = None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._stream = section.stream or ""
        self._sub: JetStreamContext.PullSubscription | None = None
        self._broken = False  # a call failed: rebuild the consumer before the next fetch
        self._sub_generation = -1  # the connection generation the consumer was made on
        self._generation = 0  # +1 on every reconnect (set on the loop thread)
        self._last_fetch = 0.0
        self._cursor = 0  # stream sequence of the last message returned
        # Messages the consumer delivered past a read's max_messages, handed out
        # first by the next reads (nats-py's fetch hands over every message
        # already queued for the subscription, which a fetch that timed out can
        # leave there beyond the batch asked for).
        self._carry: list[StreamMessage] = []
        self._committed: int | None = None
        self._outage = Outage(self.what, spec.reconnect_timeout_s)

    # -- lifecycle ---------------------------------------------------------------------

    def open(self, start: StartPosition) -> None:
        if self._loop is not None:
            raise StreamError(f"{self.what}: already open")
        self._loop = _Loop(f"estuary-nats-{self.subject}")
        try:
            connect_s = min(self.spec.reconnect_timeout_s, _CONNECT_TIMEOUT_S)
            self._nc = self._run(
                _connect(self.spec.url, self.what, connect_s, self._on_reconnect), connect_s
            )
            self._js = self._nc.jetstream()
            self._cursor, first_seq = self._run(self._resolve(start))
            if start.kind == "after" and self._cursor + 1 < first_seq:
                warnings.warn(
                    f"{self.what}: messages {self._cursor + 1}..{first_seq - 1} were removed "
                    "by the stream's retention before they were read",
                    DataWarning,
                    stacklevel=2,
                )
        except nats.errors.Error as e:  # e.g. the subject is not in the named stream
            self.close()
            raise StreamError(f"{self.what}: cannot open: {e}") from e
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if self._nc is not None and not self._nc.is_closed:
                self._run(self._shutdown(), timeout_s=5)
        except Exception as e:  # best effort: the server may be gone
            logger.debug("%s: close: %s", self.what, e)
        finally:
            self._loop.close()
            self._loop, self._nc, self._js, self._sub = None, None, None, None
            self._carry = []

    # -- reading -----------------------------------------------------------------------

    def read(self, max_messages: int, timeout_s: float) -> list[StreamMessage]:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        if self._carry:
            return self._hand_out(self._carry, max_messages)
        deadline = time.monotonic() + timeout_s
        while self._outage.pause(deadline):  # False: still down at the deadline
            wait_s = max(deadline - time.monotonic(), _MIN_FETCH_S)
            try:
                raw = self._run(self._fetch(max_messages, wait_s), timeout_s=wait_s)
            except _RETRYABLE as e:
                # Unknown how far the consumer got: rebuild it from our position.
                self._broken = True
                self._outage.failed(e)  # raises once down too long
                continue
            self._outage.ok()
            return self._accept(raw, max_messages)
        return []

    def position(self) -> Offset:
        return self._cursor

    def commit(self, position: Offset) -> None:
        offset = self._offset(position)
        if offset > self._cursor:
            raise StreamError(
                f"{self.what}: cannot commit offset {offset}: read up to {self._cursor}"
            )
        self._committed = offset

    def committed(self) -> Offset | None:
        return self._committed

    # -- internals ---------------------------------------------------------------------

    def _accept(self, raw: list[tuple[int, bytes, int]], max_messages: int) -> list[StreamMessage]:
        """At most ``max_messages`` messages after our position, in order; the rest
        of ``raw`` past our position is carried to the next reads."""
        fresh: list[StreamMessage] = []
        last = self._cursor
        for seq, payload, stamp_ms in raw:
            if seq <= last:
                continue  # already returned (a consumer rebuilt from an older view)
            fresh.append(StreamMessage(seq, payload, stamp_ms))
            last = seq
        return self._hand_out(fresh, max_messages)

    def _hand_out(self, messages: list[StreamMessage], max_messages: int) -> list[StreamMessage]:
        """The first ``max_messages`` of ``messages``; the rest is carried. The
        position moves here, on the caller's thread, only for messages handed
        out. No fetch runs while messages are carried, so the consumer is never
        rebuilt (from the position) with messages past it in hand."""
        out, self._carry = messages[:max_messages], messages[max_messages:]
        if out:
            self._cursor = int(out[-1].offset)
        return out

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 0.0) -> T:
        assert self._loop is not None, "not open"
        return self._loop.run(coroutine, timeout_s + _CALL_MARGIN_S)

    def _on_reconnect(self) -> None:
        self._generation += 1

    def _offset(self, value: Offset) -> int:
        try:
            return _parse_offset(value)
        except ValueError as e:
            raise StreamError(f"{self.what}: {e}") from None

    async def _resolve(self, start: StartPosition) -> tuple[int, int]:
        """(the position just before ``start``, the stream's first sequence); also
        creates the first consumer."""
        assert self._js is not None
        try:
            if not self._stream:
                self._stream = await self._js.find_stream_name_by_subject(self.subject)
            info = await self._js.stream_info(self._stream)
        except nats.js.errors.NotFoundError:
            problem = (
                f"stream {self._stream!r} not found on the server"
                if self._stream
                else "no JetStream stream captures the subject (create one; estuary replay does)"
            )
            raise StreamError(f"{self.what}: {problem}") from None
        if start.kind == "after":
            assert start.offset is not None
            return self._offset(start.offset), info.state.first_seq
        # Let the server resolve earliest/latest/time into a sequence, atomically:
        # a fresh consumer reports the sequence before its first message.
        policies = {
            "earliest": ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            "latest": ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
        }
        if start.kind == "timestamp":
            assert start.timestamp_ms is not None
            moment = datetime.fromtimestamp(start.timestamp_ms / 1000, UTC)
            policies["timestamp"] = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=moment
            )
        self._sub = await self._subscribe(policies[start.kind])
        consumer = await self._sub.consumer_info()
        assert consumer.delivered is not None
        return int(consumer.delivered.stream_seq or 0), info.state.first_seq

    async def _subscribe(self, config: ConsumerConfig) -> JetStreamContext.PullSubscription:
        assert self._js is not None
        config.ack_policy = AckPolicy.NONE  # progress is ours, not the broker's
        config.inactive_threshold = _CONSUMER_IDLE_S
        config.mem_storage = True
        config.filter_subject = self.subject
        sub = await self._js.pull_subscribe(
            self.subject, durable=None, stream=self._stream, config=config
        )
        self._sub_generation = self._generation
        self._last_fetch = time.monotonic()
        return sub

    async def _fetch(self, max_messages: int, timeout_s: float) -> list[tuple[int, bytes, int]]:
        """Up to ``max_messages`` as (stream sequence, payload, timestamp ms)."""
        assert self._nc is not None
        if not self._nc.is_connected:  # reconnecting: API calls would wait out their timeout
            raise ConnectionError("not connected (reconnecting)")
        stale = time.monotonic() - self._last_fetch > _CONSUMER_IDLE_S / 2
        if self._sub is None or self._broken or self._sub_generation != self._generation or stale:
            await self._drop_subscription()
            self._broken = False
            self._sub = await self._subscribe(
                ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._cursor + 1
                )
            )
        self._last_fetch = time.monotonic()
        try:
            msgs = await self._sub.fetch(max_messages, timeout=timeout_s)
        except TimeoutError:
            # nats-py's own TimeoutError, or the builtin one (asyncio's) when the
            # server's reply to its first pull request left no time for a second
            # (none is left outstanding then): both mean an idle stream, if connected.
            if not self._nc.is_connected:
                raise  # not an idle stream: the server is away
            return []
        return [_triple(m) for m in msgs]

    async def _drop_subscription(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        try:
            await sub.unsubscribe()  # the server deletes the idle consumer by itself
        except Exception as e:
            logger.debug("%s: unsubscribe: %s", self.what, e)

    async def _shutdown(self) -> None:
        assert self._nc is not None
        if self._sub is not None and self._js is not None and self._nc.is_connected:
            try:
                name = (await self._sub.consumer_info()).name
                await self._js.delete_consumer(self._stream, name)
            except Exception as e:
                logger.debug("%s: delete consumer: %s", self.what, e)
        await self._nc.close()


def _triple(msg: Msg) -> tuple[int, bytes, int]:
    meta = msg.metadata
    return int(meta.sequence.stream), msg.data, int(meta.timestamp.timestamp() * 1000)


_STREAM_NAME = re.compile(r"[^A-Za-z0-9_-]")


class NatsPublisher:
    """Publishes to one subject with JetStream acks, in order.

    When no stream captures the subject, one is created, named after it
    (``clicks.eu`` -> ``clicks_eu``), file-backed with default limits.
    """

    def __init__(self, url: str, subject: str, *, timeout_s: float = 30.0) -> None:
        self.subject = subject
        self.what = f"nats {url} subject {subject!r}"
        self.timeout_s = timeout_s
        self.stream = ""
        self._loop = _Loop(f"estuary-nats-pub-{subject}")
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()
        try:
            self._nc = self._loop.run(_connect(url, self.what), _CONNECT_TIMEOUT_S + _CALL_MARGIN_S)
            self._loop.run(self._setup(), timeout_s)
        except BaseException:
            self._loop.close()
            raise

    async def _setup(self) -> None:
        js = self._nc.jetstream()
        try:
            self.stream = await js.find_stream_name_by_subject(self.subject)
        except nats.js.errors.NotFoundError:
            self.stream = _STREAM_NAME.sub("_", self.subject)
            await js.add_stream(StreamConfig(name=self.stream, subjects=[self.subject]))
            logger.info("%s: created stream %r", self.what, self.stream)
        self._inbox = self._nc.new_inbox()
        await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_ack)

    async def _on_ack(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject.rpartition(".")[2], None)
        if future is not None and not future.done():
            future.set_result(msg)

    def publish(self, payloads: Sequence[bytes]) -> list[Offset]:
        if not payloads:
            return []
        return self._loop.run(self._publish(payloads), self.timeout_s + _CALL_MARGIN_S)

    async def _publish(self, payloads: Sequence[bytes]) -> list[Offset]:
        # Send all, then wait for all acks: one round trip per batch, order kept
        # because one connection delivers publishes in order.
        loop = asyncio.get_running_loop()
        futures = []
        for payload in payloads:
            token = str(next(self._tokens))
            self._pending[token] = future = loop.create_future()
            futures.append(future)
            await self._nc.publish(self.subject, payload, reply=f"{self._inbox}.{token}")
        try:
            acks = await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s)
        except TimeoutError:
            raise StreamError(
                f"{self.what}: no JetStream ack within {self.timeout_s:g} s"
            ) from None
        finally:
            for future in futures:
                future.cancel()
        return [self._seq(ack) for ack in acks]

    def _seq(self, ack: Msg) -> int:
        status = (ack.headers or {}).get("Status")
        if status is not None:
            raise StreamError(f"{self.what}: publish failed with status {status}")
        try:
            reply = json.loads(ack.data)
        except ValueError:
            raise StreamError(f"{self.what}: unreadable JetStream ack {ack.data!r}") from None
        if "error" in reply:
            raise StreamError(f"{self.what}: publish failed: {reply['error']}")
        return int(reply["seq"])

    def close(self) -> None:
        try:
            if not self._nc.is_closed:
                self._loop.run(self._nc.close(), 5 + _CALL_MARGIN_S)
        except Exception as e:
            logger.debug("%s: close: %s", self.what, e)
        finally:
            self._loop.close()


class NatsBackend:
    """``kind: nats``."""

    name = "nats"

    def connector(self, spec: StreamSourceSpec) -> NatsConnector:
        return NatsConnector(spec)

    def publisher(self, url: str, target: str) -> NatsPublisher:
        return NatsPublisher(url, target)

    def parse_offset(self, value: Offset) -> Offset:
        return _parse_offset(value)

    def offset_key(self, value: Offset) -> tuple[int, ...]:
        return (_parse_offset(value),)


BACKEND = NatsBackend()
