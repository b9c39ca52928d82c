"""The pinned environment (requirements.lock, made by test/lock.sh) and what the bench hosts
install (bench/requirements.txt, made from it): nothing the code imports is left out, and both
pin the same versions."""
from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: not for the bench's requirements: the host brings torch (and its own deps); ours are the packages
HOST = {"torch", "zwdx", "gpu_client", "bench", "triton"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str) -> dict[str, str]:
    with open(os.path.join(ROOT, path)) as fh:
        return {_norm(line.split("==")[0]): line.split("==")[1].strip() for line in fh
                if "==" in line and not line.lstrip().startswith("#")}


def module_level_imports(paths: list[str]) -> set[str]:
    """Top-level packages imported at module level (what importing the module needs), not
    those imported inside functions (optional extras: trackers, peft, s3fs)."""
    found = set()
    for path in paths:
        tree = ast.parse(open(path).read(), path)
        nodes = list(tree.body)
        while nodes:
            node = nodes.pop()
            if isinstance(node, (ast.Try, ast.If)):  # `try: import x` at module level still runs
                nodes += node.body + [s for h in getattr(node, "handlers", []) for s in h.body] + node.orelse
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - HOST


def sources(*dirs: str) -> list[str]:
    out = []
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            out += [os.path.join(base, f) for f in files if f.endswith(".py")]
    return out


def test_the_bench_requirements_name_what_the_server_clients_and_bench_import():
    owners = md.packages_distributions()
    bench = set(pins("bench/requirements.txt"))
    missing = {}
    for module in module_level_imports(sources("zwdx", "gpu_client") + [
            os.path.join(ROOT, "bench", f) for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")]):
        dists = {_norm(d) for d in owners.get(module, [])}
        if dists and not dists & bench and not dists & HOST:
            missing[module] = sorted(dists)
    assert not missing, f"bench/requirements.txt lacks what these imports need (test/lock.sh makes it): {missing}"


def test_the_bench_pins_what_the_lock_pins():
    lock, bench = pins("requirements.lock"), pins("bench/requirements.txt")
    differ = {name: (version, lock.get(name)) for name, version in bench.items() if name in lock and lock[name] != version}
    assert not differ, f"bench/requirements.txt and requirements.lock disagree (run test/lock.sh): {differ}"


def test_the_lock_pins_every_requirement_of_the_project():
    lock = pins("requirements.lock")
    wanted = set()
    for extra in (None, "test", "example"):
        for req in md.requires("zwdx") or []:
            name, _, marker = req.partition(";")
            if (extra is None and "extra" not in marker) or f'extra == "{extra}"' in marker:
                wanted.add(_norm(re.split(r"[<>=!~\[ ]", name.strip())[0]))
    assert not wanted - set(lock), f"requirements.lock lacks {sorted(wanted - set(lock))} (run test/lock.sh)"
