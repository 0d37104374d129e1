"""The replica's link to the shared state store: Redis, through coredis (``EPD_STATE_URL``).

One ``StateLink`` per proxy process, started in the proxy's background nursery. It owns the
connection and everything that crosses it:

- **the roster**: it writes this replica's registrations (``ReplicatedRoster.take_pending``)
  and announces them on the roster channel; it applies the others' announcements as they come
  (the fast path) and reads the whole roster every ``EPD_STATE_RESYNC_INTERVAL`` (pub/sub loses
  what is published while a subscriber is disconnected, and TTL expiries are not announced);
- **expiry**: an instance's entry expires ``EPD_INSTANCE_TTL`` after its last registration
  (``EPD_MORIIO_TTL`` after its last MoRIIO heartbeat), and every replica that sees an
  HTTP-registered instance live refreshes it, so an instance is forgotten only when no replica
  routes to it and it has stopped registering, as without a store;
- **the load signal**: every ``EPD_STATE_LOAD_INTERVAL`` it publishes this replica's in-flight
  counts (an expiring hash: a dead replica's counts vanish by themselves, there is no shared
  decrement to leak or drift) and reads the others' into ``Loads.remote``;
- **the global cursor** (opt-in): ``take`` is one ``INCRBY``, with a short timeout, on a lean
  connection of its own (``_replicas/cursor_link``).

Why clients do not notice when Redis misbehaves: no request waits for it (the global cursor
falls back to the local one, counted), a replica keeps routing on its last view while the link
is down (nothing expires locally), and every (re)connect first writes this replica's pending
changes, then writes back every record it knows that the store lacks (unless the instance
unregistered meanwhile: its tombstone says so). A store that restarted empty therefore gets the
fleet's roster back from the replicas, and nobody drops an instance it was routing to.

Errors (a refused connection, a timeout, a dropped link) end the session; it reconnects with
capped, jittered exponential backoff. Malformed entries are skipped and counted, and so are
keys of the wrong type (written by hand: an index that is not a set, a sorted set of replicas
that is a string...): every command that may meet one reads its error as that key's, never as
the link's, so one bad key cannot keep a replica reconnecting forever.
"""

from __future__ import annotations

import logging
import random
import secrets
import ssl
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import coredis
import trio
from coredis.exceptions import WrongTypeError
from coredis.retry import NoRetryPolicy

from .._core.config import Settings
from .._core.roster import Member
from .._core.shared_state import (
    MalformedEntry,
    Record,
    StateKeys,
    decode_announcement,
    decode_record,
    encode_announcement,
    encode_record,
    load_expiry,
    load_fields,
    sum_loads,
)
from .._core.state_url import StateURL
from .._core.urls import redact_url
from .._observe.metrics import ProxyMetrics
from .._state.loads import Loads
from .cursor_link import CommandRefused, CursorLink, LinkBroken
from .roster import Pending, ReplicatedRoster
from .tls import tls_context

log = logging.getLogger("epd_trio")

#: The "stage" under which tenants' in-flight counts travel in the load hashes.
TENANT_LOAD = "tenant"

#: Reconnect backoff: first wait, cap (seconds); each wait is jittered by up to +-25 %.
BACKOFF_FIRST, BACKOFF_CAP = 0.1, 5.0
#: Malformed entries remembered (each is counted once, not at every read).
MALFORMED_MEMORY = 1024
#: What a malformed entry is remembered by when it is a key of the wrong type.
WRONG_TYPE = b"wrong type"

#: Write an instance's record back unless the store has it (then index it anyway: an index entry
#: pruned in a race comes back), or it unregistered (its tombstone). Returns -1 when the index
#: is not a set (the record is written all the same). KEYS: instance, tombstone, index.
#: ARGV: record, TTL in ms, URL.
_WRITE_BACK = """
if redis.call('exists', KEYS[2]) == 1 then return 0 end
local indexed = redis.pcall('sadd', KEYS[3], ARGV[3])
local written = 0
if redis.call('exists', KEYS[1]) == 0 then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  written = 1
end
if type(indexed) == 'table' and indexed.err then return -1 end
return written
"""
#: Drop index entries whose instance key expired, unless it came back meanwhile (a registration
#: between the read and this call); returns the URLs whose key holds another type than a string
#: (written by hand: left alone, and counted). KEYS: the index. ARGV: the key prefix, then URLs.
_PRUNE_INDEX = """
local wrong = {}
for i = 2, #ARGV do
  local kind = redis.call('type', ARGV[1] .. ARGV[i])['ok']
  if kind == 'none' then
    redis.call('srem', KEYS[1], ARGV[i])
  elseif kind ~= 'string' then
    wrong[#wrong + 1] = ARGV[i]
  end
end
return wrong
"""


