"""Sizes and bounds that are read before torch is imported (the command line, the IPython
extension's settings) and that both ends share. The wire's own frame and part sizes live
with the wire format, in protocol.py."""

#: default bound of the content-addressed upload cache, in bytes, on the gateway and in the
#: client's mirror of it (cache.py); a client may ask for less, never for more
CACHE_BYTES = 512 << 20

#: default bound on the ops one session may have queued on the gateway, not yet run
#: (``remotecuda start --max-queued``; remotecuda_server/backlog.py)
MAX_QUEUED = 100_000
