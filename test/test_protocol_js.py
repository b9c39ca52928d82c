"""The dashboard's vocabulary (ui/src/lib/protocol.js) is the one of zwdx/protocol/vocab.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import needs
from zwdx.protocol import ACTIVE, FINISHED, SYSTEM_METRICS, UI_NAMESPACE, WAITING, js, vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_checked_in_file_is_what_the_module_makes():
    with open(js.PATH, encoding="utf-8") as fh:
        checked_in = fh.read()
    assert checked_in == js.render(), (
        f"ui/src/lib/protocol.js differs from zwdx/protocol/vocab.py: run `{js.COMMAND}` and commit the file")


def test_check_fails_on_a_stale_file_and_says_how_to_regenerate(tmp_path):
    stale = tmp_path / "protocol.js"
    stale.write_text(js.render().replace('"resuming"', '"paused"'))
    done = subprocess.run([sys.executable, "-m", "zwdx.protocol.js", "--check", "--path", str(stale)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and js.COMMAND in done.stderr
    subprocess.run([sys.executable, "-m", "zwdx.protocol.js", "--path", str(stale)], cwd=ROOT, check=True,
                   capture_output=True)
    assert stale.read_text() == js.render()


def test_javascript_sees_every_enum_and_group_frozen():
    """What the module exports, as Node reads it: every enum of vocab.py with its values, the
    status groups, and all of them frozen."""
    node = needs.tool("node", "install Node 20 (it builds the dashboard too)")
    script = ("import * as p from './ui/src/lib/protocol.js';"
              "const frozen = Object.fromEntries(Object.entries(p).map(([k, v]) => [k, Object.isFrozen(v)]));"
              "console.log(JSON.stringify({values: p, frozen}));")
    done = subprocess.run([node, "--input-type=module", "-e", script], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    seen = json.loads(done.stdout)
    enums = [e for e in vars(vocab).values() if isinstance(e, type) and issubclass(e, vocab.Enum)
             and e.__module__ == vocab.__name__]
    assert {"JobStatus", "RankStatus", "SlotKind", "ClientStatus", "EventKind"} <= {e.__name__ for e in enums}
    for enum in enums:
        assert seen["values"][enum.__name__] == {m.name: m.value for m in enum}, enum.__name__
    for name, group in [("FINISHED", FINISHED), ("ACTIVE", ACTIVE), ("WAITING", WAITING)]:
        assert sorted(seen["values"][name]) == sorted(s.value for s in group), name
    assert seen["values"]["SYSTEM_METRICS"] == list(SYSTEM_METRICS)
    assert seen["values"]["UI_NAMESPACE"] == UI_NAMESPACE
    assert all(seen["frozen"].values()), seen["frozen"]