#: One round trip per load interval: publish this replica's counts (an expiring hash, and its
#: name in the sorted set of live replicas), drop replicas gone for long, and return every
#: other live replica's counts, after a flag: 1 when another process wrote this replica's
#: owner key since the last round (two processes under one replica id); then the keys skipped
#: because they hold another type (the replicas' set, another replica's hash: written by
#: hand). The sorted set is scored on Redis's own clock (TIME), so replicas whose clocks
#: disagree still agree on who is live. KEYS: this replica's hash, the replicas' set, this
#: replica's owner key. ARGV: replica id, expiry (ms), the load-hash prefix, this process's
#: token, then field, value...
_LOAD_EXCHANGE = """
local time = redis.call('time')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expiry = tonumber(ARGV[2])
local owner = redis.pcall('get', KEYS[3])
if type(owner) == 'table' then owner = false end
redis.call('set', KEYS[3], ARGV[4], 'PX', expiry)
redis.call('del', KEYS[1])
if #ARGV > 4 then
  redis.call('hset', KEYS[1], unpack(ARGV, 5))
  redis.call('pexpire', KEYS[1], expiry)
end
local out, wrong = {}, {}
local listed = redis.pcall('zadd', KEYS[2], now, ARGV[1])
if type(listed) == 'table' and listed.err then
  wrong[1] = KEYS[2]
else
  redis.call('zremrangebyscore', KEYS[2], '-inf', now - 10 * expiry)
  for _, other in ipairs(redis.call('zrangebyscore', KEYS[2], now - expiry, '+inf')) do
    if other ~= ARGV[1] then
      local fields = redis.pcall('hgetall', ARGV[3] .. other)
      if fields.err then
        wrong[#wrong + 1] = ARGV[3] .. other
      else
        out[#out + 1] = fields
      end
    end
  end
end
local clash = 0
if owner and owner ~= ARGV[4] then clash = 1 end
return {clash, out, wrong}
"""


def redis_client(url: StateURL, timeout: float, name: str,
                 tls: ssl.SSLContext | None = None) -> coredis.Redis[bytes]:
    """A client for ``url``; no retries of its own (the link reconnects, the cursor falls
    back), every call bounded by ``timeout``. ``tls``: the context of a ``rediss://`` URL;
    when not given, ``_state_tls.tls_context(url)`` (the rule of ``CursorLink.open`` too)."""
    common: dict[str, Any] = {"db": url.db, "username": url.username, "password": url.password,
                              "stream_timeout": timeout, "connect_timeout": timeout,
                              "retry_policy": NoRetryPolicy(), "client_name": name}
    if url.scheme == "unix":
        return coredis.Redis(host=None, port=None, unix_socket_path=url.path, **common)
    if url.tls:
        common["ssl_context"] = tls if tls is not None else tls_context(url)
    return coredis.Redis(host=url.host, port=url.port, ssl=url.tls, **common)


