"""The admin token: who may see every session's row in a gateway's STATUS.

A gateway started with ``--admin-token-file`` (or ``REMOTECUDA_ADMIN_TOKEN(_FILE)``) gives its
per-session counters and its totals only to a STATUS sent on a connection that proved the admin
token; anyone else, token holders included, gets the public view (inventory and GPU figures,
which beacons announce anyway). The admin token is proven exactly as the session token is
(auth.py: a challenge, a key derived from both nonces, every message sealed), the gateway trying
the admin key when the session token's does not open the client's sealed HELLO. It needs a
session token (a gateway without one is open to anyone on its port) and must differ from it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from . import auth

ADMIN_TOKEN_ENV = "REMOTECUDA_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "REMOTECUDA_ADMIN_TOKEN_FILE"


def read_admin_token(token: str | None = None, token_file: str | None = None,
                     environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The admin token: given, else read from ``token_file``, else ``REMOTECUDA_ADMIN_TOKEN``, else
    the file ``REMOTECUDA_ADMIN_TOKEN_FILE`` names; None when there is none (auth.read_token's rules)."""
    return auth.read_token(token, token_file, {auth.TOKEN_ENV: environ.get(ADMIN_TOKEN_ENV, ""),
                                               auth.TOKEN_FILE_ENV: environ.get(ADMIN_TOKEN_FILE_ENV, "")})
