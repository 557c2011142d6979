"""Sizes and bounds that are read before torch is imported (the command line, the IPython
extension's settings) and that both ends share. The wire's own frame and part sizes live
with the wire format, in protocol.py."""

#: default bound of the content-addressed upload cache, in bytes, on the gateway and in the
#: client's mirror of it (cache.py); a client may ask for less, never for more
CACHE_BYTES = 512 << 20
