"""The server's settings (zwdx/server/settings.py): typed, checked once as the app is made,
from the defaults, ``ZWDX_<KEY>`` and create_app's mapping, in that order."""
import pytest
from pydantic import ValidationError

from zwdx import defaults
from zwdx.server import create_app


@pytest.fixture
def make(tmp_path):
    made = []

    def make_app(**config):
        app = create_app({"DATA_DIR": str(tmp_path / "data"), "SCHEDULER": False, **config})
        made.append(app)
        return app
    yield make_app
    for app in made:
        app.extensions["zwdx"].close()


@pytest.mark.parametrize("variable, value, expected", [
    ("ZWDX_CLIENT_TIMEOUT", "soon", "valid number"),
    ("ZWDX_MAX_ARTIFACT_BYTES", "12XB", "is not a size (8GiB, 512MB, 1000000)"),
    ("ZWDX_RATE_LIMIT_ROOMS", "lots", "expected a rate"),
    ("ZWDX_ROOM_MAX_JOBS", "-1", "greater than or equal to 0"),
])
def test_a_bad_value_stops_the_start_naming_it(make, monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as refused:
        make()
    assert variable in str(refused.value) and expected in str(refused.value) and value in str(refused.value)


def test_defaults_then_the_environment_then_the_mapping(make, monkeypatch):
    monkeypatch.setenv("ZWDX_CLIENT_TIMEOUT", "3")
    monkeypatch.setenv("ZWDX_START_TRIES", "5")
    monkeypatch.setenv("ZWDX_MIN_FREE_BYTES", "2MiB")
    settings = make(START_TRIES=7).extensions["zwdx"].settings
    assert (settings.client_timeout, settings.start_tries, settings.min_free_bytes) == (3.0, 7, 2 * 2**20)
    assert settings.reserve_timeout == defaults.RESERVE_TIMEOUT
    with pytest.raises(ValidationError):
        settings.client_timeout = 1.0  # frozen: a change goes through reconfigure, checked


def test_a_change_while_running_is_checked_and_mirrored(make):
    app = make()
    ctx = app.extensions["zwdx"]
    assert ctx.reconfigure(START_TIMEOUT="0.5").start_timeout == 0.5 and app.config["START_TIMEOUT"] == 0.5
    with pytest.raises(ValueError, match="START_TRIES"):
        ctx.reconfigure(START_TRIES="twice")
    assert ctx.settings.start_tries == defaults.START_TRIES


def test_a_key_not_yet_declared_still_reads_from_the_environment(make, monkeypatch):
    monkeypatch.setenv("ZWDX_A_NEW_KNOB", "0.5")  # a module's own setting, before ServerConfig declares it
    assert make().config["A_NEW_KNOB"] == 0.5
    assert make(A_NEW_KNOB=2).config["A_NEW_KNOB"] == 2


#: The flags ``zwdx server`` took, each declared by hand beside its setting, before they were
#: declared with it (zwdx/server_limits.py): every one is still there.
EARLIER_FLAGS = {"max_request_bytes", "room_max_jobs", "room_max_artifact_bytes", "rate_limit_rooms",
                 "rate_limit_auth_failures", "artifact_retention", "sweep_interval", "start_timeout", "start_tries",
                 "donor_max_clients", "client_max_slots", "rate_limit_registers", "room_max_events",
                 "rate_limit_events", "max_series_points", "min_free_bytes", "client_retention",
                 "header_timeout", "idle_timeout", "body_timeout", "max_connections_per_address",
                 "socket_sessions_per_address", "socket_auth_timeout", "proxy_hops"}
#: What a flag is given on the command line and what its setting then is, by the field's type.
GIVEN = {"Seconds": ("7.5", 7.5), "Count": ("7", 7), "Size": ("3MiB", 3 * 2**20), "Rate": ("3 per minute", "3 per minute")}


def test_every_setting_with_a_flag_parses_from_the_command_line():
    from zwdx import cli, server_limits, sizes
    from zwdx.server.settings import ServerConfig
    flagged = server_limits.flags()
    assert set(flagged) == EARLIER_FLAGS
    kinds = {float: "Seconds", int: "Count", sizes.argument: "Size", str: "Rate"}
    for name, flag in flagged.items():
        assert name in ServerConfig.model_fields
        text, expected = GIVEN[kinds[flag.type]]
        args = cli.build_parser().parse_args(["server", "--" + name.replace("_", "-"), text])
        values = server_limits.flag_values(args)
        assert values == {name.upper(): expected}, name
        assert getattr(ServerConfig.from_sources(values), name) == expected, name
    unset = cli.build_parser().parse_args(["server"])
    assert server_limits.flag_values(unset) == {}  # left to ZWDX_<NAME>, else the defaults
