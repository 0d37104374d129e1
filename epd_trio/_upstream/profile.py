"""Profiling fan-out: ``POST /start_profile`` or ``/stop_profile`` to every instance of every role.

Unlike the encoder fan-out, one failure must not cancel the others: profiling is an operator's
action on the whole cluster, and the answer must say what happened at *each* instance (an
instance left half-profiled because its sibling failed would be worse than useless). So every
call runs concurrently in one nursery (``fan_out``) and turns its own outcome into a result
instead of raising; the nursery then only ends when all have answered or timed out.

vLLM registers these two routes only when a profiler is configured (``VLLM_TORCH_PROFILER_DIR``
or ``VLLM_TORCH_CUDA_PROFILE``; they answer 200 with an empty body); elsewhere they are a 404,
reported here as ``disabled``, not as a failure. The reply is 200 when no instance failed and at
least one profiles, 502 when any failed, and 503 when profiling is disabled everywhere (as
vLLM's own EPD proxy answers) or there is no instance at all.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._core.errors import ProxyError, UpstreamStatusError
from .._core.rewrite import json_object, upstream_headers
from .._core.routing import Instance
from .fanout import fan_out
from .legs import post_json
from .pool import UpstreamPool

ACTIONS = ("start_profile", "stop_profile")


@dataclass(frozen=True, slots=True)
class ProfileReport:
    """The reply: its HTTP status and JSON body."""

    status: int
    body: dict[str, Any]


def summarize(action: str, results: Sequence[dict[str, Any]]) -> ProfileReport:
    """The reply for the per-instance ``results`` (see the module docstring for the status)."""
    counts = {outcome: sum(r["status"] == outcome for r in results)
              for outcome in ("ok", "disabled", "failed")}
    if counts["failed"]:
        status = 502
    elif counts["ok"]:
        status = 200
    else:
        status = 503
    return ProfileReport(status, {"action": action, **counts, "instances": list(results)})


async def run_profile(
    action: str,
    raw_body: bytes,
    targets: Sequence[tuple[str, Instance]],
    client_for: Callable[[Instance], UpstreamPool],
    *,
    deadline: float,
) -> ProfileReport:
    """Send ``action`` to every ``(role, instance)`` target concurrently and gather every result.

    Each call is bounded by ``deadline`` seconds. Cancellation (the operator's client left) still
    cancels every call: only failures are contained.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown profiling action {action!r}")
    # Empty, or a JSON object forwarded as it is (newer vLLM versions take options there).
    body = json_object(raw_body, empty_ok=True)
    headers = upstream_headers(f"{action}-{uuid.uuid4().hex}", None)

    async def one(role: str, instance: Instance) -> dict[str, Any]:
        result: dict[str, Any] = {"role": role, "url": instance.url}
        try:
            response = await post_json(client_for(instance), stage="profile", instance=instance,
                                       path=f"/{action}", body=body, headers=headers,
                                       deadline=deadline)
        except UpstreamStatusError as error:
            disabled = error.upstream_status == 404
            return {**result, "status": "disabled" if disabled else "failed",
                    "http_status": error.upstream_status,
                    "error": "profiling is not enabled on this instance" if disabled
                    else error.message}
        except ProxyError as error:  # unreachable, timed out, or no free connection
            return {**result, "status": "failed", "http_status": None, "error": error.message}
        return {**result, "status": "ok", "http_status": response.status, "error": None}

    results = await fan_out([partial(one, role, instance) for role, instance in targets])
    return summarize(action, results)
