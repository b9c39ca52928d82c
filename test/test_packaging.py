"""The wheel carries the dashboard: a server installed from it, away from any source checkout,
serves the dashboard with no Node; --ui-dir and ZWDX_UI_DIR point it at another build; a
build with neither a dashboard build nor npm stops and says what to do."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import requests

from procs import ROOT, Server, build_ui

pytestmark = pytest.mark.slow  # builds a wheel, installs it, starts servers from it

#: What a source checkout holds that a package build must not need.
_NOT_SOURCE = shutil.ignore_patterns(".git", "node_modules", "build", "*.egg-info", "__pycache__", "zwdx-data",
                                     "test-artifacts", ".pytest_cache", ".venv")


def source_copy(dest: str, with_dashboard_build: bool) -> str:
    """The repository's files in ``dest`` (pip builds in place: the checkout stays untouched)."""
    shutil.copytree(ROOT, dest, ignore=_NOT_SOURCE)
    if not with_dashboard_build:
        shutil.rmtree(os.path.join(dest, "ui", "dist"), ignore_errors=True)
    return dest


def pip_wheel(src: str, out: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", out], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from a copy of the repository (with ui/dist fresh), and zwdx installed
    from it into a folder of its own."""
    build_ui()
    tmp = tmp_path_factory.mktemp("wheel")
    done = pip_wheel(source_copy(str(tmp / "src"), with_dashboard_build=True), str(tmp / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = glob.glob(str(tmp / "out" / "zwdx-*.whl"))
    target = str(tmp / "site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
                    "--target", target, wheel], check=True, capture_output=True, timeout=300)
    return wheel, target


def installed_server(target: str, data_dir: str, extra=None, env=None) -> Server:
    """`python -m zwdx.cli server` from the installed copy, run from a folder without zwdx in it."""
    cwd = os.path.join(data_dir, "elsewhere")
    os.makedirs(cwd, exist_ok=True)
    env = {"PYTHONPATH": target, **(env or {})}
    where = subprocess.run([sys.executable, "-c", "import zwdx; print(zwdx.__file__)"], cwd=cwd, env={**os.environ, **env},
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(target), where  # not the checkout's zwdx
    return Server(data_dir, extra=extra, env=env, cwd=cwd)


def test_the_wheel_carries_the_built_dashboard(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "zwdx/server/ui_dist/index.html" in names
    assets = [n for n in names if n.startswith("zwdx/server/ui_dist/assets/")]
    assert any(n.endswith(".js") for n in assets) and any(n.endswith(".css") for n in assets)
    assert not [n for n in names if "node_modules" in n or n.startswith("ui/")]


def test_a_server_installed_from_the_wheel_serves_the_dashboard(installed, tmp_path):
    _, target = installed
    server = installed_server(target, str(tmp_path / "packaged"))
    try:
        page = requests.get(f"{server.url}/", timeout=10)
        assert page.status_code == 200 and '<div id="root">' in page.text and "/assets/" in page.text
        script = page.text.split('src="', 1)[1].split('"', 1)[0]
        assert requests.get(f"{server.url}{script}", timeout=10).status_code == 200
        assert requests.get(f"{server.url}/jobs/abc", timeout=10).text == page.text  # client-side routes
    finally:
        server.stop()


def test_ui_dir_and_zwdx_ui_dir_point_the_server_at_another_build(installed, tmp_path):
    _, target = installed
    for name in ("flag", "env"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.html").write_text(f"<!doctype html><p>dashboard from the {name}</p>")
    by_flag = installed_server(target, str(tmp_path / "s1"), extra=["--ui-dir", str(tmp_path / "flag")],
                               env={"ZWDX_UI_DIR": str(tmp_path / "env")})
    try:
        assert "dashboard from the flag" in requests.get(f"{by_flag.url}/", timeout=10).text
    finally:
        by_flag.stop()
    by_env = installed_server(target, str(tmp_path / "s2"), env={"ZWDX_UI_DIR": str(tmp_path / "env")})
    try:
        assert "dashboard from the env" in requests.get(f"{by_env.url}/", timeout=10).text
    finally:
        by_env.stop()


def test_a_build_without_the_dashboard_build_or_npm_stops_and_says_what_to_do(tmp_path):
    src = source_copy(str(tmp_path / "src"), with_dashboard_build=False)
    no_npm = {"PATH": os.path.dirname(sys.executable)}
    done = pip_wheel(src, str(tmp_path / "out"), env=no_npm)
    assert done.returncode != 0
    assert "the dashboard is not built (no ui/dist/index.html) and npm is missing" in done.stdout + done.stderr
    done = pip_wheel(src, str(tmp_path / "out"), env={**no_npm, "ZWDX_BUILD_WITHOUT_DASHBOARD": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = glob.glob(str(tmp_path / "out" / "zwdx-*.whl"))
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "ui_dist" in n]


def test_the_server_starts_where_the_gpu_client_is_not_installed(monkeypatch):
    """The server image (Dockerfile's server target) copies zwdx/ alone: ``zwdx server``'s parser
    must not need gpu_client (the gpu-client subcommand's tuning flags once imported it, and the
    server container never became healthy)."""
    import sys
    for name in [n for n in sys.modules if n == "gpu_client" or n.startswith("gpu_client.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "gpu_client", None)  # import gpu_client: ModuleNotFoundError
    from zwdx import cli
    args = cli.build_parser().parse_args(["server", "--port", "4461"])
    assert args.port == 4461
