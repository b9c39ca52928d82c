#!/usr/bin/env bash
# Lend this machine's GPUs to a zwdx room.
#
#   gpu_client/run_gpu_client.sh --room-token-file FILE [-s URL] [--native] [--image NAME] [--build] [ARGS...]
#
#   --room-token-file FILE    a file holding the room's donor token (default: $ZWDX_ROOM_TOKEN)
#   -rt, --room-token TOKEN   the token itself: warns, as every user of the machine can read a command line
#   -s,  --server URL         the zwdx server (default: $ZWDX_SERVER_URL or http://localhost:4461)
#   --native                  run the plain process (python -m zwdx.cli gpu-client), even with Docker
#   --image NAME              the image to run (default: zwdx-gpu-client, built here if missing)
#   --name NAME               the container's name (docker logs NAME, docker stop NAME)
#   --build                   build the image again first
#   ARGS                      passed on to `zwdx gpu-client` (--gpus 0,1, --client-id ID, --cpu, ...)
#
# Docker is used when `docker info` answers (an engine runs), else the native process. In Docker:
# every GPU (--gpus all) when nvidia-smi sees one, the host's network (the other GPU clients of a
# job reach this one's rendezvous port and NCCL), no host directory mounted. The token travels in
# the environment, never on a command line (as it does to the native process).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
SERVER=${ZWDX_SERVER_URL:-http://localhost:4461}
TOKEN=${ZWDX_ROOM_TOKEN:-}
IMAGE=${ZWDX_GPU_CLIENT_IMAGE:-zwdx-gpu-client}
NAME=
NATIVE=0
BUILD=0
PASS=()

usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed -E 's/^# ?//'; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "run_gpu_client.sh: $1 needs a value" >&2; exit 2; }; }

while (($#)); do
    case "$1" in
        -rt | --room-token) need "$@"; TOKEN=$2; shift 2
            echo "run_gpu_client.sh: a token on the command line can be read by every user of this machine" \
                 "(ps): pass --room-token-file FILE or \$ZWDX_ROOM_TOKEN instead" >&2 ;;
        --room-token-file) need "$@"
            [[ -r "$2" ]] || { echo "run_gpu_client.sh: cannot read the room token file $2" >&2; exit 2; }
            TOKEN=$(head -n 1 "$2" | tr -d '[:space:]'); shift 2 ;;
        -s | --server) need "$@"; SERVER=$2; shift 2 ;;
        --image) need "$@"; IMAGE=$2; shift 2 ;;
        --name) need "$@"; NAME=$2; shift 2 ;;
        --native) NATIVE=1; shift ;;
        --build) BUILD=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; PASS+=("$@"); break ;;
        *) PASS+=("$1"); shift ;;
    esac
done

if [[ -z "$TOKEN" ]]; then
    echo "run_gpu_client.sh: a room token is required (--room-token-file FILE, or ZWDX_ROOM_TOKEN)" >&2
    exit 2
fi
export ZWDX_ROOM_TOKEN=$TOKEN

if ((!NATIVE)) && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    if ((BUILD)) || ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
        echo "== building $IMAGE (Dockerfile, target gpu-client)" >&2
        docker build --target gpu-client -t "$IMAGE" "$ROOT"
    fi
    RUN=(--rm --init --network host --shm-size 8g -e ZWDX_ROOM_TOKEN)
    [[ -n "$NAME" ]] && RUN+=(--name "$NAME")
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        RUN+=(--gpus all)
    else
        echo "run_gpu_client.sh: no NVIDIA GPU visible; the container offers one CPU slot" >&2
    fi
    [[ -t 0 && -t 1 ]] && RUN+=(-it)
    echo "== gpu client in Docker ($IMAGE) for $SERVER" >&2
    exec docker run "${RUN[@]}" "$IMAGE" gpu-client --server "$SERVER" ${PASS[@]+"${PASS[@]}"}
fi

echo "== gpu client as a native process for $SERVER" >&2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m zwdx.cli gpu-client --server "$SERVER" ${PASS[@]+"${PASS[@]}"}
