"""A tar from the wire is unpacked with tarfile's data filter or not at all, on both sides: a
script job's working dir on a GPU client (``gpu_client.rank.script.unpack``) and a job's outputs on
the submitter's (``zwdx.script_jobs.extract_outputs``), through one check (``zwdx.archives``)."""
from __future__ import annotations

import io
import os
import tarfile

import pytest

from gpu_client.rank.script import unpack
from zwdx.errors import ZwdxError
from zwdx.script_jobs import extract_outputs


def _tar(path, names) -> str:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    return str(path)


def test_without_the_data_filter_neither_side_unpacks_anything(tmp_path, monkeypatch):
    archive = _tar(tmp_path / "a.tar", ["train.py"])
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(RuntimeError, match=r"^gpu-1: its Python \S+ lacks tarfile's data filter \(3\.10\.12, 3\.11\.4 "
                                           r"and later have it\): it does not unpack working dirs$"):
        unpack(archive, str(tmp_path / "tree"), "gpu-1")
    with pytest.raises(ZwdxError, match=r"^Python \S+ lacks tarfile's data filter .*: zwdx does not unpack a job's "
                                        r"outputs without it$"):
        extract_outputs(archive, str(tmp_path / "outputs"))
    assert not os.path.exists(tmp_path / "tree") and not os.path.exists(tmp_path / "outputs")


def test_with_it_an_entry_out_of_the_folder_is_refused_on_both_sides(tmp_path):
    archive = _tar(tmp_path / "a.tar", ["ok.txt", "../out.txt"])
    with pytest.raises(ValueError, match="working dir's archive is refused"):
        unpack(archive, str(tmp_path / "tree"))
    with pytest.raises(ZwdxError, match="outputs are refused"):
        extract_outputs(archive, str(tmp_path / "outputs"))
    assert not os.path.exists(tmp_path / "out.txt")
    assert extract_outputs(_tar(tmp_path / "b.tar", ["a/b.txt"]), str(tmp_path / "fine")) == ["a/b.txt"]
