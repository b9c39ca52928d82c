"""The dashboard tests' fakes answer as the server does: ``ui/src/test/wire.json`` (what
``ui/src/test/wire.js`` checks every fake answer and event against) is what ``test/ui_wire.py``
makes from the server's OpenAPI document and Socket.IO catalog."""
from __future__ import annotations

import subprocess
import sys

import ui_wire


def test_the_checked_in_file_is_what_the_server_sends():
    with open(ui_wire.PATH, encoding="utf-8") as fh:
        checked_in = fh.read()
    assert checked_in == ui_wire.render(), (
        f"ui/src/test/wire.json differs from the server's messages: run `{ui_wire.COMMAND}` and commit the file")


def test_check_fails_on_a_stale_file_and_says_how_to_regenerate(tmp_path):
    stale = tmp_path / "wire.json"
    stale.write_text(ui_wire.render().replace('"memory_free"', '"memory_available"'))
    done = subprocess.run([sys.executable, ui_wire.__file__, "--check", "--path", str(stale)], cwd=ui_wire.ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and ui_wire.COMMAND in done.stderr, done.stderr
    subprocess.run([sys.executable, ui_wire.__file__, "--path", str(stale)], cwd=ui_wire.ROOT, check=True,
                   capture_output=True)
    assert stale.read_text() == ui_wire.render()
