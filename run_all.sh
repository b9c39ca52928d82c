#!/usr/bin/env bash
# ./run_all.sh           install, bring up a zwdx server on the embedded store with two local GPU
#                        clients (CPU slots when there is no GPU), run the MNIST example job to the
#                        end, print its results, and stop everything.
# ./run_all.sh --tests   install the test tools and run the whole test suite: the manual's build,
#                        the dashboard's component tests, the fast lane, then the slow lane; each
#                        lane's time and the total are printed at the end.
set -euo pipefail
cd "$(dirname "$0")"
# the interpreter setup.sh installs into: PYTHON if given, else the active venv, else the project's .venv
PY=${PYTHON:-}
if [[ -z $PY && -n ${VIRTUAL_ENV:-} ]]; then PY=$VIRTUAL_ENV/bin/python; fi
PY=${PY:-$PWD/.venv/bin/python}
[[ $PY == */* ]] && export PATH="$(dirname "$PY"):$PATH"  # its zwdx command, and python3 for anything that asks

if [[ "${1:-}" == "--tests" ]]; then
    # Lanes, each timed: setup, the dashboard's component tests, the fast lane (in-process, no
    # process started), then the slow lane (real servers, GPU clients, browser). The first lane
    # that fails stops the run. Arguments after --tests go to both pytest lanes.
    timings=()
    started=$SECONDS
    summary() {
        echo "== test times: ${timings[*]:-} total $((SECONDS - started)) s"
    }
    trap summary EXIT
    lane() {  # lane NAME COMMAND...: run it, note its time
        local name=$1 t0=$SECONDS status=0
        shift
        echo "== $name"
        "$@" || status=$?
        # a narrowed run (-k, a path) may leave a lane with nothing to run: pytest's 5 is fine then
        if (( status == 5 )) && (( ${#extra[@]} )); then status=0; fi
        local took="$name $((SECONDS - t0)) s"
        if (( status )); then took+=" (failed)"; fi
        timings+=("$took;")
        return $status
    }
    extra=("${@:2}")
    lane setup ./setup.sh --test
    # the manual (mkdocs.yml): a broken link, a missing page or a stale API reference fails the build
    lane "docs (mkdocs build --strict)" env NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict -q \
        --site-dir "$(mktemp -d -t zwdx-site-XXXX)"
    # pyproject's [tool.ruff] and [tool.mypy]: the linter over the tree, the type checker over its files
    lane "lint (ruff, mypy)" bash -c '"$0" -m ruff check --quiet . && "$0" -m mypy' "$PY"
    if [[ -f ui/package.json ]]; then
        lane "dashboard (vitest)" bash -c "cd ui && npm test --silent"
    fi
    lane "fast lane (pytest -m 'not slow')" "$PY" -m pytest -m "not slow" "${extra[@]}"
    # two workers: most of a slow test is waiting (processes starting, heartbeats, timeouts), so two
    # overlap well on two cores; a file's tests stay together on one worker (test/conftest.py)
    lane "slow lane (pytest -m slow)" "$PY" -m pytest -m slow -n 2 --dist loadgroup --durations=30 "${extra[@]}"
    exit 0
fi

./setup.sh
PORT=${ZWDX_PORT:-4461}
DATA=${ZWDX_DATA_DIR:-$(mktemp -d -t zwdx-demo-XXXX)}
URL="http://127.0.0.1:$PORT"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== starting the server on $URL (data in $DATA)"
"$PY" -m zwdx.cli server --port "$PORT" --data-dir "$DATA" > "$DATA/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do curl -sf "$URL/health" >/dev/null && break; sleep 0.2; done
curl -sf "$URL/health" >/dev/null || { cat "$DATA/server.log"; exit 1; }

# the tokens go to files (0600), never on a command line, where every user of the machine reads them
(umask 077 && "$PY" -m zwdx.cli room create --server "$URL" --name demo --json > "$DATA/room.json")
token() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$DATA/room.json" "$1"; }
(umask 077 && token submitter_token > "$DATA/room-token" && token donor_token > "$DATA/donor-token")
echo "== room created; dashboard: $URL (sign in with the token in $DATA/room-token)"

CPU_FLAG=--cpu
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then CPU_FLAG=; fi
for i in 1 2; do
    GPUS=()
    [[ -z "$CPU_FLAG" ]] && GPUS=(--gpus $((i - 1)))
    "$PY" -m zwdx.cli gpu-client --server "$URL" --room-token-file "$DATA/donor-token" $CPU_FLAG "${GPUS[@]}" --threads 1 \
        --work-dir "$DATA/gpu-client-$i" > "$DATA/gpu-client-$i.log" 2>&1 &
    pids+=($!)
done

echo "== submitting the MNIST example (DDP, 2 ranks)"
ZWDX_ROOM_TOKEN=$(cat "$DATA/room-token") "$PY" test/mnist.py --server "$URL" --world-size 2 --epochs 3
