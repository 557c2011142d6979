"""Sizes and bounds that are read before torch is imported (the command line, the IPython
extension's settings) and that both ends share. The wire's own frame and part sizes live
with the wire format, in protocol.py."""

#: default bound of the content-addressed upload cache, in bytes, on the gateway and in the
#: client's mirror of it (cache.py); a client may ask for less, never for more
CACHE_BYTES = 512 << 20

#: default bound on the ops one session may have queued on the gateway, not yet run
#: (``remotecuda start --max-queued``; remotecuda_server/backlog.py)
MAX_QUEUED = 100_000


#: how a yes/no variable may be spelt (REMOTECUDA_SYNC, REMOTECUDA_FAILOVER)
SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def switch(name: str, text: str | None, default: bool) -> bool:
    """A yes/no setting (``default`` when unset or empty); any other spelling is a ValueError naming
    the variable: ``REMOTECUDA_SYNC=false`` turned synchronous mode on when any value but 0 did."""
    text = (text or "").strip().lower()
    if not text:
        return default
    if text not in SWITCH:
        raise ValueError(f"{name}={text!r}: one of 1/true/yes/on or 0/false/no/off")
    return SWITCH[text]


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
