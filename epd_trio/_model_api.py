"""One request of vLLM's other endpoints: embeddings, pooling, scores, reranking, tokenizing, audio.

These serve a model but have no media items to encode and no KV cache to hand over: each request
goes to its model's pool (``_core.names.MODEL_ENDPOINTS``), to one of its decode (combined)
instances by the pool's decode policy, on the path it came on, and the instance's answer is
relayed as it is, a stream too (``stream=true`` transcriptions are SSE), an error too (a model
without the task answers as vLLM does). A pool made for an embedding model alone is a pool of
decode instances only.

Everything else is a completion request's: the same run (``_pipeline.RequestRun``, decode
alone), so the same authentication, tenants and admission (tokens settled from the answer's
``usage``), model resolution (aliases, adapters, a tenant's list, vLLM's 404), failover before
the first byte, cancellation when the client leaves, the decode deadline, and the metrics,
span and log line under the endpoint's path.

Bodies: a JSON object is sent on unchanged, byte for byte, unless the proxy must change it (a
field it owns dropped, an alias's target named, a tenant's priority set). A multipart form (the
audio endpoints) is never parsed whole: its ``model`` and ``stream`` fields are read where they
are (``_core.rewrite.form_fields``), the upload is held once, as it arrived, and goes to the
instance as it came, with its own content type; only an alias rewrites the ``model`` field in
it, in one copy.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from ._core.rewrite import client_fields, form_fields, json_object, with_form_field
from ._pipeline import Reply, RequestRun


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """What a run of an endpoint reads of its request once parsed: whether it streams."""

    stream: bool


class ApiRun(RequestRun):
    """One request of an endpoint of ``MODEL_ENDPOINTS``: decode alone (see the module)."""

    __slots__ = ()
    api = True

    async def answer(self, *, form: bool, raw_body: bytes, content_type: str | None,
                     resources: AsyncExitStack, session: str | None = None) -> Reply:
        """Read the body's model (and stream flag), resolve it, then decode with failover."""
        body: dict[str, Any] | bytes
        if form:
            fields = form_fields(raw_body, content_type, ("model", "stream"))
            asked = fields["model"].value if "model" in fields else None
            stream = "stream" in fields and fields["stream"].value.strip().lower() == "true"
            body, changed = raw_body, False
            self.content_type = content_type  # the form's own, with its boundary
        else:
            fields = {}
            body, dropped = client_fields(json_object(raw_body))
            asked = body.get("model")
            stream = body.get("stream") is True
            changed = bool(dropped)
        leg_model = await self.resolve(asked, resources, session)
        if leg_model is not None:  # an alias's target, or the one model, on the leg
            if isinstance(body, dict):
                body, changed = {**body, "model": leg_model}, True
            elif "model" in fields:
                body = with_form_field(raw_body, fields["model"], leg_model)
        if self.ticket is not None:  # its tenant's limits; on a JSON body, its priority too
            admitted = await self._admit(body if isinstance(body, dict) else {})
            if isinstance(body, dict) and admitted != body:
                body, changed = admitted, True
        if isinstance(body, dict) and not changed:
            body = raw_body  # as it came: nothing to encode again
        self.request = ApiRequest(stream)  # type: ignore[assignment]
        self.account.trace.stream = stream
        self.body, self.items = body, []  # type: ignore[assignment]
        self.with_prefill = self.encode = False
        self.size = 0
        await self._ready_pool()  # an adapter loaded on demand, as for a chat request
        return await self._decode_with_failover()
