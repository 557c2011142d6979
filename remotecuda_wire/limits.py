"""Sizes and bounds that are read before torch is imported (the command line, the IPython
extension's settings) and that both ends share. The wire's own frame and part sizes live
with the wire format, in protocol.py."""

#: default bound of the content-addressed upload cache, in bytes, on the gateway and in the
#: client's mirror of it (cache.py); a client may ask for less, never for more
CACHE_BYTES = 512 << 20

#: default bound on the ops one session may have queued on the gateway, not yet run
#: (``remotecuda start --max-queued``; remotecuda_server/backlog.py)
MAX_QUEUED = 100_000


def env_number(name: str, default: float, least: float = 0) -> float:
    """The number in environment variable ``name`` (``default`` when unset or empty); a value that is
    not one, or below ``least``, is a ValueError naming the variable, not int()'s bare message."""
    import os
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if not value >= least:
        raise ValueError(f"{name}={text!r}: at least {least:g}")
    return value
