#!/usr/bin/env bash
# Install what zwdx needs on this machine, into the project's venv (.venv; the one active, if any;
# PYTHON=... names an interpreter to install into instead), at the versions requirements.lock pins.
#   ./setup.sh          the package, its dependencies and the dashboard's build
#   ./setup.sh --test   also what the test suite needs (pytest, a MongoDB wire-protocol server,
#                       headless Chromium, docker-compose and hadolint to check the Docker files,
#                       redis-server and haproxy for several servers behind a balancer)
# Then: source .venv/bin/activate (run_all.sh uses it by itself). test/lock.sh refreshes the lock.
set -euo pipefail
cd "$(dirname "$0")"

apt_install() {  # Debian packages, waiting for another apt (unattended upgrades) to let go of its lock
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        echo "zwdx setup: please install $* (Debian packages)" >&2
        return 1
    fi
    echo "== zwdx setup: apt-get install $* (waiting up to 5 minutes for apt's lock if another apt holds it)"
    local wait=(-o DPkg::Lock::Timeout=300)
    apt-get "${wait[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${wait[@]}" install -y -qq "$@" >/dev/null \
        || { echo "zwdx setup: apt-get install $* failed (above); if apt's lock is held (another apt-get, unattended-upgrades), wait and run this again" >&2; return 1; }
}

PY=${PYTHON:-}
if [[ -z $PY && -n ${VIRTUAL_ENV:-} ]]; then PY=$VIRTUAL_ENV/bin/python; fi
if [[ -z $PY ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        echo "== zwdx setup: a venv in .venv"
        python3 -m venv .venv 2>/dev/null || { rm -rf .venv; apt_install python3-venv && python3 -m venv .venv; }
    fi
    PY=.venv/bin/python
fi
# every install below is held to the lock's versions (a package the lock lacks: as the ranges say)
PIP=("$PY" -m pip install -q --disable-pip-version-check -c requirements.lock)

echo "== zwdx setup: Python packages ($PY)"
"${PIP[@]}" -r requirements.txt
"${PIP[@]}" --no-deps -e .
if [[ $(id -u) == 0 ]]; then
    # A GPU client run as root runs each job's ranks as an unprivileged user of its own, who must
    # reach Python, zwdx and torch (a Python under /root, as pyenv puts it, is out of reach)
    for dir in $("$PY" -m gpu_client.sandbox.isolation); do
        echo "== zwdx setup: chmod o+x $dir (ranks of jobs run as other users, who must pass it)"
        chmod o+x "$dir"
    done
fi

if [[ "${1:-}" == "--test" ]]; then
    echo "== zwdx setup: test tools"
    "${PIP[@]}" -e ".[test]"
    # what is installed and the lock disagree (a dependency added since the lock was made): say so
    "$PY" - <<'PYCHECK'
import importlib.metadata as md, re
locked = {re.sub(r"[-_.]+", "-", l.split("==")[0]).lower(): l.split("==")[1].strip()
          for l in open("requirements.lock") if "==" in l and not l.startswith("#")}
off = sorted(f"{d.metadata['Name']} {d.version}" for d in md.distributions()
             if (n := re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower()) not in locked and n != "zwdx")
if off:
    print("zwdx setup: not in requirements.lock (refresh it with test/lock.sh):", ", ".join(off))
PYCHECK
    missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v redis-server >/dev/null || missing+=(redis-server)  # test/test_scale.py: the message queue
    command -v haproxy >/dev/null || missing+=(haproxy)  # test/test_scale.py: the balancer
    command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)  # test/test_proxies.py: the TLS proxy
    if (( ${#missing[@]} )); then
        apt_install "${missing[@]}" || echo "zwdx setup: the full test suite needs ${missing[*]}" >&2
    fi
fi

if [[ -f ui/package.json ]]; then
    if command -v npm >/dev/null; then
        echo "== zwdx setup: dashboard (npm ci, vite build)"
        (cd ui && npm ci --no-audit --no-fund --loglevel=error && npm run build --silent)
    else
        echo "zwdx setup: npm not found; the server will run without the dashboard" >&2
    fi
fi
echo "== zwdx setup: done"
