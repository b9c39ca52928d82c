#!/usr/bin/env bash
# Install what zwdx needs on this machine.
#   ./setup.sh          the package, its dependencies and the dashboard's build
#   ./setup.sh --test   also what the test suite needs (pytest, a MongoDB wire-protocol server,
#                       headless Chromium, docker-compose and hadolint to check the Docker files,
#                       redis-server and haproxy for several servers behind a balancer)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

echo "== zwdx setup: Python packages"
"$PY" -m pip install -q --disable-pip-version-check -r requirements.txt
"$PY" -m pip install -q --disable-pip-version-check --no-deps -e .
if [[ $(id -u) == 0 ]]; then
    # A GPU client run as root runs each job's ranks as an unprivileged user of its own, who must
    # reach Python, zwdx and torch (a Python under /root, as pyenv puts it, is out of reach)
    for dir in $("$PY" -m gpu_client.isolation); do
        echo "== zwdx setup: chmod o+x $dir (ranks of jobs run as other users, who must pass it)"
        chmod o+x "$dir"
    done
fi

if [[ "${1:-}" == "--test" ]]; then
    echo "== zwdx setup: test tools"
    "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
    missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v redis-server >/dev/null || missing+=(redis-server)  # test/test_scale.py: the message queue
    command -v haproxy >/dev/null || missing+=(haproxy)  # test/test_scale.py: the balancer
    if (( ${#missing[@]} )); then
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            echo "zwdx setup: please install ${missing[*]} (Debian packages) for the full test suite" >&2
        fi
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
