"""A simulated batch engine behind the fake vLLM: enough of vLLM's scheduling to compare policies.

Round-robin and load-aware routing only differ on an engine that batches, queues and caches,
so ``FakeVLLM(engine=SimEngine(...))`` answers through this model instead of fixed delays:

- **Batching.** Each DP rank runs at most ``max_num_seqs`` requests at once; the others wait
  in a FIFO queue, as vLLM's scheduler admits them.
- **Steps.** A rank's engine loops over steps. A step takes ``step_base + step_per_seq x
  batch`` seconds, plus ``prefill_per_token`` for each uncached prompt token of the requests
  admitted in it (prefill is in the step, as with vLLM's chunked prefill, unchunked here).
  Each running request gets one token per step; a request admitted in a step gets its first
  token at the end of that step. The handler writes each token as its own SSE event, as vLLM
  does, after the stream's 200 headers (sent before the engine has the request).
- **Prefix cache.** Prompts are split into words (one word = one token) and blocks of
  ``block_tokens`` tokens, each identified by a hash chained over the blocks before it. A rank
  keeps at most ``cache_blocks`` blocks (least recently used out first). A request's cached
  prefix is its leading blocks found there; only the rest costs prefill time. A decode that
  received the prompt's KV from a prefill (``kv_transfer_params`` with ``do_remote_prefill``)
  costs no prefill at all. The cache is ``prefix_cache.PrefixCache``: given an ``event_sink``,
  each rank reports what it stores and evicts as vLLM's KV events (``epd_trio._kv.wire``'s), one
  batch per step, to that callable: the bench can feed an index in-process, ``FakeVLLM`` (with
  ``KVConfig``) a ``KVEventPublisher``. Without a sink no event is built.
- **Encoder.** An encoder instance encodes at most ``max_num_seqs`` requests at once; an item
  takes ``encode_miss`` seconds, or ``encode_hit`` when its ``uuid`` is among the last
  ``encoder_cache_items`` it encoded.
- **Metrics.** ``metrics_text`` is what ``GET /metrics`` serves: vLLM's gauges
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``
  (here: the running requests' blocks over ``cache_blocks``, capped at 1), and its counters
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens), one series per rank with
  labels ``model_name`` and ``engine``; and for encoders ``fake:encoder_cache_queries`` /
  ``fake:encoder_cache_hits`` (items), which vLLM does not have.

Time is trio's clock, so the model also runs on a virtual clock. Every parameter is a field of
``EngineConfig`` and a flag of ``python -m epd_trio.testing --sim``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields

import trio

from .._kv.wire import ExtraKeys
from .prefix_cache import EventSink, PrefixCache, chained_hashes, new_seed


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The simulated engine's parameters (all times in seconds)."""

    #: Requests one DP rank runs at once (vLLM's ``--max-num-seqs``).
    max_num_seqs: int = 8
    #: Fixed cost of one step (one token for every running request).
    step_base: float = 0.010
    #: Added to a step per running request.
    step_per_seq: float = 0.002
    #: Added to the step that admits a request, per uncached prompt token.
    prefill_per_token: float = 0.00005
    #: Tokens per prefix-cache block.
    block_tokens: int = 16
    #: Prefix-cache blocks one rank keeps.
    cache_blocks: int = 512
    #: Seconds to encode an item the encoder has not cached.
    encode_miss: float = 0.030
    #: Seconds to encode an item it has.
    encode_hit: float = 0.002
    #: Item uuids one encoder remembers.
    encoder_cache_items: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number >= 0: {value!r}")
        if self.max_num_seqs < 1 or self.block_tokens < 1:
            raise ValueError("max_num_seqs and block_tokens must be >= 1")


def prompt_blocks(words: Sequence[str], block_tokens: int) -> list[int]:
    """The chained hashes of a prompt's full blocks (a partial last block is never cached)."""
    blocks, chained = [], 0
    for start in range(0, len(words) - block_tokens + 1, block_tokens):
        chained = hash((chained, tuple(words[start:start + block_tokens])))
        blocks.append(chained)
    return blocks


