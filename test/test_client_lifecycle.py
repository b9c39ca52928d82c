"""GPU clients that donors restart and reconfigure (issue 30 item 6), and the small things a user
meets at the terminal: Ctrl-C, a closed pipe, the units ``room show`` prints, whose line a log
line is. In-process and fast; the one test that starts a server and GPU clients is ``slow``."""
from __future__ import annotations

import os
import signal
import stat
import sys
import traceback

import pytest

from zwdx import cli
from zwdx.sdk import ZWDX

SERVER = "http://127.0.0.1:9"  # nothing listens: every call the tests make is patched


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("ZWDX_ROOM_TOKEN", "zs_test")
    return "zs_test"


# -- Ctrl-C ---------------------------------------------------------------------------------------
def _deep_read(*_args, **_kwargs):
    """Where a Ctrl-C lands while the SDK follows a job: deep in a socket read."""
    def recv_into():
        raise KeyboardInterrupt
    recv_into()


def _cancel_answers(sdk, calls):
    def answer(method, path, token=None, **kwargs):
        calls.append((method, path))
        if path == "/jobs":
            return {"id": "job1", "room_id": "room1"}
        return {"status": "cancelled"}
    sdk._json = answer


def _frames(err: BaseException) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(err.__traceback__)]


def test_ctrl_c_in_wait_cancels_and_raises_a_keyboard_interrupt_without_the_internals(token, capsys):
    sdk, calls = ZWDX(SERVER, room_token=token, remember=False), []
    _cancel_answers(sdk, calls)
    sdk._follow = _deep_read
    with pytest.raises(KeyboardInterrupt) as caught:
        sdk.wait("job1")
    assert ("POST", "/jobs/job1/cancel") in calls
    err = caught.value
    assert err.__cause__ is None and err.__suppress_context__, "the cut read is chained to it"
    assert "recv_into" not in _frames(err) and "_deep_read" not in _frames(err), _frames(err)
    assert "job job1 cancelled" in capsys.readouterr().err


def test_ctrl_c_in_submit_job_cancels_and_raises_a_keyboard_interrupt_without_the_internals(token, capsys):
    import torch
    sdk, calls = ZWDX(SERVER, room_token=token, remember=False), []
    _cancel_answers(sdk, calls)
    sdk._upload_bundle = lambda token, parts: {"id": "art1", "size": 10}
    sdk._follow = _deep_read
    model = torch.nn.Linear(2, 2)
    with pytest.raises(KeyboardInterrupt) as caught:
        sdk.submit_job(model, _loader, _train, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    assert ("POST", "/jobs/job1/cancel") in calls
    err = caught.value
    assert err.__suppress_context__ and "recv_into" not in _frames(err), _frames(err)
    assert len(traceback.format_exception(err)) < 12  # its whole traceback, as Python prints it


def _loader(rank, world_size):
    return [(None, None)]


def _train(model, loader, optimizer, epochs=1):
    return {}


def test_ctrl_c_in_the_cli_prints_one_line_and_exits_130(token, monkeypatch, capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.setattr(ZWDX, "submit_script", lambda self, *a, **k: _deep_read())
    code = cli.main(["run", "--server", SERVER, "--nproc", "1", "--working-dir", str(tmp_path), "train.py"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines() == ["zwdx: interrupted"], err


# -- a closed pipe, units, log lines ----------------------------------------------------------------
def test_jobs_list_into_a_pipe_closed_early_exits_quietly(token, monkeypatch, capsys):
    jobs = [{"id": f"job{i}", "name": "", "status": "queued", "created_at": 0} for i in range(5000)]
    monkeypatch.setattr(ZWDX, "list_jobs", lambda self, token, status=None: jobs)
    read, write = os.pipe()
    os.close(read)  # `| head` has read its lines and gone
    monkeypatch.setattr(sys, "stdout", os.fdopen(write, "w"))
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts a program
    try:
        code = cli.main(["jobs", "list", "--server", SERVER])
        sys.stdout.flush()  # what Python does at exit: nothing left to fail on
    finally:
        signal.signal(signal.SIGPIPE, previous)
        sys.stdout.close()
    assert code == 141
    assert "BrokenPipeError" not in capsys.readouterr().err


def test_room_show_prints_memory_in_gib(token, monkeypatch, capsys):
    room = {"id": "r1", "name": "lab", "clients": [{"id": "c1", "status": "online"}],
            "totals": {"clients_online": 1, "slots": 2, "slots_busy": 0, "memory_total": 3 * 2**30 + 2**29,
                       "memory_free": 2**30, "hosts": 1}}
    monkeypatch.setattr(ZWDX, "get_room", lambda self, token=None: room)
    assert cli.main(["room", "show", "--server", SERVER]) == 0
    out = capsys.readouterr().out
    assert "3.5 GiB" in out and "1.0 GiB" in out and str(3 * 2**30 + 2**29) not in out, out


def test_a_log_line_of_the_server_is_not_labelled_rank_none(token, monkeypatch, capsys):
    events = [{"seq": 1, "rank": None, "data": {"text": "diloco round 1: 2 workers"}},
              {"seq": 2, "rank": 0, "data": {"text": "epoch 1"}}]
    monkeypatch.setattr(ZWDX, "_json", lambda self, method, path, token=None, params=None, **kw:
                        {"events": [e for e in events if e["seq"] > params["after"]]})
    assert cli.main(["jobs", "logs", "job1", "--server", SERVER]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["[server] diloco round 1: 2 workers", "[rank 0] epoch 1"], out
