"""Who is in the roster: registrations, discovery, MoRIIO, expiry, and the one owner of it all.

Rule: it may import ``_core``, ``_state``, ``_upstream``, ``_observe``, ``_discovery`` and
``_replicas``. The owner and the cursors pull a new roster from here at known points; nothing
here pushes into them.

    roster_owner     ``Membership``: the roster store, registrations, discovery, MoRIIO, expiry;
                     a new version is pulled from it (``pull``), never pushed
    moriio_listener  the ZMQ ROUTER socket MoRIIO instances register with, on the trio loop
"""
