# zwdx images. One Dockerfile, three stages:
#
#   docker build -t zwdx-gpu-client .                  # the default: lends this host's GPUs
#   docker build --target server -t zwdx-server .      # API, Socket.IO and the dashboard
#
# Both run as the unprivileged user "zwdx" (uid 10001) and take `zwdx` CLI arguments. Nothing of
# the host is mounted unless you add a volume yourself; docker-compose.yml mounts named volumes
# on /room (the server image: a room's tokens) and /home/zwdx/.zwdx (the GPU client's work dir),
# which exist here owned by zwdx so that fresh volumes start writable. See docs/docker.md.
#
# The GPU client runs on an official PyTorch CUDA runtime image. Its Python minor version must
# match the submitters' (cloudpickled code needs it); pick another tag with
#   --build-arg TORCH_IMAGE=pytorch/pytorch:<torch>-cuda<cuda>-cudnn9-runtime
ARG TORCH_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
ARG SERVER_IMAGE=python:3.11-slim-bookworm

# -- the dashboard's production build (ui/dist) ---------------------------------------------------
FROM node:22-bookworm-slim AS ui
WORKDIR /ui
COPY ui/package.json ui/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY ui/ ./
RUN npm run build

# -- the server: no torch, no GPU; the dashboard next to the code (UI_DIST = /opt/zwdx/ui/dist) ---
FROM ${SERVER_IMAGE} AS server
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/opt/zwdx ZWDX_DATA_DIR=/data
WORKDIR /opt/zwdx
COPY requirements.txt ./
RUN sed -E '/^(torch|nvidia-ml-py)([=<>~ ]|$)/d' requirements.txt > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin zwdx \
    && mkdir /data /room && chown zwdx:zwdx /data /room
COPY zwdx/ zwdx/
COPY --from=ui /ui/dist/ ui/dist/
USER 10001:10001
EXPOSE 4461
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:4461/health', timeout=4)"]
ENTRYPOINT ["python", "-m", "zwdx.cli"]
CMD ["server", "--host", "0.0.0.0", "--port", "4461"]

# -- the GPU client (default target) -------------------------------------------------------------
FROM ${TORCH_IMAGE} AS gpu-client
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/opt/zwdx
WORKDIR /opt/zwdx
COPY requirements.txt ./
# torch is the base image's CUDA build: install everything else.
RUN sed -E '/^torch([=<>~ ]|$)/d' requirements.txt > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin zwdx \
    && mkdir /home/zwdx/.zwdx && chown zwdx:zwdx /home/zwdx/.zwdx
COPY zwdx/ zwdx/
COPY gpu_client/ gpu_client/
USER 10001:10001
WORKDIR /home/zwdx
# healthy: the server acknowledged a heartbeat lately (gpu_client/agent/health.py; default work dir)
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s CMD ["python", "-m", "gpu_client.agent.health"]
ENTRYPOINT ["python", "-m", "zwdx.cli"]
CMD ["gpu-client", "--help"]
