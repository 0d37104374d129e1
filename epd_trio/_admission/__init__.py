"""Admission: whether a client request may start now, and how long it may wait for a place.

Rule: it may import ``_core`` only; the web layer asks it before the pipeline runs.

    gate  the cap on client requests in flight, with a bounded wait for a place
    fair  the same cap shared fairly by tenants: their limits, the queue over the cap
"""
