"""Script jobs move plain archives between people who need not trust each other: a submitter's
working dir is unpacked on donors' machines (``gpu_client.rank.script.unpack``), a job's outputs,
written by code running on a donor, are unpacked on the submitter's (``zwdx.script_jobs.
extract_outputs``). Each archive below tries to write outside the folder it is unpacked into,
or to make what a plain file is not; each is refused, naming the entry, and nothing lands
outside the folder (an absolute name lands inside it, its leading ``/`` dropped)."""
from __future__ import annotations

import io
import os
import tarfile

import pytest

from gpu_client.rank.script import unpack
from zwdx.errors import ZwdxError
from zwdx.script_jobs import extract_outputs


def archive(path, *entries, gz: bool = False) -> str:
    """A tar at ``path`` of (TarInfo fields, content) entries."""
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for fields, data in entries:
            info = tarfile.TarInfo(fields["name"])
            for key, value in fields.items():
                setattr(info, key, value)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return str(path)


FILE = ({"name": "train.py"}, b"print('hi')\n")
ATTACKS = {
    "parent folder": ({"name": "../owned.py"}, b"x"),
    "deep parent": ({"name": "ok/../../owned.py"}, b"x"),
    "symlink out": ({"name": "secrets", "type": tarfile.SYMTYPE, "linkname": "/etc"}, None),
    "symlink up": ({"name": "up", "type": tarfile.SYMTYPE, "linkname": "../../.."}, None),
    "hard link out": ({"name": "passwd", "type": tarfile.LNKTYPE, "linkname": "/etc/passwd"}, None),
    "device": ({"name": "mem", "type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 1}, None),
}


def outside(base) -> list[str]:
    """What is in ``base`` beside the folder things were unpacked into ("into") and the archive."""
    return sorted(n for n in os.listdir(base) if n not in ("into", "a.tar", "a.tar.gz"))


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_working_dir_that_reaches_out_of_its_folder_is_refused_on_the_donor(tmp_path, attack):
    path = archive(tmp_path / "a.tar.gz", FILE, ATTACKS[attack], gz=True)
    with pytest.raises(ValueError) as err:
        unpack(path, str(tmp_path / "into"))
    assert "the working dir's archive is refused" in str(err.value)
    assert outside(tmp_path) == [] and not os.path.exists("/tmp/zwdx-owned.py")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_outputs_that_reach_out_of_their_folder_are_refused_on_the_submitters_machine(tmp_path, attack):
    path = archive(tmp_path / "a.tar", FILE, ATTACKS[attack])
    with pytest.raises(ZwdxError) as err:
        extract_outputs(path, str(tmp_path / "into"))
    assert "the job's outputs are refused" in str(err.value)
    assert outside(tmp_path) == [] and not os.path.exists("/tmp/zwdx-owned.py")


def test_plain_outputs_and_links_inside_them_come_back(tmp_path):
    path = archive(tmp_path / "a.tar", FILE, ({"name": "ckpt/last.pt", "mode": 0o4755}, b"weights"),
                   ({"name": "latest.pt", "type": tarfile.SYMTYPE, "linkname": "ckpt/last.pt"}, None),
                   ({"name": "/tmp/zwdx-owned.py"}, b"x"))
    assert extract_outputs(path, str(tmp_path / "into")) == ["ckpt/last.pt", "tmp/zwdx-owned.py", "train.py"]
    into = tmp_path / "into"
    assert (into / "latest.pt").read_bytes() == b"weights"
    assert outside(tmp_path) == [] and not os.path.exists("/tmp/zwdx-owned.py")
    assert not os.stat(into / "ckpt" / "last.pt").st_mode & 0o4000  # no set-uid bit survives
    with pytest.raises(ZwdxError, match="not a tar"):
        extract_outputs(str(tmp_path / "into" / "train.py"), str(tmp_path / "other"))
