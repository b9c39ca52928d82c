"""The dashboard end to end in real headless Chromium (Debian's, driven by playwright).

A server and two GPU clients run as real processes (conftest's ``cluster``, shared by the
module's tests, each of which stands alone): the browser signs in, the SDK submits the MNIST
example, and the tests watch the queue, the loss curve growing in the page while the job runs
(the slow workload: it trains long enough to be watched), the finished job, its weights
downloaded, a job that cannot fit cancelled, the history, and a GPU client going offline. The
delay from a metric being reported on a GPU client (the event's ``ts``) to it appearing in the
page is measured and printed. Screenshots go to test-artifacts/dashboard/; the room overview
and the job page are copied to docs/screenshots/ for the README when ZWDX_UPDATE_SCREENSHOTS=1.
"""
from __future__ import annotations

import os
import shutil
import statistics
import struct
import uuid

import pytest
import requests
import torch

import zwdx
import mnist
import models
import needs
from procs import ROOT, Server, build_ui, wait_until
from workloads import slow_train

pytestmark = pytest.mark.slow  # a browser, a server and GPU clients

sync_api = needs.module("playwright.sync_api", "pip install playwright (./setup.sh --test); never "
                                               "`playwright install`: the tests drive Debian's chromium")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = os.path.join(ROOT, "test-artifacts", "dashboard")
README_SHOTS = os.path.join(ROOT, "docs", "screenshots")
TOKEN_HEADER = "X-Zwdx-Room-Token"
VIEWPORT = {"width": 1280, "height": 900}

# Records, on every change of the job page, when (browser clock, unix seconds) it showed which
# events (data-last-seq), how many loss points (data-points) and which status.
OBSERVER = """
window.__zwdxSeen = [];
new MutationObserver(() => {
  const page = document.querySelector('[data-testid="job-page"]');
  if (!page) return;
  const chart = document.querySelector('[data-testid="chart-loss"]');
  const row = {t: Date.now() / 1000, path: location.pathname, seq: Number(page.dataset.lastSeq || 0),
               points: chart ? Number(chart.dataset.points) : 0, status: page.dataset.status};
  const last = window.__zwdxSeen[window.__zwdxSeen.length - 1];
  if (!last || last.seq !== row.seq || last.points !== row.points || last.status !== row.status
      || last.path !== row.path) window.__zwdxSeen.push(row);
}).observe(document, {subtree: true, childList: true, attributes: true,
                      attributeFilter: ["data-last-seq", "data-points", "data-status"]});
"""


@pytest.fixture(scope="session")
def ui_dist():
    """ui/dist, built when it is missing or older than the sources."""
    return build_ui()


@pytest.fixture(scope="module")
def browser():
    """Chromium through playwright's sync API, closed with this module: an open sync_playwright
    keeps its event loop running, and another file's test on the same worker (the CSP check in
    test/security/test_limits.py) could not start its own."""
    chromium_path = needs.tool("chromium", "apt-get install chromium (./setup.sh --test)")  # as setup.sh finds it
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, ui_dist, request):
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    context.add_init_script(OBSERVER)
    context.set_default_timeout(30_000)
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    yield pg
    shot(pg, f"last-{request.node.name}")  # where the page was when the test ended (or failed)
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def shot(pg, name: str, readme: str | None = None) -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, f"{name}.png")
    pg.screenshot(path=path, full_page=True)
    if readme and os.environ.get("ZWDX_UPDATE_SCREENSHOTS") == "1":
        os.makedirs(README_SHOTS, exist_ok=True)
        shutil.copyfile(path, os.path.join(README_SHOTS, readme))
    return path


def sign_in(pg, url: str, token: str) -> None:
    pg.goto(url)
    pg.wait_for_url(f"{url}/signin")
    pg.get_by_label("Submitter token").fill(token)
    pg.get_by_role("button", name="Sign in").click()
    pg.get_by_test_id("overview").wait_for()


