"""DILOCO's robust aggregation (zwdx/robust.py) and the naming of a dishonest worker
(zwdx/server/suspects.py), in-process: what the rule gives with a liar among honest workers, that
it is computed the same frame by frame as whole, that the workers' all-gather gives the server's
numbers, and that the server names, drops and avoids a worker flagged round after round.
The same with real GPU-client processes, one of them lying: test_diloco_dishonest.py."""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch

from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_diloco import placed, put
from zwdx import codec, robust


@pytest.fixture
def backend_app(backend, make_app, tmp_path):
    """An in-process app over the backend's store (SQLite here; MongoDB's stand-in in the slow lane)."""
    if backend.name == "sqlite":
        return make_app(DATA_DIR=backend.where)
    return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where)


def honest(n: int, numel: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` pseudo-gradients that share a direction (the task's), each with its own noise."""
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(numel)
    return [(common + 0.5 * rng.standard_normal(numel)).astype(np.float32) for _ in range(n)]


def combine(vectors: list[np.ndarray], **kw) -> tuple[np.ndarray, robust.Combiner]:
    combiner = robust.Combiner([float(np.linalg.norm(v.astype(np.float64))) for v in vectors], **kw)
    out = [combiner.frame([v[i:i + codec.FRAME] for v in vectors]) for i in range(0, vectors[0].size, codec.FRAME)]
    return np.concatenate(out), combiner


def off(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_liar_scaling_its_vector_moves_the_robust_aggregate_little_and_the_mean_far(n):
    good = honest(n - 1, 5000)
    truth = np.mean(good, axis=0)
    liar = -50 * good[0]
    robust_out, combiner = combine([*good, liar])
    mean_out, _ = combine([*good, liar], robust=False)
    assert off(mean_out, truth) > 5
    assert off(robust_out, truth) < 0.75  # a clipped share at most, for one liar of three
    reasons = robust.flags(combiner.scores())
    assert reasons[-1] and "norm" in reasons[-1] and not any(reasons[:-1]), reasons


def test_a_forged_vector_of_honest_norm_pointing_back_is_flagged_and_a_random_one_only_clipped():
    good = honest(3, 20_000, seed=3)
    forged = -good[0] * 1.1  # the honest direction reversed, within the honest norms
    _, combiner = combine([*good, forged])
    scores = combiner.scores()
    reasons = robust.flags(scores)
    assert reasons[-1] and "opposes" in reasons[-1] and not any(reasons[:-1]), (reasons, scores)
    assert all(0.8 < s.norm_ratio < 1.25 for s in scores)  # not the norm: the direction gave it away
    rng = np.random.default_rng(9)
    noise = rng.standard_normal(20_000).astype(np.float32)
    noise *= np.linalg.norm(good[0]) / np.linalg.norm(noise)
    out, combiner = combine([*good, noise])
    assert not any(robust.flags(combiner.scores()))  # it merely disagrees: as an honest worker near convergence can
    assert off(out, np.mean(good, axis=0)) < 0.6  # clipped and trimmed, it moves the aggregate a share at most


def test_an_honest_worker_that_agrees_about_zero_is_not_flagged():
    good = honest(7, 20_000, seed=4)
    rng = np.random.default_rng(11)
    aside = rng.standard_normal(20_000).astype(np.float32)  # its own shard's direction, unrelated to the rest
    aside *= np.linalg.norm(good[0]) / np.linalg.norm(aside)
    _, combiner = combine([*good, aside])
    assert not any(robust.flags(combiner.scores()))


def test_honest_workers_are_not_flagged_and_two_workers_never_are():
    for seed in range(20):
        _, combiner = combine(honest(5, 3000, seed=seed))
        assert not any(robust.flags(combiner.scores())), seed
    _, two = combine([np.ones(10, np.float32), -100 * np.ones(10, np.float32)])
    assert robust.flags(two.scores()) == [None, None]  # which one lies cannot be told


def test_the_trimmed_mean_drops_the_extremes_of_every_coordinate_after_clipping():
    vectors = [np.array([1.0, 2.0, 3.0, 0.0], np.float32), np.array([2.0, 2.0, 3.0, 0.0], np.float32),
               np.array([3.0, 2.0, 3.0, 0.0], np.float32), np.array([0.0, 2.0, -3.0, 3.5], np.float32)]
    out, combiner = combine(vectors)
    assert combiner.trim == 1 == robust.default_trim(4)
    norms = [np.linalg.norm(v) for v in vectors]
    scales = np.minimum(1, np.median(norms) / np.array(norms))
    clipped = np.stack(vectors) * scales[:, None]
    want = np.sort(clipped, axis=0)[1:3].mean(axis=0)
    assert np.allclose(out, want, atol=1e-6)
    assert combine(vectors, trim=0)[1].trim == 0 and combine(vectors, trim=9)[1].trim == 1  # one value stays


def test_scores_over_many_frames_are_the_scores_of_the_whole_vectors():
    numel = codec.FRAME * 2 + 17  # what a model past 2 M parameters sends
    vectors = honest(3, numel, seed=5)
    vectors[2] = vectors[2] * 4
    _, framed = combine(vectors)
    whole = robust.Combiner([float(np.linalg.norm(v.astype(np.float64))) for v in vectors])
    whole.frame(vectors)
    for a, b in zip(framed.scores(), whole.scores()):
        assert a.norm_ratio == pytest.approx(b.norm_ratio) and a.agreement == pytest.approx(b.agreement, rel=1e-9)
    assert framed.scores()[2].norm_ratio == pytest.approx(4 * np.linalg.norm(vectors[0]) / np.linalg.norm(vectors[1]),
                                                          rel=0.2)


def test_the_mean_rule_is_the_codecs_plain_mean_byte_for_byte():
    vectors = honest(3, codec.FRAME + 99, seed=1)
    streams = lambda: {i: io.BytesIO(codec.encode(v, "int8")) for i, v in enumerate(vectors)}  # noqa: E731
    plain = b"".join(codec.average(streams())[2])
    norms = [codec.inspect(io.BytesIO(codec.encode(v, "int8")))[1] for v in vectors]
    mean = b"".join(codec.average(streams(), robust.Combiner(norms, robust=False).frame)[2])
    assert plain == mean
    assert norms[0] == pytest.approx(np.linalg.norm(codec.decode(codec.encode(vectors[0], "int8")).astype(np.float64)),
                                     rel=1e-9)


def test_workers_that_all_gather_combine_as_the_server_does():
    from test_diloco_peers import held_port
    from gpu_client.rank.strategies.peers import form
    vectors = [torch.from_numpy(v) for v in honest(2, codec.FRAME + 5, seed=2)]
    vectors.append(vectors[0] * -30)
    port, out = held_port(), [None] * 3

    def run(rank: int) -> None:
        torch.set_num_threads(1)
        peers, why = form("127.0.0.1", port, rank, 3, 30.0, timeout=10.0)
        assert peers is not None, why
        out[rank] = peers.combine(vectors[rank], vectors[rank].numel(), leaving=rank == 2, trim=None)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want, _ = combine([v.numpy() for v in vectors])
    for got in out:
        assert got is not None and got[1:3] == (3, 1) and list(got[3]) == [2] and "norm" in got[3][2]
        assert torch.equal(got[0], out[0][0]) and np.allclose(got[0].numpy(), want, atol=1e-6)


def test_a_worker_flagged_round_after_round_is_named_dropped_and_avoided(backend_app):
    app = backend_app
    room, ranks, job = placed(app, world_size=3, compression="none", suspect_after=2)
    for r, api in enumerate(ranks):
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).json["ok"]
    for n in range(2):
        good = honest(2, 4000, seed=n)
        for r, values in enumerate([*good, 40 * good[0]]):
            assert put(ranks[r], job, n, values, "none").status_code == 201
        after = room.get(f"/jobs/{job['id']}").json
        assert (after["suspects"] != {}) == (n == 1), after["suspects"]
    suspect = after["suspects"]["2"]
    assert suspect["client_id"] == f"gpu-{job['id']}-2" and suspect["rounds"] == [0, 1]
    assert "norm" in suspect["reason"]
    assert after["status"] == "running" and after["ranks"]["2"]["status"] == "dropped"
    assert after["ranks"]["0"]["status"] == after["ranks"]["1"]["status"] == "running"
    assert suspect["client_id"] in app.extensions["zwdx"].store.get_job(job["id"]).avoid
    clients = {c["id"]: c for c in room.get("/room").json["clients"]}
    assert clients[suspect["client_id"]]["suspected_in"] == [job["id"]]
    assert all(c["suspected_in"] == [] for cid, c in clients.items() if cid != suspect["client_id"])
    rounds = app.extensions["zwdx"].store.list_artifacts(job["id"], "outer_gradient")
    assert rounds[-1]["scores"]["2"]["norm_ratio"] > 3 and rounds[-1]["strikes"] == {"2": [0, 1]}
    log = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert any("rank 2" in t and "is a suspect" in t for t in log), log
    nxt = put(ranks[2], job, 2, honest(1, 4000)[0], "none")
    assert nxt.status_code == 409  # the rounds no longer wait for it, nor take its word


def test_suspect_after_0_names_nobody_and_the_mean_rule_takes_the_liar_as_it_is(app):
    room, ranks, job = placed(app, world_size=3, compression="none", suspect_after=0, aggregate="mean")
    good = honest(2, 100)
    for r, values in enumerate([*good, 40 * good[0]]):
        put(ranks[r], job, 0, values, "none")
    fetched = codec.decode(ranks[0].get(f"/jobs/{job['id']}/diloco/rounds/0").data)
    assert np.allclose(fetched, (good[0] + good[1] + 40 * good[0]) / 3, rtol=1e-5)
    assert room.get(f"/jobs/{job['id']}").json["suspects"] == {}
