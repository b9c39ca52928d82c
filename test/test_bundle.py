"""The job bundle, packed as the SDK packs it and loaded as a GPU client loads it."""
import hashlib

import torch
import pytest

from zwdx.bundle import load, pack, required_modules, unpack


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.emb.weight  # one parameter, two names
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.register_buffer("bf16", torch.linspace(0, 1, 7, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("empty", torch.zeros(0, 5))
        self.register_buffer("scalar", torch.tensor(3.5, dtype=torch.float64))

    def forward(self, tokens):
        return self.head(self.frozen(self.emb(tokens)))


def train(model, loader):
    return None


def _roundtrip(tmp_path, model, **kwargs):
    blob = pack(model, lambda rank: None, train, **kwargs)
    path = tmp_path / "job.zwdx"
    path.write_bytes(blob)
    return blob, load(str(path), hashlib.sha256(blob).hexdigest())


def test_weights_dtypes_and_tied_parameters_survive(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, bundle = _roundtrip(tmp_path, model, optimizer=optimizer)
    got = bundle["model"]
    assert got.head.weight is got.emb.weight
    for name, tensor in model.state_dict().items():
        assert got.state_dict()[name].dtype == tensor.dtype, name
        assert torch.equal(got.state_dict()[name], tensor), name
    assert isinstance(got.emb.weight, torch.nn.Parameter) and got.emb.weight.requires_grad
    assert not got.frozen.weight.requires_grad
    # loaded from a private map: a rank may train the weights in place
    with torch.no_grad():
        got.frozen.weight.add_(1)
    assert torch.equal(got.frozen.weight, model.frozen.weight + 1)
    # the submitter's model is left as it was
    assert model.head.weight is model.emb.weight and not model.frozen.weight.requires_grad
    # and it still trains
    loss = got(torch.tensor([1, 2])).sum()
    loss.backward()
    assert got.emb.weight.grad is not None


def test_views_and_tensors_in_closures(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t()[1:]  # not contiguous, offset into another tensor's storage
    data = torch.randn(5, 2)

    def loader(rank):
        return data * rank

    blob = pack(torch.nn.Linear(2, 2), loader, train)
    bundle = unpack(blob)
    assert torch.equal(bundle["data_loader_func"](2), data * 2)
    model = torch.nn.Module()
    model.register_buffer("view", view)
    _, bundle = _roundtrip(tmp_path, model)
    assert torch.equal(bundle["model"].view, view)


def test_a_damaged_bundle_is_refused_with_a_reason(tmp_path):
    blob = pack(Tied(), lambda rank: None, train)
    with pytest.raises(ValueError, match="not a zwdx job bundle"):
        unpack(b"\x80\x04not a bundle")
    with pytest.raises(ValueError, match="truncated"):
        unpack(blob[:-200])
    empty = tmp_path / "empty.zwdx"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load(str(empty), hashlib.sha256(b"").hexdigest())


def test_required_modules_are_the_installed_packages_the_pickle_refers_to():
    import json
    import numpy as np
    import sklearn.linear_model
    from sklearn.preprocessing import StandardScaler
    import torch.nn.functional as F

    def uses_packages(model, loader):  # numpy as a module, sklearn by a class and a submodule
        json.dumps([np.pi, StandardScaler.__name__, sklearn.linear_model.__name__, F.relu.__name__])

    def imports_in_its_body(model, loader):  # may never run: not required
        import sklearn.cluster  # noqa: F401

    array = np.arange(3)
    assert required_modules(pack(Tied(), lambda rank: None, uses_packages)) == ["numpy", "sklearn"]
    assert required_modules(pack(Tied(), lambda rank: None, lambda model: array.sum())) == ["numpy"]
    assert required_modules(pack(Tied(), lambda rank: None, imports_in_its_body)) == []
    with pytest.raises(ValueError, match="not a zwdx job bundle"):
        required_modules(b"PK\x03\x04 a zip file")

def test_code_sent_by_value_keeps_its_file_name_and_its_lines_travel_with_it(tmp_path):
    import importlib
    import os
    import subprocess
    import sys
    source = tmp_path / "their_module.py"
    source.write_text("def train(model, loader):\n    total = 0\n    raise RuntimeError('from their code')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        train = importlib.import_module("their_module").train
        blob = pack(torch.nn.Linear(2, 2), lambda rank: None, train)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("their_module", None)
    source.unlink()  # as on a GPU client, which has no copy of the submitter's files
    (tmp_path / "job.zwdx").write_bytes(blob)
    script = ("import traceback, sys\n"
              "from zwdx.bundle import load, register_sources\n"
              "bundle = load(sys.argv[1], sys.argv[2])\n"
              "register_sources(bundle['sources'])\n"
              "try:\n    bundle['train_func'](None, None)\n"
              "except RuntimeError:\n    print(traceback.format_exc())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "job.zwdx"), hashlib.sha256(blob).hexdigest()],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, check=True).stdout
    assert f'File "{source}", line 3, in train' in out
    assert "raise RuntimeError('from their code')" in out


def _write_slowly(path, blob, parts=7, pause=0.01, stop_at=None):
    """The GPU client's fetch as a rank sees it: the file there from the start, growing."""
    import time
    with open(path, "wb") as fh:
        step = len(blob) // parts + 1
        for i in range(0, len(blob) if stop_at is None else stop_at, step):
            fh.write(blob[i:i + step])
            fh.flush()
            time.sleep(pause)


@pytest.mark.parametrize("case", ["whole", "corrupted", "fetch failed", "replaced by a copy"])
def test_a_bundle_is_read_while_it_is_still_being_written(tmp_path, case):
    import threading
    torch.manual_seed(0)
    model = Tied()
    blob = pack(model, lambda rank: None, train)
    path = str(tmp_path / "bundle")
    sha = hashlib.sha256(blob).hexdigest()
    word = {"said": None}
    sent = bytearray(blob)
    if case == "corrupted":
        sent[len(sent) // 2] ^= 1  # a byte changed on the way: the rank's own hash says so

    def agent():
        if case == "replaced by a copy":  # the link failed: an empty copy first, the whole file after the fetch
            open(path, "wb").close()
            import os
            tmp = path + ".whole"
            with open(tmp, "wb") as fh:
                fh.write(sent)
            os.replace(tmp, path)
        else:
            _write_slowly(path, bytes(sent), stop_at=len(sent) // 3 if case == "fetch failed" else None)
        word["said"] = case != "fetch failed"

    writer = threading.Thread(target=agent)
    writer.start()
    try:
        if case in ("whole", "replaced by a copy"):
            got = load(path, sha, len(blob), lambda: word["said"])["model"]
            assert torch.equal(got.emb.weight, model.emb.weight) and got.head.weight is got.emb.weight
        elif case == "corrupted":
            with pytest.raises(ValueError, match="not the job's bundle"):
                load(path, sha, len(blob), lambda: word["said"])
        else:
            with pytest.raises(RuntimeError, match="could not fetch"):
                load(path, sha, len(blob), lambda: word["said"])
    finally:
        writer.join()


def test_a_factorys_closure_and_objects_of_the_submitters_own_modules_travel_by_value(tmp_path):
    """A train function made by a factory of the submitter's module closes over an object of a
    class of theirs holding functions of theirs: none of it may become a package a GPU client
    must have installed (the job would wait forever for one that 'lacks package(s) their_pkg')."""
    import importlib
    import sys
    pkg = tmp_path / "their_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cases.py").write_text(
        "from dataclasses import dataclass\n"
        "def loss(x):\n    return x\n"
        "@dataclass\nclass Case:\n    loss: object\n"
        "CASE = Case(loss)\n")
    (pkg / "jobs.py").write_text(  # the functions a job runs, in another module than the cases
        "from their_pkg.cases import CASE\n"
        "def make_train(case):\n    def train(model, loader):\n        return case.loss(1)\n    return train\n"
        "def uses_a_global(model, loader):\n    return CASE.loss(2)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        jobs = importlib.import_module("their_pkg.jobs")
        by_closure = pack(torch.nn.Linear(2, 2), lambda rank: None, jobs.make_train(jobs.CASE))
        by_global = pack(torch.nn.Linear(2, 2), lambda rank: None, jobs.uses_a_global)
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("their_pkg", "their_pkg.cases", "their_pkg.jobs"):
            sys.modules.pop(name, None)
    assert required_modules(by_closure) == [] and required_modules(by_global) == []
    assert unpack(by_closure)["train_func"](None, None) == 1
    assert unpack(by_global)["train_func"](None, None) == 2


@pytest.mark.parametrize("editable", [False, True])
def test_a_package_installed_outside_site_packages_is_a_package_not_the_submitters_code(tmp_path, editable):
    """``pip install --target DIR`` with ``PYTHONPATH=DIR`` (as on a GPU machine without root):
    the package has no site-packages in its path, but a dist-info says it is installed, so it is
    a package GPU clients must have (by reference), not code of the submitter's to send by value
    (transformers sent so failed: 'cannot pickle _thread.RLock'). An editable install is the
    submitter's own tree: by value, as before."""
    import importlib
    import json
    import sys

    from zwdx import bundle
    site = tmp_path / "site"
    (site / "lent_pkg").mkdir(parents=True)
    (site / "lent_pkg" / "__init__.py").write_text("class Config:\n    def __init__(self):\n        self.n = 3\n")
    info = site / "lent_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lent-pkg\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("lent_pkg\n")
    (info / "RECORD").write_text("lent_pkg/__init__.py,,\n")
    if editable:
        (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))
    sys.path.insert(0, str(site))
    bundle._distributed.cache_clear()
    try:
        lent = importlib.import_module("lent_pkg")
        config = lent.Config()
        packed = pack(torch.nn.Linear(2, 2), lambda rank: None, lambda model, loader: config.n)
        assert bundle.is_user_module(lent) is editable
        assert required_modules(packed) == ([] if editable else ["lent_pkg"])
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("lent_pkg", None)
        bundle._distributed.cache_clear()