@dataclass(eq=False, slots=True)
class _Seq:
    """One request in a rank's engine."""

    prompt_tokens: int
    blocks: list[int]
    prefill: bool
    wanted: int
    tokens: trio.MemorySendChannel[int]
    produced: int = 0
    cancelled: bool = False
    #: Cache its blocks even without prefill (a decode that received them).
    store: bool = False
    #: For the events: the prompt's token ids and each block's extra keys.
    token_ids: Sequence[Hashable] = ()
    extra_keys: Sequence[ExtraKeys] | None = None
    hit_limit: int | None = None
    on_admit: Callable[[int], object] | None = None


@dataclass(slots=True)
class _Rank:
    """One DP rank: its batch, its queue, its prefix cache and their counters."""

    index: int
    cache: PrefixCache
    running: list[_Seq] = field(default_factory=list)
    waiting: deque[_Seq] = field(default_factory=deque)
    requests: int = 0
    #: Seconds of steps as modelled, and as they took on the clock (the event loop's lag,
    #: on a busy machine, makes the second larger: the bench reports the overrun).
    modelled: float = 0.0
    elapsed: float = 0.0
    wake: trio.Event = field(default_factory=trio.Event)

    @property
    def queries(self) -> int:
        """``vllm:prefix_cache_queries``: prompt tokens looked up."""
        return self.cache.queries

    @property
    def hits(self) -> int:
        """``vllm:prefix_cache_hits``: prompt tokens found cached."""
        return self.cache.hits


