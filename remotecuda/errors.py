"""Exceptions, and turning a gateway's error report back into the one PyTorch would raise."""
from __future__ import annotations

import torch


class RemoteCUDAError(RuntimeError):
    """Base class for RemoteCUDA's own failures (not an op's)."""


class GatewayUnavailableError(RemoteCUDAError):
    """No gateway answered, and fallback to the local CPU is off."""


class GatewayLostError(RemoteCUDAError):
    """The gateway or this session's worker stopped answering; the session's tensors are gone."""


class GatewayProtocolError(RemoteCUDAError):
    """The gateway rejected a message as malformed."""


_TYPES: dict[str, type[BaseException]] = {
    "RuntimeError": RuntimeError, "IndexError": IndexError, "ValueError": ValueError,
    "TypeError": TypeError, "NotImplementedError": NotImplementedError,
    "UnknownOpError": NotImplementedError, "ZeroDivisionError": ZeroDivisionError,
    "OverflowError": OverflowError, "KeyError": KeyError, "AssertionError": AssertionError,
    "OutOfMemoryError": torch.OutOfMemoryError, "ProtocolError": GatewayProtocolError,
    "AcceleratorError": RuntimeError,
}


def remote_exception(info: dict) -> BaseException:
    """The exception local PyTorch would raise, naming the op that failed remotely."""
    cls = _TYPES.get(info.get("type", ""), RuntimeError)
    msg = (f"{info.get('msg', '')}\n[remotecuda] raised by op {info.get('op')} (#{info.get('index')}) "
           "on the gateway; ops run asynchronously, so the Python line that issued it may be "
           "earlier than this one (set REMOTECUDA_SYNC=1 to raise at the call site)")
    if cls is KeyError:
        cls = RuntimeError
    return cls(msg)
