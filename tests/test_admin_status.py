"""STATUS's per-session rows only to an admin token (remotecuda start --admin-token-file), against
a real --device cpu gateway with a session token: a token holder, and a client with no token,
get the public view; a client proving the admin token gets every session's row and the totals."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import zmq

from remotecuda_wire import auth, protocol
from remotecuda_wire.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV

from conftest import ROOT, Client, GatewayProcess

TOKEN = "session-token-for-the-admin-test-0123"
ADMIN = "admin-token-for-the-admin-test-456789"


@pytest.fixture(scope="module")
def admin_gw(tmp_path_factory):
    d = tmp_path_factory.mktemp("admin")
    (d / "token").write_text(TOKEN + "\n")
    (d / "admin").write_text(ADMIN + "\n")
    gw = GatewayProcess("--token-file", str(d / "token"), "--admin-token-file", str(d / "admin"))
    yield gw
    gw.stop()


def _status(gw: GatewayProcess) -> dict:
    from remotecuda.session import gateway_status
    return gateway_status(zmq.Context.instance(), gw.endpoint, 10)


@pytest.fixture
def tokens(monkeypatch):
    """Sets the client's session and admin tokens (None: unset)."""
    def use(token: str | None, admin: str | None) -> None:
        for env in (auth.TOKEN_FILE_ENV, ADMIN_TOKEN_FILE_ENV):
            monkeypatch.delenv(env, raising=False)
        for env, value in ((auth.TOKEN_ENV, token), (ADMIN_TOKEN_ENV, admin)):
            if value is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, value)
    return use


def test_per_session_rows_go_only_to_the_admin_token(admin_gw, tokens):
    tokens(TOKEN, None)
    c = Client(admin_gw.endpoint)
    try:
        c.hello()  # a session, so that there is a row to hide
        tokens(TOKEN, None)  # a token holder: the public view
        public = _status(admin_gw)
        assert public["sessions"] == 1 and "totals" not in public and public["gpus"], public
        tokens(None, None)  # no token at all: the same
        assert _status(admin_gw)["sessions"] == 1 and "totals" not in _status(admin_gw)
        tokens(TOKEN, ADMIN)  # the admin: every session's row, and the totals
        full = _status(admin_gw)
        assert isinstance(full["sessions"], list) and len(full["sessions"]) == 1, full
        assert full["sessions"][0]["device"] == 0 and full["totals"]["messages_in"] >= 1
        tokens(TOKEN, "a-wrong-admin-token-long-enough")  # a wrong one proves nothing: the public view
        wrong = _status(admin_gw)
        assert wrong["sessions"] == 1 and "totals" not in wrong
        assert _status(admin_gw)["sessions"] == 1
        tokens(TOKEN, None)
        c.send(protocol.BYE, {})
    finally:
        c.close()


def test_an_admin_token_needs_a_session_token_and_must_differ(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA_")}
    cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0", "--no-discovery"]
    r = subprocess.run([*cmd, "--admin-token", ADMIN], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and "needs a session token" in r.stderr and "READY" not in r.stdout, r.stderr
    r = subprocess.run([*cmd, "--admin-token", TOKEN, "--token", TOKEN], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "must differ" in r.stderr and "READY" not in r.stdout, r.stderr


def test_without_an_admin_token_token_holders_see_the_rows(tokens, tmp_path):
    """A gateway with a session token only keeps today's STATUS (rows to any token holder), and a
    client holding an admin token the gateway does not take still gets it, as a token holder."""
    (tmp_path / "token").write_text(TOKEN)
    gw = GatewayProcess("--token-file", str(tmp_path / "token"))
    try:
        tokens(TOKEN, ADMIN)
        status = _status(gw)
        assert isinstance(status["sessions"], list) and "totals" in status, status
    finally:
        gw.stop()
