"""epd_trio: a Trio proxy in front of disaggregated Encoder / Prefill / Decode vLLM instances.

The public surface is re-exported here from private modules. Where a client request goes:

    web        _asgi.ProxyASGI -> _endpoints.CompletionEndpoints (the two completion routes,
               plain ASGI) | _app.create_app (Quart: every other route); app.py is the served app
    owner      _proxy.Proxy: roster, lifecycle (pools, prober), admin and read-only routes
    pipeline   _pipeline.Pipeline.run: encode -> prefill -> decode for one request
    legs       _upstream: one call per leg, the encoder fan-out, the stream relay; the one
               place transport errors become UpstreamError
    pool       _http.UpstreamClient / UpstreamPool: connections to vLLM (_h1: one connection)
    accounting _accounting: every leg's health, metrics and trace in one place
               (_metrics: Prometheus; _request_log: the log lines; _tracing: the
               OpenTelemetry spans, or the client's trace headers forwarded)
    state      _cursors (routing positions under a trio.Lock, each with its stage's policy),
               _loads (in-flight requests per stage and slot), _roster_store (one process's
               roster, or the shared memory of several workers), _fanout (one nursery per
               fan-out), _prober (health probes), _load_scraper (vLLM's /metrics), _profile,
               _moriio_listener (the MoRIIO ZMQ registration socket on the trio loop)
    core       _core/: pure logic, no I/O, no trio (its __init__ lists the modules)
    process    __main__ (``epd-trio``), _runner (workers), _serving (Hypercorn), _process,
               _environment (settings from file and environment), _logs
    extras     asyncio_bridge (optional), testing/ (the fake vLLM, the demo cluster, the
               MoRIIO stand-ins, vLLM's HTTP registrar)

What you may touch: the names in ``__all__`` below, ``epd_trio.app:app``, ``epd_trio.testing``
and ``epd_trio.asyncio_bridge``. Everything with a leading underscore may change.
docs/contributing/layout.md walks the same map with the reasons.
"""

from ._app import create_app as create_app
from ._core.config import ConfigError as ConfigError
from ._core.config import Settings as Settings
from ._core.config import settings_from as settings_from
from ._core.errors import BadRequest as BadRequest
from ._core.errors import ProxyError as ProxyError
from ._core.errors import UpstreamError as UpstreamError
from ._core.errors import UpstreamStatusError as UpstreamStatusError
from ._core.errors import UpstreamTimeout as UpstreamTimeout
from ._core.errors import UpstreamTransportError as UpstreamTransportError
from ._core.rewrite import build_encoder_body as build_encoder_body
from ._core.rewrite import build_prefill_body as build_prefill_body
from ._core.rewrite import item_uuid as item_uuid
from ._core.rewrite import parse_request as parse_request
from ._core.rewrite import with_item_uuids as with_item_uuids
from ._core.routing import Instance as Instance
from ._core.routing import dp_slots as dp_slots
from ._core.routing import encoder_rr_assignment as encoder_rr_assignment
from ._core.routing import flat_interleaved_dp_route as flat_interleaved_dp_route
from ._core.routing import group_by_target as group_by_target
from ._core.routing import parse_instance as parse_instance
from ._cursors import EncoderCursor as EncoderCursor
from ._cursors import SlotCursor as SlotCursor
from ._environment import load_settings as load_settings
from ._fanout import fan_out as fan_out
from ._http import UpstreamClient as UpstreamClient
from ._proxy import Proxy as Proxy
from ._upstream import EncoderCall as EncoderCall
from ._upstream import run_encoder_fanout as run_encoder_fanout

__version__ = "0.1.0"

__all__ = [
    "BadRequest",
    "ConfigError",
    "EncoderCall",
    "EncoderCursor",
    "Instance",
    "Proxy",
    "ProxyError",
    "Settings",
    "SlotCursor",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamTransportError",
    "build_encoder_body",
    "build_prefill_body",
    "create_app",
    "dp_slots",
    "encoder_rr_assignment",
    "fan_out",
    "flat_interleaved_dp_route",
    "group_by_target",
    "item_uuid",
    "load_settings",
    "parse_instance",
    "parse_request",
    "run_encoder_fanout",
    "settings_from",
    "with_item_uuids",
]
