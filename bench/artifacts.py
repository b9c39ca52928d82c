"""Artifacts: upload and download of a large weights file through the server.

    python bench/artifacts.py --size-mb 1024 --store sqlite,mongo --out $OUT/artifacts.md

For each store it starts a fresh server, uploads a file of ``--size-mb`` (random bytes, sent
with Content-Length as the runner sends weights) to ``POST /api/v1/artifacts``, downloads it
back from ``GET /api/v1/artifacts/<id>`` checking the sha256, and samples the server's
resident memory all the while. It reports MB/s each way and the server's memory before, at its
peak (sampled, and the kernel's high-water mark) and after: flat memory means it streamed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import MongoProc, Sampler, ServerProc, proc_status, table  # noqa: E402

MB = 1_000_000
CHUNK = 1024 * 1024


def make_file(path: str, size: int) -> str:
    """A file of ``size`` random-looking bytes (a 16 MiB random block, repeated); its sha256."""
    block = os.urandom(16 * CHUNK)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        left = size
        while left:
            part = block[:min(left, len(block))]
            fh.write(part)
            digest.update(part)
            left -= len(part)
    return digest.hexdigest()


def bench_store(store: str, path: str, size: int, sha: str, work: str, data_root: str) -> dict:
    import requests

    from zwdx import defaults
    mongo = None
    if store == "mongo":
        if not harness.mongo_store_available():
            return {"store": store, "pending": "zwdx/server/store/mongo.py is not there yet"}
        mongo = MongoProc(work)
    server, data_dir = None, tempfile.mkdtemp(prefix=f"zwdx-bench-server-{store}-", dir=data_root)
    try:
        server = ServerProc(data_dir, mongo_uri=mongo.uri if mongo else None)
        session = requests.Session()
        token = session.post(f"{server.url}{defaults.API_PREFIX}/rooms", json={"name": "bench"}).json()["token"]
        session.headers[defaults.TOKEN_HEADER] = token
        idle = proc_status(server.pid)["VmRSS"]
        cpu = [harness.cpu_seconds(server.pid), harness.cpu_seconds(mongo.pid) if mongo else 0.0]
        with Sampler(server.pid) as up_mem, open(path, "rb") as fh:
            t = time.time()
            resp = session.post(f"{server.url}{defaults.API_PREFIX}/artifacts", data=fh, timeout=1200,
                                headers={defaults.SHA256_HEADER: sha, "Content-Type": "application/octet-stream"})
            up_s = time.time() - t
        resp.raise_for_status()
        artifact = resp.json()
        after_up = proc_status(server.pid)["VmRSS"]
        up_cpu = [(harness.cpu_seconds(server.pid) - cpu[0]) / up_s,
                  ((harness.cpu_seconds(mongo.pid) - cpu[1]) / up_s) if mongo else None]
        digest, got = hashlib.sha256(), 0
        with Sampler(server.pid) as down_mem:
            t = time.time()
            with session.get(f"{server.url}{defaults.API_PREFIX}/artifacts/{artifact['id']}", stream=True,
                             timeout=1200) as resp:
                resp.raise_for_status()
                for block in resp.iter_content(CHUNK):
                    digest.update(block)
                    got += len(block)
            down_s = time.time() - t
        status = proc_status(server.pid)
        if got != size or digest.hexdigest() != sha:
            raise RuntimeError(f"{store}: downloaded {got} bytes, sha256 {digest.hexdigest()[:12]}, "
                               f"expected {size} bytes, {sha[:12]}")
        mongo_peak = proc_status(mongo.pid)["VmHWM"] if mongo else None
        return {"store": store, "size": size, "upload_s": up_s, "download_s": down_s,
                "upload_mb_s": size / MB / up_s, "download_mb_s": size / MB / down_s,
                "rss_idle": idle, "rss_peak_up": up_mem.peak, "rss_after_up": after_up,
                "rss_peak_down": down_mem.peak, "rss_end": status["VmRSS"], "hwm": status["VmHWM"],
                "mongo_hwm": mongo_peak, "upload_cpu_server": up_cpu[0], "upload_cpu_mongo": up_cpu[1], "samples": len(up_mem.samples) + len(down_mem.samples)}
    finally:
        if server is not None:
            server.stop()
        if mongo is not None:
            mongo.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="file size in MiB (default 1024: 1 GiB)")
    parser.add_argument("--store", default="sqlite", help="sqlite, mongo or both (comma-separated)")
    parser.add_argument("--data-dirs", default="disk,/dev/shm",
                        help="where the embedded store keeps artifacts: 'disk' (a temporary dir) and/or "
                             "folders such as /dev/shm (memory), comma-separated; separates the disk's "
                             "speed from the server's")
    parser.add_argument("--out", default=None, help="append the table here (and raw figures to OUT.json)")
    args = parser.parse_args()
    harness.require(harness.SERVER_MODULES)
    size = args.size_mb * CHUNK
    work = tempfile.mkdtemp(prefix="zwdx-bench-artifacts-")
    rows, results = [], []
    try:
        path = os.path.join(work, "weights.bin")
        sha = make_file(path, size)
        cases = []
        for store in [s.strip() for s in args.store.split(",") if s.strip()]:
            roots = [d.strip() for d in args.data_dirs.split(",") if d.strip()] if store == "sqlite" else ["disk"]
            cases += [(store, root) for root in roots]
        for store, root in cases:
            where = "disk" if root == "disk" else root
            if store == "mongo":
                where = "GridFS in nx-27017 (memory)"
            r = bench_store(store, path, size, sha, work, work if root == "disk" else root)
            r["where"] = where
            results.append(r)
            if "pending" in r:
                rows.append([store, where, "-", "-", "-", "-", "-", "-", "-", "-", f"pending: {r['pending']}"])
                continue
            mib = 1024 * 1024
            rows.append([store, where, f"{size / mib:,.0f} MiB", r["upload_mb_s"], r["download_mb_s"],
                         r["rss_idle"] / mib, r["rss_peak_up"] / mib, r["rss_peak_down"] / mib, r["rss_end"] / mib,
                         r["hwm"] / mib, f"{100 * r['upload_cpu_server']:.0f}%" + (
                             "" if r["mongo_hwm"] is None else f" (nx-27017 {100 * r['upload_cpu_mongo']:.0f}%, "
                             f"peak {r['mongo_hwm'] / mib:,.0f} MiB)")])
            print(f"  {store} ({where}): up {r['upload_mb_s']:,.0f} MB/s, down {r['download_mb_s']:,.0f} MB/s, "
                  f"server RSS {r['rss_idle'] / mib:,.0f} -> peak "
                  f"{max(r['rss_peak_up'], r['rss_peak_down']) / mib:,.0f} MiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = (f"\n## Artifacts through the server: {harness.machine()}; loopback, one transfer each way\n\n" +
            table(["store", "artifacts in", "size", "upload MB/s", "download MB/s", "server RSS idle MiB", "peak in upload MiB",
                   "peak in download MiB", "after MiB", "kernel high-water MiB", "server CPU in upload"], rows,
                  "Upload and download of one weights file (MB = 10^6 bytes)"))
    print(text)
    harness.write_out(args.out, text, {"bench": "artifacts", "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
