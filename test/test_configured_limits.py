"""Limits an operator sets are the ones the server keeps: the largest request body
(``--max-request-bytes``, ``ZWDX_MAX_REQUEST_BYTES``, the ``MAX_REQUEST_BYTES`` config), set
each way, refuses a body just over it with 413 and reads one just under it."""
from __future__ import annotations


import pytest
import requests

from zwdx import defaults
from zwdx.testing import ServerProc

LIMIT = 4096


def _name_of(size: int) -> dict:
    """A room-creation body of exactly ``size`` bytes as the client sends it (its name pads it)."""
    import json
    base = len(json.dumps({"name": ""}, separators=(",", ":")))
    return {"name": "r" * (size - base)}


def _sizes_refused(post) -> tuple[int, int]:
    """(status just under the limit, status just over it)."""
    import json
    under, over = _name_of(LIMIT - 200), _name_of(LIMIT + 200)
    assert len(json.dumps(over, separators=(",", ":"))) > LIMIT > len(json.dumps(under, separators=(",", ":")))
    return post(under), post(over)


def test_the_default_is_well_above_the_configured_limit_used_here():
    assert defaults.MAX_REQUEST_BYTES > 10 * LIMIT  # or the tests below would pass with the setting ignored


def _in_process(app) -> tuple[int, int]:
    import json
    client = app.test_client()
    return _sizes_refused(lambda body: client.post("/api/v1/rooms", data=json.dumps(body, separators=(",", ":")),
                                                   content_type="application/json").status_code)


def test_the_config_sets_the_largest_body(make_app):
    under, over = _in_process(make_app(MAX_REQUEST_BYTES=LIMIT))
    assert over == 413 and under != 413, (under, over)


def test_the_environment_sets_the_largest_body(make_app, monkeypatch):
    monkeypatch.setenv("ZWDX_MAX_REQUEST_BYTES", str(LIMIT))
    under, over = _in_process(make_app())
    assert over == 413 and under != 413, (under, over)


@pytest.mark.slow
def test_the_server_flag_sets_the_largest_body(tmp_path):
    server = ServerProc(str(tmp_path / "data"), extra=["--max-request-bytes", str(LIMIT)])
    try:
        import json
        under, over = _sizes_refused(lambda body: requests.post(
            f"{server.url}/api/v1/rooms", data=json.dumps(body, separators=(",", ":")),
            headers={"Content-Type": "application/json"}, timeout=30).status_code)
    finally:
        server.stop()
    assert over == 413 and under != 413, (under, over)
