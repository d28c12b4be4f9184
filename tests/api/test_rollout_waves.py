"""A switch change rolls out in waves (api/switchboard.py ``rollout_wave``; Argo Rollouts' maxUnavailable): with
``flip_waves`` = 4, a rule reaches a quarter of the workers at once, the next quarter ``flip_wave_s`` later, and
every worker after three waves; GET /v1/switches answers it so."""

from __future__ import annotations

from datetime import UTC, timedelta

from api.switchboard import get_switchboard, rollout_wave

WORKERS = [f"w{i}" for i in range(200)]


def test_a_change_reaches_at_most_one_wave_of_workers_at_a_time(store):
    board = get_switchboard(store, cache_s=0)
    board.set("static_scales", False, "release=v1", actor="incident:x", reason="test", source="incident")
    t0 = max(r.updated_at for r in board.rules())
    t0 = t0 if t0.tzinfo else t0.replace(tzinfo=UTC)
    waves = {w: rollout_wave(w, "static_scales", 4) for w in WORKERS}
    assert set(waves.values()) == {0, 1, 2, 3}
    for k in range(4):
        now = t0 + timedelta(seconds=60 * k + 1)
        got = {w for w in WORKERS
               if board.resolve(w, "v1", "h200", waves=4, wave_s=60.0, now=now)[0].get("static_scales") is False}
        assert got == {w for w, v in waves.items() if v <= k}  # waves 0..k have it, the rest keep their value
        new = {w for w, v in waves.items() if v == k}
        assert 0 < len(new) < len(WORKERS) / 2  # one wave: about a quarter
    assert all(board.resolve(w, "v1", "h200")[0] == {"static_scales": False} for w in WORKERS)  # one wave: at once


def test_the_control_plane_answers_by_wave(tmp_path, store, admin):
    from fastapi.testclient import TestClient

    from tests.api.conftest import make_settings, real_app

    app = real_app(store, make_settings(tmp_path, flip_waves=100, flip_wave_s=3600))
    with TestClient(app) as c:
        r = c.put("/v1/switches/compile", json={"value": False, "scope": "release=v1", "who": "t", "why": "t"},
                  headers=admin)
        assert r.status_code == 200, r.text
        first = [w for w in WORKERS if rollout_wave(w, "compile", 100) == 0]
        later = [w for w in WORKERS if rollout_wave(w, "compile", 100) > 0]
        assert first and later
        q = {"release": "v1", "gpu_kind": "h200"}
        assert c.get("/v1/switches", params={**q, "worker_id": first[0]}, headers=admin).json()["switches"] == {
            "compile": False}
        assert c.get("/v1/switches", params={**q, "worker_id": later[0]}, headers=admin).json()["switches"] == {}
