"""The dashboard tests' fakes answer as the server does: ``ui/src/test/wire.json`` (what
``ui/src/test/wire.js`` checks every fake answer and event against) is what ``test/ui_wire.py``
makes from the server's OpenAPI document and Socket.IO catalog."""
from __future__ import annotations

import ui_wire


def test_the_checked_in_file_is_what_the_server_sends():
    with open(ui_wire.PATH, encoding="utf-8") as fh:
        checked_in = fh.read()
    assert checked_in == ui_wire.render(), (
        f"ui/src/test/wire.json differs from the server's messages: run `{ui_wire.COMMAND}` and commit the file")


def test_check_fails_on_a_stale_file_and_says_how_to_regenerate(tmp_path, capsys):
    stale = tmp_path / "wire.json"
    stale.write_text(ui_wire.render().replace('"memory_free"', '"memory_available"'))
    assert ui_wire.main(["--check", "--path", str(stale)]) == 1
    assert ui_wire.COMMAND in capsys.readouterr().err
    assert ui_wire.main(["--path", str(stale)]) == 0
    assert stale.read_text() == ui_wire.render()
    assert ui_wire.main(["--check", "--path", str(stale)]) == 0