def submit(sdk, room, epochs: int, world_size: int, name: str, train_func=slow_train) -> str:
    """The MNIST example, by default on the slow workload (about a second an epoch): a page has
    time to watch it run."""
    return sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_func,
                          eval_func=mnist.test, optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                          resources=zwdx.Resources(world_size=world_size), training=zwdx.Training(epochs=epochs),
                          run=zwdx.Run(room_token=room["token"], name=name, progress=False), wait=False)


def unique(name: str) -> str:
    """A job name no other test of the shared room uses."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


def api(server, room, path: str):
    resp = requests.get(f"{server.url}/api/v1{path}", headers={TOKEN_HEADER: room["token"]}, timeout=10)
    resp.raise_for_status()
    return resp


def js_number(value: float) -> str:
    """A number as the dashboard's formatNumber writes it: four significant digits."""
    rounded = float(f"{value:.4g}")
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)


def test_the_job_page_draws_a_running_pipelines_stages_and_schedule(cluster, page):
    sdk, room, url = cluster.sdk, cluster.room, cluster.server.url
    sign_in(page, url, room["token"])
    model = models.stage_lm()
    job_id = sdk.submit_job(model, models.pipe_loaders, models.pipe_train, models.pipe_eval,
                            torch.optim.AdamW(model.parameters(), lr=3e-3), "PIPELINE",
                            strategy=zwdx.Pipeline(schedule="1f1b", microbatches=4),
                            resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=100_000),
                            run=zwdx.Run(room_token=room["token"], name=unique("pipeline"), progress=False),
                            wait=False)  # runs until cancelled below
    page.goto(f"{url}/jobs/{job_id}")  # open before the ranks say what they hold: the plan arrives live
    page.get_by_test_id("job-page").wait_for()
    stages = page.locator('[data-testid="plan-rank"][data-role="stage"]')
    stages.nth(1).wait_for(timeout=120_000)
    assert page.get_by_test_id("job-page").get_attribute("data-status") == "running"
    columns = page.get_by_test_id("plan-client")
    assert sorted(columns.evaluate_all("els => els.map(e => e.dataset.client)")) == ["client-a", "client-b"]
    assert [columns.nth(i).locator('[data-role="stage"]').count() for i in range(2)] == [1, 1]  # a stage on each
    first = page.locator('[data-testid="plan-rank"][data-rank="0"]').inner_text()
    last = page.locator('[data-testid="plan-rank"][data-rank="1"]').inner_text()
    assert "stage 0 of 2: wte, wpe, h.0-1" in first and "stage 1 of 2: h.2-3, ln_f, head" in last
    assert "60.8K params" in first
    order = page.get_by_test_id("stage-order")
    assert order.locator("li").evaluate_all("els => els.map(e => e.dataset.stage)") == ["0", "1"]
    assert "→" in order.inner_text()
    schedule = page.get_by_test_id("schedule")
    assert schedule.get_attribute("data-schedule") == "1f1b" and schedule.get_attribute("data-steps") == "10"
    assert schedule.locator('[data-kind="F"]').count() == 8 and schedule.locator('[data-kind="B"]').count() == 8
    shot(page, "05-job-plan-pipeline")
    sdk.cancel_job(job_id, room_token=room["token"])


@pytest.fixture(scope="module")
def finished_job(shared_cluster):
    """A job of the module's room that completed (the MNIST example, one epoch): its id."""
    shared_cluster.ready()
    job_id = submit(shared_cluster.sdk, shared_cluster.room, train_func=mnist.train, epochs=1, world_size=2,
                    name=unique("finished"))
    result = shared_cluster.sdk.wait(job_id, progress=False, timeout=240)
    assert result["status"] == "completed", result.get("reason")
    return job_id


def live_delays(seen: list[dict], events: list[dict]) -> list[float]:
    """Seconds from each metric event's report to the first moment the page showed it. Events
    already there when the page first showed the job (loaded over REST) are left out."""
    if not seen:
        return []
    first = seen[0]["seq"]
    delays = []
    for ev in events:
        if ev["seq"] <= first:
            continue
        shown = next((row["t"] for row in seen if row["seq"] >= ev["seq"]), None)
        if shown is not None:
            delays.append(shown - ev["ts"])
    return delays


