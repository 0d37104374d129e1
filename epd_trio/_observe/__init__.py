"""What the proxy says about its work: counts, log lines and traces, fed from one account per leg.

Rule: it may import ``_core`` only. The pipeline reports to ``accounting``; nothing else here is
called from the request path.

    accounting   every leg's health, metrics and trace, reported in one place
    metrics      the Prometheus registry (the only module that touches prometheus_client)
    request_log  the request's log line and its warnings
    tracing      OpenTelemetry spans, or the client's trace headers forwarded
"""