class StateLink:
    """This replica's connection to the shared state; see the module docstring."""

    def __init__(
        self, settings: Settings, store: ReplicatedRoster, loads: Loads, metrics: ProxyMetrics,
        *, replica_id: str, live: Callable[[Member], bool],
    ) -> None:
        assert settings.state_url is not None
        self._url = settings.state_url
        #: One TLS context for both connections (``rediss://``; a bad file is a ConfigError).
        self._tls = tls_context(settings.state_url)
        self._settings = settings
        self._store = store
        self._loads = loads
        self._metrics = metrics
        self._live = live
        self.replica_id = replica_id
        #: This process's mark on its replica id's owner key: another mark there means another
        #: live process uses the same id (``duplicate_id``).
        self._token = secrets.token_hex(8)
        #: Whether another live process uses this replica id (logged at ERROR when found).
        self.duplicate_id = False
        self.keys = StateKeys(settings.state_prefix)
        self._redis: coredis.Redis[bytes] | None = None
        self._cursor: CursorLink | None = None
        #: The tenants' shared buckets' lean connection (``_replicas/limits``), while up.
        self.limits_link: CursorLink | None = None
        #: Replicas alive at the last load exchange, this one included (the share of a
        #: tenant's limit each enforces while the store is gone).
        self.live_replicas = 1
        #: This replica's requests in flight per tenant (fair admission's, set by the app),
        #: published with its loads so that a tenant's ``max_inflight`` holds for the fleet.
        self.tenant_inflight: Callable[[], Mapping[str, int]] = dict
        #: Called after each read of the other replicas' counts (fair admission's dispatch).
        self.on_loads: Callable[[], None] = lambda: None
        self._wake = trio.Event()
        store.on_pending = self._wake_writer
        self._malformed: set[tuple[str, bytes]] = set()
        self._rng = random.Random()
        self._sessions = 0
        self._last_logged: str | None = None
        self._loads_read = trio.Event()
        self._up_changed = trio.Event()
        #: Set once the shared roster has been read (``/ready`` says not ready until then).
        self.roster_loaded = trio.Event()
        #: Why the link is down (None while it is up), for ``/ready`` and ``/instances``.
        self.problem: str | None = "not connected yet"
        #: The global cursors' keys, by ``(model, stage)``, made on first use.
        self._cursor_keys: dict[tuple[str, str], bytes] = {}
        metrics.state_up(False)

    @property
    def up(self) -> bool:
        return self._redis is not None

    def describe(self) -> dict[str, Any]:
        """What ``GET /instances`` says about the link (never the password)."""
        return {"backend": self._url.redacted(), "prefix": self.keys.prefix, "up": self.up,
                "roster_loaded": self._store.loaded, "problem": self.problem,
                "global_cursor": self._settings.global_cursor,
                "duplicate_id": self.duplicate_id}

    async def next_change(self) -> None:
        """Until the link next goes up or down (tests and benchmarks)."""
        await self._up_changed.wait()

    def _changed(self) -> None:
        self._up_changed.set()
        self._up_changed = trio.Event()

    async def next_load_read(self) -> None:
        """Until the others' counts have been read once more (tests and benchmarks)."""
        await self._loads_read.wait()

    def others_inflight(self, tenant: str) -> int:
        """The other live replicas' requests in flight for ``tenant``, as they last published
        them (0 while the store is gone: then each replica counts its own)."""
        return self._loads.remote.get((TENANT_LOAD, (tenant, None)), 0)

    # -- the global cursor (on a request's path) --------------------------------------------------
    async def take(self, model: str, stage: str, n: int) -> int | None:
        """The global cursor's position for ``n`` slots of ``model``'s pool at ``stage`` (its
        value before adding ``n``), or None (then the caller uses its own cursor): the link is
        down, or the store did not answer within ``EPD_GLOBAL_CURSOR_TIMEOUT``."""
        cursor = self._cursor
        if cursor is not None:
            with trio.move_on_after(self._settings.global_cursor_timeout):
                key = self._cursor_keys.get((model, stage))
                if key is None:
                    key = self._cursor_keys[(model, stage)] = \
                        self.keys.cursor(stage, model).encode()
                try:
                    return await cursor.incrby(key, n) - n
                except LinkBroken:  # the session reconnects; this request goes on
                    pass
                except CommandRefused as exc:  # the counter's key holds something else
                    self._count_malformed(key.decode(), WRONG_TYPE, exc)
        self._metrics.global_cursor_fallback(stage)
        return None

    # -- the session loop -------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, serve the link, reconnect with backoff; until cancelled."""
        task_status.started()
        delay = BACKOFF_FIRST
        while True:
            sessions = self._sessions
            try:
                async with redis_client(self._url, self._settings.state_timeout,
                                        f"epd-trio:{self.replica_id}", self._tls) as redis:
                    await self._session(redis)
            except BaseException as exc:  # any failure of the link ends the session
                self._lost(_unless_cancelled(exc))
            if self._sessions != sessions:
                delay = BACKOFF_FIRST  # it was up: the next attempt is a reconnect, not a retry
            await trio.sleep(delay * self._rng.uniform(0.75, 1.25))
            delay = min(BACKOFF_CAP, delay * 2)

    async def _session(self, redis: coredis.Redis[bytes]) -> None:
        with trio.fail_after(self._settings.state_timeout):
            await redis.ping()
        await self._flush(redis)
        await self._write_back(redis, self._store.known_records())
        async with redis.pubsub(channels=[self.keys.channel]) as pubsub, \
                trio.open_nursery() as nursery:
            # Subscribed before the first full read: nothing announced in between is lost.
            await self._resync(redis)
            cursor = None
            if self._settings.global_cursor:
                # A connection of its own, and a lean one (``_replicas/cursor_link``): a burst of
                # requests must not queue behind the link's own calls, nor the reverse.
                with trio.fail_after(self._settings.state_timeout):
                    cursor = await CursorLink.open(self._url, self._tls)
                await nursery.start(cursor.run)
            limits = None
            if any(t.requests_per_minute or t.tokens_per_minute or t.max_inflight
                   for t in self._settings.tenants):
                # The tenants' buckets and places: one script per admission, on a lean link
                # of its own.
                with trio.fail_after(self._settings.state_timeout):
                    limits = await CursorLink.open(self._url, self._tls)
                await nursery.start(limits.run)
            self.roster_loaded.set()
            self._redis, self._cursor, self.problem = redis, cursor, None
            self.limits_link = limits
            self._sessions += 1
            self._metrics.state_up(True)
            self._changed()
            log.info("shared state %s: connected as replica %s (roster loaded)",
                        self._url.redacted(), self.replica_id)
            try:
                nursery.start_soon(self._listen, pubsub)
                nursery.start_soon(self._writer, redis)
                nursery.start_soon(self._resync_loop, redis)
                nursery.start_soon(self._load_loop, redis)
                await trio.sleep_forever()
            finally:
                self._redis = self._cursor = self.limits_link = None

    def _lost(self, exc: BaseException) -> None:
        was_up = self.up or self.problem is None
        self._redis = self._cursor = self.limits_link = None
        self._loads.remote = {}  # the others' counts are unknown now: route on our own
        self._metrics.state_up(False)
        self._changed()
        self.on_loads()  # admission: each replica on its share now
        self.problem = _described(exc)
        if was_up or self.problem != self._last_logged:
            log.warning("shared state %s unreachable (%s); routing on the last view and "
                        "retrying", self._url.redacted(), self.problem)
            self._last_logged = self.problem

    # -- the roster -------------------------------------------------------------------------------
    def _wake_writer(self) -> None:
        self._wake.set()

    def _ttl_ms(self, record: Record) -> int:
        ttl = (self._settings.moriio_ttl if record.member.moriio is not None
               else self._settings.instance_ttl)
        return max(1, int(ttl * 1000))

    async def _writer(self, redis: coredis.Redis[bytes]) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await self._flush(redis)

    async def _flush(self, redis: coredis.Redis[bytes]) -> None:
        """Write and announce every pending change (given back if the write fails)."""
        writes = self._store.take_pending()
        if not writes:
            return
        try:
            with trio.fail_after(self._settings.state_timeout):
                await self._write(redis, writes)
        except BaseException:
            self._store.requeue(writes)
            raise
        self._store.written(writes)

    async def _write(self, redis: coredis.Redis[bytes], writes: Mapping[str, Pending]) -> None:
        keys, me = self.keys, self.replica_id
        tomb_ms = max(1, int(self._settings.instance_ttl * 1000))
        # Errors are awaited per command: an index of the wrong type (written by hand) costs
        # the index entry, not the record, the tombstone or the announcement.
        others, indexing = [], []
        async with redis.pipeline(transaction=False, raise_on_error=False) as pipe:
            for url, write in writes.items():
                if write is None:
                    others.append(pipe.delete([keys.instance(url)]))
                    indexing.append(pipe.srem(keys.index, [url]))
                    others.append(pipe.set(keys.tombstone(url), b"1", px=tomb_ms))
                    others.append(pipe.publish(keys.channel,
                                               encode_announcement("delete", url, me)))
                    continue
                record, quiet = write
                raw = encode_record(record)
                others.append(pipe.set(keys.instance(url), raw, px=self._ttl_ms(record)))
                indexing.append(pipe.sadd(keys.index, [url]))
                others.append(pipe.delete([keys.tombstone(url)]))
                if not quiet:
                    others.append(pipe.publish(keys.channel,
                                               encode_announcement("put", url, me, raw)))
        for request in others:
            await request  # any error here is the link's
        for request in indexing:
            try:
                await request
            except WrongTypeError as exc:
                self._count_malformed(keys.index, WRONG_TYPE, exc)

    async def _write_back(self, redis: coredis.Redis[bytes], records: Iterable[Record]) -> None:
        """Write the ``records`` the store lacks (not those that unregistered meanwhile)."""
        records = list(records)
        if not records:
            return
        keys = self.keys
        with trio.fail_after(self._settings.state_timeout):
            async with redis.pipeline(transaction=False) as pipe:
                written = [pipe.eval(_WRITE_BACK,
                                     [keys.instance(url), keys.tombstone(url), keys.index],
                                     [encode_record(record), self._ttl_ms(record), url])
                           for record in records for url in (record.member.url,)]
        for request in written:
            if await request == -1:
                self._count_malformed(keys.index, WRONG_TYPE, MalformedEntry("not a set"))

    async def _listen(self, pubsub: Any) -> None:
        async for message in pubsub:
            if message.get("type") != "message":
                continue
            try:
                announcement = decode_announcement(message["data"])
            except MalformedEntry as exc:
                self._count_malformed(self.keys.channel, message["data"], exc)
                continue
            if announcement.origin == self.replica_id:
                continue
            if announcement.record is not None:
                self._store.apply_put(announcement.record)
            else:
                self._store.apply_delete(announcement.url)

    async def _resync_loop(self, redis: coredis.Redis[bytes]) -> None:
        while True:
            await trio.sleep(self._settings.state_resync_interval)
            await self._resync(redis)
            await self._keep_alive(redis)

    async def _resync(self, redis: coredis.Redis[bytes]) -> None:
        """Read the whole shared roster; first write everything back if the store lost it."""
        keys = self.keys
        mark = self._store.write_mark()
        with trio.fail_after(self._settings.state_timeout):
            try:
                marker = await redis.get(keys.fleet)
            except WrongTypeError as exc:  # written by hand: there, if unreadable
                self._count_malformed(keys.fleet, WRONG_TYPE, exc)
                marker = WRONG_TYPE
            if marker is None:
                # A store that never held this fleet, or that restarted empty / was flushed.
                await self._write_back(redis, self._store.known_records())
                await redis.set(keys.fleet, secrets.token_hex(8).encode(),
                                condition=coredis.PureToken.NX)
            try:
                members = await redis.smembers(keys.index)
            except WrongTypeError as exc:
                # No index to read: keep this view (announcements still come), and be ready.
                self._count_malformed(keys.index, WRONG_TYPE, exc)
                self._store.keep_view()
                return
            urls = sorted(self._urls(members))
            values = await redis.mget([keys.instance(url) for url in urls]) if urls else ()
            expired = [url for url, raw in zip(urls, values, strict=True) if raw is None]
            if expired:
                wrong = await redis.eval(_PRUNE_INDEX, [keys.index],
                                         [keys.instance(""), *expired])
                for url in wrong or ():
                    self._count_malformed(keys.instance(url.decode()), WRONG_TYPE,
                                          MalformedEntry("not a string"))
        records = []
        for url, raw in zip(urls, values, strict=True):
            if raw is None:
                continue
            try:
                record = decode_record(raw, url=url)
            except MalformedEntry as exc:
                self._count_malformed(keys.instance(url), raw, exc)
                continue
            records.append(record)
        self._store.apply_snapshot(records, mark)

    def _urls(self, members: Iterable[bytes]) -> Iterable[str]:
        """The index's members as URLs; one that is not UTF-8 is skipped and counted."""
        for member in members:
            try:
                yield member.decode()
            except UnicodeDecodeError as exc:
                self._count_malformed(self.keys.index, member, exc)

    async def _keep_alive(self, redis: coredis.Redis[bytes]) -> None:
        """Refresh the entries of the HTTP-registered instances this replica routes to."""
        urls = self._store.live_registered(self._live)
        if not urls:
            return
        ttl_ms = max(1, int(self._settings.instance_ttl * 1000))
        with trio.fail_after(self._settings.state_timeout):
            async with redis.pipeline(transaction=False) as pipe:
                for url in urls:
                    pipe.pexpire(self.keys.instance(url), ttl_ms)

    def _count_malformed(self, where: str, raw: bytes, exc: Exception) -> None:
        """Count and log an entry this version cannot read, once (``raw`` is what it is
        remembered by at ``where``: its bytes, or ``WRONG_TYPE``)."""
        mark = (where, bytes(raw)[:256])
        if mark in self._malformed:
            return
        if len(self._malformed) >= MALFORMED_MEMORY:
            self._malformed.clear()
        self._malformed.add(mark)
        self._metrics.state_malformed()
        log.warning("shared state: skipped a malformed entry at %s (%s)", where, exc)

    # -- the load signal --------------------------------------------------------------------------
    async def _load_loop(self, redis: coredis.Redis[bytes]) -> None:
        interval = self._settings.state_load_interval
        expiry_ms = max(1, int(load_expiry(interval) * 1000))
        keys = [self.keys.load(self.replica_id), self.keys.replicas,
                self.keys.owner(self.replica_id)]
        head = [self.replica_id, expiry_ms, self.keys.load(""), self._token]
        clashes = 0
        while True:
            fields = load_fields(self._loads.table.snapshot())
            fields.update(load_fields((TENANT_LOAD, (tenant, None), n)
                                      for tenant, n in self.tenant_inflight().items()))
            args = [*head, *(x for pair in fields.items() for x in pair)]
            with trio.fail_after(self._settings.state_timeout):
                clash, replies, wrong = await redis.eval(_LOAD_EXCHANGE, keys, args)
            for key in wrong or ():
                self._count_malformed(key.decode(errors="replace"), WRONG_TYPE,
                                      MalformedEntry("not the type expected"))
            # Twice in a row: once may be this replica's previous process, whose key has not
            # expired yet (a restart under a fixed id).
            clashes = clashes + 1 if clash else 0
            if clashes == 2:
                self.duplicate_id = True
                log.error("shared state: replica id %r is in use by another live process too; "
                          "they hide each other's loads and ignore each other's announcements. "
                          "Give each replica its own EPD_REPLICA_ID (or leave it unset)",
                          self.replica_id)
            elif not clash:
                self.duplicate_id = False
            self.live_replicas = 1 + len(replies or ())
            total, bad = sum_loads(_as_mapping(reply) for reply in replies or ())
            for _ in range(bad):
                self._metrics.state_malformed()
            self._loads.remote = total
            self.on_loads()
            self._loads_read.set()
            self._loads_read = trio.Event()
            await trio.sleep(interval)