class SimEngine:
    """The engine of one fake instance: ``dp_size`` ranks (or an encoder), started with
    ``await nursery.start(engine.run)`` by ``FakeVLLM.serve``."""

    def __init__(self, config: EngineConfig | None = None, dp_size: int = 1, *,
                 event_sink: EventSink | None = None, seed: int | None = None) -> None:
        self.config = config or EngineConfig()
        #: Where each step's KV events go (None: none are built).
        self.event_sink = event_sink
        #: The block hash seed, random per engine like a vLLM instance's.
        self.seed = new_seed() if seed is None else seed
        self.ranks = [
            _Rank(index, PrefixCache(block_size=self.config.block_tokens,
                                     capacity=self.config.cache_blocks,
                                     record_events=event_sink is not None))
            for index in range(dp_size)]
        self._encoder_cache: OrderedDict[str, None] = OrderedDict()
        self._encoder_places = trio.Semaphore(self.config.max_num_seqs)
        self.encoding = 0
        self.encoder_queries = 0
        self.encoder_hits = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every rank's step loop, until cancelled."""
        async with trio.open_nursery() as nursery:
            for rank in self.ranks:
                nursery.start_soon(self._steps, rank)
            task_status.started()

    async def generate(
        self, rank: int, words: Sequence[Hashable], tokens: int, *, prefill: bool,
        store: bool = False, extra_keys: Sequence[ExtraKeys] | None = None,
        hit_limit: int | None = None, on_admit: Callable[[int], object] | None = None,
    ) -> AsyncIterator[int]:
        """Queue a request on ``rank`` and yield once per token it gets (``tokens`` of them).

        ``words`` is the prompt, one token each (words, or token ids when events are wanted:
        they are the events' ``token_ids``). ``prefill=False``: its KV came from elsewhere, it
        costs no prefill, and it is neither looked up nor cached unless ``store``. ``hit_limit``
        caps the cached prefix (tokens); ``on_admit`` is told it when the request joins the
        batch. Leaving early (the client went away) takes it out of the batch at the next step.
        """
        config = self.config
        send, receive = trio.open_memory_channel[int](math.inf)
        blocks = chained_hashes(words, config.block_tokens, seed=self.seed, extra_keys=extra_keys)
        seq = _Seq(len(words), blocks, prefill, max(tokens, 1), send, store=store,
                   token_ids=words if self.event_sink is not None else (),
                   extra_keys=extra_keys, hit_limit=hit_limit, on_admit=on_admit)
        state = self.ranks[rank]
        state.requests += 1
        state.waiting.append(seq)
        state.wake.set()
        try:
            for _ in range(seq.wanted):
                yield await receive.receive()
        finally:
            seq.cancelled = True  # before the close: the engine never sends to a closed channel
            receive.close()

    async def encode(self, uuids: Sequence[str]) -> None:
        """Encode one request's items (returns when done)."""
        config = self.config
        self.encoding += 1
        try:
            async with self._encoder_places:
                seconds = 0.0
                cache = self._encoder_cache
                for uuid in uuids:
                    self.encoder_queries += 1
                    if uuid in cache:
                        cache.move_to_end(uuid)
                        self.encoder_hits += 1
                        seconds += config.encode_hit
                    else:
                        seconds += config.encode_miss
                        cache[uuid] = None
                        if len(cache) > config.encoder_cache_items:
                            cache.popitem(last=False)
                await trio.sleep(seconds)
        finally:
            self.encoding -= 1

    async def _steps(self, rank: _Rank) -> None:
        config = self.config
        while True:
            if not rank.running and not rank.waiting:
                await rank.wake.wait()
                rank.wake = trio.Event()
                continue
            uncached = 0
            while rank.waiting and len(rank.running) < config.max_num_seqs:
                seq = rank.waiting.popleft()
                if seq.cancelled:
                    continue
                if seq.prefill:
                    uncached += self._prefill(rank, seq)
                elif seq.store:
                    self._admit(rank, seq)
                rank.running.append(seq)
            self._flush(rank)
            step = (config.step_base + config.step_per_seq * len(rank.running)
                    + config.prefill_per_token * uncached)
            started = trio.current_time()
            await trio.sleep(step)
            rank.modelled += step
            rank.elapsed += trio.current_time() - started
            still = []
            for seq in rank.running:
                if seq.cancelled:
                    continue
                seq.produced += 1
                seq.tokens.send_nowait(seq.produced)
                if seq.produced < seq.wanted:
                    still.append(seq)
            rank.running = still

    def _prefill(self, rank: _Rank, seq: _Seq) -> int:
        """The uncached prompt tokens of ``seq``; its blocks are cached from now on."""
        return seq.prompt_tokens - self._admit(rank, seq)

    def _admit(self, rank: _Rank, seq: _Seq) -> int:
        token_ids: Sequence[int] = seq.token_ids  # type: ignore[assignment]  # ints with events
        hit = rank.cache.admit(seq.blocks, seq.prompt_tokens, token_ids=token_ids,
                               extra_keys=seq.extra_keys, hit_limit=seq.hit_limit)
        if seq.on_admit is not None:
            seq.on_admit(hit)
        return hit

    def _flush(self, rank: _Rank) -> None:
        """Publish the step's events as one batch, as vLLM's scheduler does."""
        if self.event_sink is not None:
            events = rank.cache.take_events()
            if events:
                self.event_sink(rank.index, events)

    def reset_prefix_cache(self) -> None:
        """Every rank drops its cache (``AllBlocksCleared`` to the sink)."""
        for rank in self.ranks:
            rank.cache.clear()
            self._flush(rank)

    def metrics_text(self, model: str, encoder: bool) -> str:
        """The ``GET /metrics`` page (Prometheus text format, as vLLM writes it)."""
        lines = []

        def family(name: str, kind: str, values: Sequence[float]) -> None:
            lines.append(f"# TYPE {name} {kind}")
            suffix = "_total" if kind == "counter" else ""
            for engine, value in enumerate(values):
                lines.append(f'{name}{suffix}{{engine="{engine}",model_name="{model}"}} '
                             f"{float(value)}")

        if encoder:
            family("vllm:num_requests_running", "gauge",
                   [min(self.encoding, self.config.max_num_seqs)])
            family("vllm:num_requests_waiting", "gauge",
                   [max(0, self.encoding - self.config.max_num_seqs)])
            family("fake:encoder_cache_queries", "counter", [self.encoder_queries])
            family("fake:encoder_cache_hits", "counter", [self.encoder_hits])
        else:
            blocks = self.config.cache_blocks or 1
            family("vllm:num_requests_running", "gauge", [len(r.running) for r in self.ranks])
            family("vllm:num_requests_waiting", "gauge", [len(r.waiting) for r in self.ranks])
            family("vllm:kv_cache_usage_perc", "gauge", [
                min(1.0, sum((s.prompt_tokens + s.produced) / self.config.block_tokens
                             for s in r.running) / blocks) for r in self.ranks])
            family("vllm:prefix_cache_queries", "counter", [r.queries for r in self.ranks])
            family("vllm:prefix_cache_hits", "counter", [r.hits for r in self.ranks])
        return "\n".join(lines) + "\n"