def test_signing_in_opens_the_room_with_its_gpu_clients_online(cluster, page):
    sign_in(page, cluster.server.url, cluster.room["token"])
    assert page.get_by_test_id("room-name").inner_text() == "cluster"
    wait_until(lambda: page.locator('[data-testid="client"][data-status="online"]').count() == 2, 20,
               what="two GPU clients online in the page")
    assert page.evaluate("sessionStorage.getItem('zwdx.roomToken')") == cluster.room["token"]
    assert cluster.room["token"] not in page.url
    shot(page, "01-overview-idle")


def test_the_queue_shows_a_running_job_in_its_slots_and_a_too_big_one_waiting_first_in_line(cluster, page):
    sdk, room = cluster.sdk, cluster.room
    sign_in(page, cluster.server.url, room["token"])
    running, too_big = unique("mnist-ddp"), unique("too-big")
    submit(sdk, room, epochs=50, world_size=2, name=running)  # runs until the test ends (cluster.tidy cancels it)
    submit(sdk, room, epochs=1, world_size=3, name=too_big)
    page.locator('[data-testid="slot"] a', has_text=running).first.wait_for(timeout=60_000)
    rows = page.get_by_test_id("queue-row")
    rows.filter(has_text=too_big).wait_for()
    rows.filter(has_text=running).locator(".badge-running").wait_for(timeout=120_000)
    assert rows.count() == 2
    assert page.locator('[data-testid="slot"] a', has_text=running).count() == 2  # both slots
    cells = rows.filter(has_text=too_big).locator("td")
    assert cells.nth(0).inner_text() == "1"  # first in line
    assert cells.nth(3).inner_text().startswith("3")  # the slots it asks for
    shot(page, "02-overview-running", readme="room-overview.png")


def test_the_job_page_grows_the_loss_curve_live_and_shows_the_finished_job(cluster, page):
    sdk, room, url = cluster.sdk, cluster.room, cluster.server.url
    sign_in(page, url, room["token"])
    job_id = submit(sdk, room, epochs=3, world_size=2, name=unique("mnist-ddp"))
    page.goto(f"{url}/jobs/{job_id}")  # open before it runs: every loss point arrives live
    page.get_by_test_id("job-page").wait_for()
    page.locator('[data-testid="chart-loss"]').wait_for(timeout=120_000)
    shot(page, "03-job-running")
    page.locator('[data-testid="job-page"][data-status="completed"]').wait_for(timeout=180_000)
    page.wait_for_timeout(300)  # let the last events land
    seen = [row for row in page.evaluate("window.__zwdxSeen") if row["path"] == f"/jobs/{job_id}"]
    growing = [row["points"] for row in seen if row["status"] in ("starting", "running")]
    assert len(set(p for p in growing if p)) >= 2, f"the loss curve never grew while running: {seen}"
    assert growing == sorted(growing), growing

    job = sdk.get_job(job_id)
    assert job["status"] == "completed"
    losses = sdk.get_job_metrics(job_id)["loss"]
    shown_points = int(page.get_by_test_id("chart-loss").get_attribute("data-points"))
    assert shown_points == len({(p["rank"], p["step"]) for p in losses})  # every reported loss, per rank
    for name in ("accuracy", "throughput"):
        assert page.get_by_test_id(f"chart-{name}").is_visible()
    assert page.get_by_test_id("timeline").locator("li").evaluate_all("els => els.map(e => e.dataset.status)") \
        == ["queued", "starting", "running", "completed"]
    placement = page.get_by_test_id("placement").inner_text()
    assert "client-a" in placement and "client-b" in placement and "rank 0" in placement and "rank 1" in placement
    assert page.get_by_test_id("plan").locator('[data-testid="plan-rank"][data-role="replica"]').count() == 2
    last_line = [line["text"] for line in sdk.get_job_logs(job_id) if line["text"].startswith("epoch 2: loss ")]
    assert last_line and "epoch 2: loss" in page.get_by_test_id("logs").inner_text()
    # the final loss the page shows is the one the train function printed last (and returned)
    assert js_number(float(last_line[-1].split()[-1])) in page.locator(".facts").inner_text()
    assert page.get_by_role("button", name="Cancel job").count() == 0

    events = api(cluster.server, room, f"/jobs/{job_id}/events?kind=metric").json()["events"]
    delays = live_delays(seen, events)
    assert len(delays) >= 3, f"too few metric events reached the open page live: {seen}"
    delays_ms = sorted(d * 1000 for d in delays)
    p95 = delays_ms[min(len(delays_ms) - 1, int(0.95 * len(delays_ms)))]
    print(f"\ndashboard: {len(delays)} metric events reached the page live; delay from report (event ts) to "
          f"the page: median {statistics.median(delays_ms):.0f} ms, p95 {p95:.0f} ms, "
          f"min {delays_ms[0]:.0f} ms, max {delays_ms[-1]:.0f} ms (target: under 1000 ms on loopback)")
    # The 1 s target is reported above, not asserted: other test runs share these CPUs. A page
    # that only learned of metrics by reloading or slow polling would fail this.
    assert statistics.median(delays) < 3.0, delays_ms
    shot(page, "04-job-completed", readme="job-page.png")


