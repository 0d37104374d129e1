"""epd_trio: a Trio proxy in front of disaggregated Encoder / Prefill / Decode vLLM instances.

The public surface is re-exported here from private modules. The rooms, bottom to top (each
may import only the rooms below it that its ``__init__`` names; ``tests/test_layout.py`` checks):

    _core        pure logic: values in, values out, no I/O and no trio
    _state       this process's routing state: cursors, loads, the roster store
    _observe     metrics, request logs and traces, fed from one account per leg
    _discovery   instances found by DNS names and Kubernetes selectors
    _admission   whether a client request may start now
    _kv          the KV index fed by vLLM's KV cache events
    _models      the model registry: which instances serve which model, and where a name leads
    _upstream    every call to vLLM and the connection pools under it
    _replicas    what replicas share through Redis
    _membership  who is in the roster: its one owner (registrations, discovery, MoRIIO, expiry)
    (top level)  the owner of the request path (_proxy, which pulls the roster from
                 _membership), each model's routing state (_model_pools), one request's
                 pipeline (_pipeline) and its hand-offs (_handoff), the composition root
                 (_app), settings (_environment), and the public modules below
    _web         HTTP in, the owner's answers out
    _serve       processes and servers: ``epd-trio serve``, Hypercorn, logging
    testing      the test doubles: the fake vLLM, the demo cluster, the fake Kubernetes API

What you may touch: the names in ``__all__`` below, ``epd_trio.app:app``, ``epd_trio.testing``
and ``epd_trio.asyncio_bridge``. Everything with a leading underscore may change.
docs/contributing/layout.md walks the same map with the reasons, module by module.
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
from ._environment import load_settings as load_settings
from ._proxy import Proxy as Proxy
from ._state.cursors import EncoderCursor as EncoderCursor
from ._state.cursors import SlotCursor as SlotCursor
from ._upstream.fanout import fan_out as fan_out
from ._upstream.legs import EncoderCall as EncoderCall
from ._upstream.legs import run_encoder_fanout as run_encoder_fanout
from ._upstream.pool import UpstreamClient as UpstreamClient

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
