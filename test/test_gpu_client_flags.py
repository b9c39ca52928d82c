"""zwdx gpu-client's flags it cannot take: each refused before anything starts (exit 2), the
message naming the flag and what it takes (zwdx/cli_gpu.py, _agent_config)."""
import pytest

from zwdx.cli import main


@pytest.mark.parametrize("flags, said", [
    (["--modules-refresh", "-1"], "--modules-refresh must be 0 or more seconds, got -1"),
    (["--cpu-slots", "0"], "--cpu-slots must be at least 1, got 0"),
    (["--outage-tolerance", "0"], "--outage-tolerance (or $ZWDX_OUTAGE_TOLERANCE) must be seconds above 0, got 0"),
    (["--isolation", "process", "--allow-image", "x"], "--allow-image and --container-memory apply to --isolation docker"),
    (["--rank-uids", "9-1"], "zwdx gpu-client: "),
])
def test_a_wrong_flag_is_named_and_nothing_starts(monkeypatch, capsys, flags, said):
    monkeypatch.setenv("ZWDX_ROOM_TOKEN", "zd_not_checked_before_the_flags")
    assert main(["gpu-client", "--server", "http://127.0.0.1:9", *flags]) == 2
    assert said in capsys.readouterr().err


def test_without_a_token_it_says_how_to_give_one(monkeypatch, capsys):
    monkeypatch.delenv("ZWDX_ROOM_TOKEN", raising=False)
    monkeypatch.delenv("ZWDX_ROOM_TOKEN_FILE", raising=False)
    assert main(["gpu-client", "--server", "http://127.0.0.1:9"]) == 2
    assert "the room's donor token is required: --room-token-file FILE, or $ZWDX_ROOM_TOKEN" in capsys.readouterr().err
