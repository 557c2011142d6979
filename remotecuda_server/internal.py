"""The gateway's internal messages: supervisor ↔ worker, over the private ``ipc://`` socket.

Not on the wire (docs/PROTOCOL.md, "Gateway internals"): each is a multipart message whose
first frame (after the worker's routing identity, on the supervisor's side) is one of these
kinds. Adding a kind means a sender, a branch in the receiver's dispatch
(``Gateway._on_back`` or ``Worker.serve``) and a line in PROTOCOL.md.
"""
from __future__ import annotations

# worker → supervisor
READY = b"READY"
"""A worker has imported torch and takes a session; then its data port, ASCII digits (``0``: none)."""
OUT = b"OUT"
"""A message for the client, sent on the forwarded path; then the client's identity and its frames, unchanged."""
STATS = b"STATS"
"""The session's counters, when they change; then a msgpack map (``direct_*`` counts included)."""
BYE = b"BYE"
"""The client said BYE on the direct path; nothing follows: the supervisor closes the session."""
CLOSED = b"CLOSED"
"""The worker's executor has stopped; nothing follows: the worker process exits next."""
READ = b"READ"
"""How much of what the supervisor forwarded (MSG) the worker has read, now and then: then the
message and byte counts since the session began, ASCII digits. The supervisor holds the rest, up to a bound."""

# supervisor → worker
ATTACH = b"ATTACH"
"""A session for this worker; then the client's identity and msgpack ``{"cache", "token", "codecs", "key"}``
(``key``: the session's key when the gateway has a token, else nil)."""
MSG = b"MSG"
"""A client's OPS, CANCEL or PART, forwarded; then its frames, uncopied."""
CLOSE = b"CLOSE"
"""The session is over; nothing follows: the worker drops its queued work, stops its executor and answers CLOSED."""
LOST = b"LOST"
"""A message on the session's connection was refused before its type could be trusted (it may
have been a PART); nothing follows: uploads waiting for PARTs that will not come fail."""

# inside a worker: executor thread → I/O thread (over the worker's inproc outbox)
DONE = b"DONE"
"""The executor thread has finished; nothing follows: the I/O thread answers CLOSED."""
OFFERED = b"OFFERED"
"""The executor ran an ``rc::offer``; nothing follows: the I/O thread serves the PULLs waiting for it."""