def test_the_trained_weights_download_from_the_job_page(cluster, finished_job, page):
    sign_in(page, cluster.server.url, cluster.room["token"])
    page.goto(f"{cluster.server.url}/jobs/{finished_job}")
    page.locator('[data-testid="job-page"][data-status="completed"]').wait_for()
    with page.expect_download() as download:  # fetch with the token header, then a blob
        page.get_by_test_id("download-weights").click()
    with open(download.value.path(), "rb") as fh:
        blob = fh.read()
    assert blob == api(cluster.server, cluster.room, f"/jobs/{finished_job}/weights").content
    (header_len,) = struct.unpack("<Q", blob[:8])
    assert blob[8:9] == b"{" and b"fc2.weight" in blob[8:8 + header_len]  # a safetensors file of Net


def test_a_job_that_cannot_fit_says_why_and_the_page_cancels_it(cluster, page):
    sdk, room = cluster.sdk, cluster.room
    sign_in(page, cluster.server.url, room["token"])
    waiting_id = submit(sdk, room, epochs=1, world_size=3, name=unique("too-big"))
    page.goto(f"{cluster.server.url}/jobs/{waiting_id}")
    page.locator('[data-testid="job-page"][data-status="queued"]').wait_for()
    assert "position 1" in page.get_by_role("status").filter(has_text="Queued").inner_text()
    page.get_by_text("waiting for 3 free slot(s)").wait_for()
    page.get_by_role("button", name="Cancel job").click()
    assert sdk.get_job(waiting_id)["status"] == "queued"  # not before the confirmation
    page.get_by_role("button", name="Yes, cancel it").click()
    page.locator('[data-testid="job-page"][data-status="cancelled"]').wait_for()
    assert sdk.get_job(waiting_id)["status"] == "cancelled"


def test_the_history_shows_each_jobs_result_and_mean_throughput_and_filters_and_sorts(cluster, finished_job, page):
    sdk, room = cluster.sdk, cluster.room
    cancelled = submit(sdk, room, epochs=1, world_size=3, name=unique("too-big"))
    sdk.cancel_job(cancelled)
    sign_in(page, cluster.server.url, room["token"])
    page.get_by_role("link", name="History", exact=True).click()
    history_rows = page.get_by_test_id("history-row")
    done, gone = history_rows.filter(has_text=finished_job), history_rows.filter(has_text=cancelled)
    gone.wait_for()
    job = sdk.get_job(finished_job)
    throughput = [p["value"] for p in sdk.get_job_metrics(finished_job)["throughput"]]
    cells = done.locator("td").all_inner_texts()
    assert cells[2] == "completed" and cells[5] == "2" and cells[6] == "DDP"
    assert cells[4] == f"loss {js_number(job['final_loss'])}"
    assert cells[7] == f"{js_number(statistics.mean(throughput))} samples/s"  # the mean of what rank 0 reported
    assert gone.locator("td").all_inner_texts()[2] == "cancelled"
    shot(page, "05-history")
    page.get_by_role("checkbox", name="cancelled").check()
    wait_until(lambda: done.count() == 0, 5, what="the status filter")
    assert set(history_rows.evaluate_all("rows => rows.map(r => r.dataset.status)")) == {"cancelled"}
    assert gone.count() == 1
    page.get_by_role("checkbox", name="cancelled").uncheck()
    page.get_by_role("button", name="Result").click()  # descending: the jobs without a result go last
    wait_until(lambda: history_rows.last.get_attribute("data-status") == "cancelled", 5, what="sorting")
    statuses = history_rows.evaluate_all("rows => rows.map(r => r.dataset.status)")
    assert statuses.index("cancelled") > statuses.index("completed"), statuses