def _as_mapping(reply: Any) -> Mapping[Any, Any]:
    """An ``HGETALL`` reply from a script: a flat list (RESP2 semantics inside Lua)."""
    if isinstance(reply, Mapping):
        return reply
    items = list(reply)
    return dict(zip(items[::2], items[1::2], strict=False))


def live_member(registry: Any) -> Callable[[Member], bool]:
    """Whether this replica's probes have the member in rotation now (not ``usable``, whose
    panic mode would keep a dead instance alive when its whole stage is down)."""
    def live(member: Member) -> bool:
        return registry.state_for(member.stage, member.instance).live
    return live


def _unless_cancelled(exc: BaseException) -> Exception:
    """``exc`` if it is the link's own failure; re-raised if the link is being cancelled (then
    whatever the client's teardown raised beside the cancellation is noise)."""
    if isinstance(exc, BaseExceptionGroup):
        cancelled, rest = exc.split(trio.Cancelled)
        if cancelled is not None:
            raise cancelled from None
        exc = rest if rest is not None else exc
    if not isinstance(exc, Exception):
        raise exc
    return exc


def _described(exc: BaseException) -> str:
    """What failed, in one line: the first leaf, and what it was raised from (coredis wraps a
    refused certificate or a refused connection in its own ``ConnectionError``). Shown on
    ``/health`` and ``/ready``: a URL in a client library's message loses its userinfo."""
    leaf = _leaf(exc)
    text = f"{type(leaf).__name__}: {leaf}"
    if leaf.__cause__ is not None:
        cause = _leaf(leaf.__cause__)
        text += f" ({type(cause).__name__}: {cause})"
    return redact_url(text)


def _leaf(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (coredis raises from inside its task group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
