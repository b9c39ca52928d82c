"""The scheduler's part in DILOCO's spot checks (issue 33, ``verify``), in process: a job with
``verify`` is placed with its shadows' slots after its workers', and the job record says which
slot ranks are shadows, the worker each runs again and on which GPU client (issue 31: the
mutants of ``Scheduler._try_start``'s shadow code, which no in-process test placed). The rule
of who a shadow runs again: test_placement_shadows.py; the comparisons: test_trust_verify.py."""
from __future__ import annotations

from test_mutants_scheduler import asked, job_of, register, slots_held  # noqa: F401  (asked: a fixture)


def test_a_diloco_job_with_verify_is_placed_with_its_shadows_after_its_workers(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a", slots=2)
    register(socket_client, api, "b", slots=2)
    job_id = api.submit(parallelism="DILOCO", world_size=2,
                        diloco={"compression": "none", "verify": 1.0}).json["id"]  # a shadow per worker
    assert ctx.scheduler.schedule_once() == 1
    job = job_of(api, job_id)
    assert job["status"] == "starting" and job["world_size"] == 2  # the workers; the shadows come on top
    assert [(p["rank"], p["client_id"], p["gpu_index"]) for p in job["placement"]] == [
        (0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)]
    assert {s: (v["of"], v["client_id"], v["round"], v.get("gone")) for s, v in job["shadows"].items()} == {
        "2": (0, "b", -1, None), "3": (1, "b", -1, None)}
    assert all(v == job_id for v in slots_held(ctx, api.room["id"]).values())
    [(payload, _, _, _)] = asked
    assert payload == {"job_id": job_id}
    request = ctx.scheduler._asked[job_id]
    assert sorted(request.rank_keys) == [0, 1, 2, 3]  # a shadow holds a key of its own
