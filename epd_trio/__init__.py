"""epd_trio: a Trio proxy in front of disaggregated Encoder / Prefill / Decode vLLM instances.

The public surface is re-exported here from private modules; the layering is:
pure logic (``_routing``, ``_rewrite``, ``_config``, ``_errors``) <- trio state (``_cursors``,
``_fanout``) <- I/O (``_upstream``, ``_proxy``) <- web (``_asgi``, ``_app``, ``app``).
"""

from ._app import create_app as create_app
from ._config import ConfigError as ConfigError
from ._config import Settings as Settings
from ._config import load_settings as load_settings
from ._config import settings_from as settings_from
from ._cursors import EncoderCursor as EncoderCursor
from ._cursors import SlotCursor as SlotCursor
from ._errors import BadRequest as BadRequest
from ._errors import ProxyError as ProxyError
from ._errors import UpstreamError as UpstreamError
from ._errors import UpstreamStatusError as UpstreamStatusError
from ._errors import UpstreamTimeout as UpstreamTimeout
from ._errors import UpstreamTransportError as UpstreamTransportError
from ._fanout import fan_out as fan_out
from ._http import UpstreamClient as UpstreamClient
from ._proxy import Proxy as Proxy
from ._rewrite import build_encoder_body as build_encoder_body
from ._rewrite import build_prefill_body as build_prefill_body
from ._rewrite import item_uuid as item_uuid
from ._rewrite import parse_request as parse_request
from ._rewrite import with_item_uuids as with_item_uuids
from ._routing import Instance as Instance
from ._routing import dp_slots as dp_slots
from ._routing import encoder_rr_assignment as encoder_rr_assignment
from ._routing import flat_interleaved_dp_route as flat_interleaved_dp_route
from ._routing import group_by_target as group_by_target
from ._routing import parse_instance as parse_instance
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