def test_a_gpu_client_that_stops_shows_as_offline_live(cluster, page):
    sign_in(page, cluster.server.url, cluster.room["token"])
    wait_until(lambda: page.locator('[data-testid="client"][data-status="online"]').count() == 2, 20,
               what="two GPU clients online in the page")
    cluster.clients[1].stop()  # the cluster starts it again for the next test
    page.locator('[data-testid="client"][data-status="offline"]', has_text="client-b").wait_for(timeout=20_000)
    assert "1 GPU client online" in page.get_by_test_id("stat-online").inner_text()
    shot(page, "06-overview-client-offline")


def test_a_wrong_token_is_refused_and_a_room_made_in_the_page_opens(cluster, page):
    server = cluster.server
    # A wrong token is refused with a message, and nothing is kept.
    page.goto(f"{server.url}/signin")
    page.get_by_label("Submitter token").fill("zr_this-is-not-a-room-token")
    page.get_by_role("button", name="Sign in").click()
    error = page.get_by_test_id("signin-error")
    error.wait_for()
    assert "does not open any room" in error.inner_text()
    assert page.evaluate("sessionStorage.length") == 0
    shot(page, "07-bad-token")
    # The room's donor token is refused too, in the server's words: which token signs in.
    page.get_by_label("Submitter token").fill(cluster.room["donor_token"])
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("This token cannot open the dashboard").wait_for()
    assert "submitter token" in error.inner_text() and page.evaluate("sessionStorage.length") == 0

    # A token that stops working (here: one planted in the session) signs the tab out.
    page.evaluate("sessionStorage.setItem('zwdx.roomToken', 'zr_stale')")
    page.goto(server.url)
    page.get_by_text("Signed out").wait_for()
    assert page.url.endswith("/signin")

    # A room made in the page: its two tokens are shown once, then the room opens, empty.
    page.get_by_label("Name").fill("made-in-the-browser")
    page.get_by_role("button", name="Create room").click()
    token = page.get_by_test_id("new-token").inner_text()
    assert token.startswith("zs_") and page.get_by_test_id("new-donor-token").inner_text().startswith("zd_")
    shot(page, "08-room-created")
    page.get_by_role("button", name="Open the room").click()
    page.get_by_test_id("no-clients").wait_for()
    assert page.get_by_test_id("room-name").inner_text() == "made-in-the-browser"
    assert page.get_by_test_id("no-jobs").is_visible()
    shot(page, "09-empty-room")


def test_dashboard_reconnects_after_the_server_restarts(server, room, page):
    sign_in(page, server.url, room["token"])
    state = page.get_by_test_id("connection-state")
    wait_until(lambda: "live" in state.inner_text(), 10, what="the live connection")
    server.stop()
    page.get_by_test_id("connection-lost").wait_for(timeout=15_000)
    shot(page, "10-connection-lost")
    again = Server(server.data_dir, port=server.port)
    try:
        page.get_by_test_id("connection-lost").wait_for(state="detached", timeout=30_000)
        wait_until(lambda: "live" in state.inner_text(), 10, what="live again")
        assert page.get_by_test_id("room-name").inner_text() == "test-room"
    finally:
        again.stop()
