"""A bounded load: 200 requests from 8 concurrent clients, of random lengths, chat and
completions, whole and streamed, 5% of them malformed. Every request is answered (200, or a
4xx / 503 with an error body), none is lost, the server is alive at the end, and its memory is
flat: the process's RSS, and the memory backend's alive chunks (those of the elastic K/V and
the expert cache; all released once the server stops)."""

from __future__ import annotations

import gc
import json
import threading

import httpx
import numpy as np
import openai

from strata import _vmm

MODEL = "tiny"
WINDOW = 512
CLIENTS, REQUESTS = 8, 200
ENV = {"STRATA_VMM_CHUNK_BYTES": "4096", "STRATA_KV_GROW_INIT": "64",
       "STRATA_KV_GROW_STEP": "32", "STRATA_KV_GROW_FLOOR": "2", "STRATA_LOAN_KEEP_SLOTS": "8"}
MALFORMED = [  # (path, raw body): each a 4xx
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user"'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "not a list"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -3}'),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}'),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": [5] * (WINDOW + 1)}).encode()),
]
MIB = 1 << 20
RSS_SLACK_MIB = 48  # allocator noise over 200 requests; a leak per request would pass it


def _one(server, client, rng, outcomes):
    """Send one random request; append (kind, status, body or None)."""
    if rng.random() < 0.05:
        path, body = MALFORMED[rng.integers(len(MALFORMED))]
        r = httpx.post(server.url + path, content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
        outcomes.append(("malformed", r.status_code, r.json()))
        return
    n, stream = int(rng.integers(1, 200)), bool(rng.random() < 0.3)
    options = {"model": MODEL, "max_tokens": int(rng.integers(1, 9)), "stream": stream,
               "temperature": float(rng.choice([0.0, 0.8]))}
    try:
        if rng.random() < 0.5:
            text = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, n))
            answer = client.chat.completions.create(
                messages=[{"role": "user", "content": text}], **options)
        else:
            ids = [int(t) for t in rng.integers(3, 250, n)]
            answer = client.completions.create(prompt=ids, **options)
        if stream:
            answer = list(answer)
        outcomes.append(("good", 200, None))
    except openai.APIStatusError as err:
        outcomes.append(("good", err.status_code, {"error": err.body}))


def _run_clients(server, seed, requests=REQUESTS):
    outcomes: list[tuple] = []
    per_client = requests // CLIENTS

    def client_loop(i):
        rng = np.random.default_rng(seed + i)
        client = server.client()
        for _ in range(per_client):
            _one(server, client, rng, outcomes)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return outcomes


def _probe(client, first_id):
    """Bring the K/V to the same cells whatever came before: a long prompt grows it to the
    same step, then a short one trims it back to the same target."""
    for prompt in ([first_id] + [5] * 299, [9, 8, 7]):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)


def test_a_bounded_load_leaves_every_request_answered_and_memory_flat(serve_flags, profile,
                                                                      monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    gc.collect()
    chunks_before = _vmm.alive_chunks()
    server = serve_flags("--kv-grow", "--expert-profile", str(profile), "--max-context",
                         str(WINDOW), "--prefill-chunk", "64", "--conversation-cache-mib", "2",
                         "--conversation-cache-slots", "4", "--max-queue", "16")
    client = server.client()
    # Loaded: every arena chunk and the K/V's start cells mapped, the most that is alive
    # whenever the K/V is back at its start cells.
    chunks_loaded = _vmm.alive_chunks()
    # A first round: the allocator's pools and the conversation cache fill up.
    warm_up = _run_clients(server, seed=1000, requests=40)
    _probe(client, 250)
    gc.collect()
    rss = server.status()["memory"]["rss_bytes"]
    assert _vmm.alive_chunks() <= chunks_loaded

    outcomes = _run_clients(server, seed=0)

    assert len(outcomes) == REQUESTS  # every request answered, none lost
    for kind, status, body in outcomes:
        if status != 200:
            assert 400 <= status < 500 or status == 503, (kind, status, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
    malformed = [o for o in outcomes if o[0] == "malformed"]
    assert malformed and all(400 <= status < 500 for _, status, _ in malformed)
    good = [o for o in outcomes if o[0] == "good"]
    assert all(status == 200 for _, status, _ in good), good  # 8 clients fit the queue
    assert server.get("/health").status_code == 200
    status = server.status()
    ran = sum(kind == "good" for kind, _, _ in warm_up) + 2 + len(good)
    assert status["requests_completed"] == ran  # both rounds' good requests, the probe
    assert status["events"]["grown"] > 0 and status["events"]["trimmed"] > 0
    assert status["events"]["parked"] > 0 and status["kv"]["failures"] == 0

    _probe(client, 251)
    gc.collect()
    # Chunks move between the arena and the K/V (which arena chunks are mapped depends on
    # the history), but none is alive beyond what they held at the start.
    assert server.status()["kv"]["cells_mapped"] == 64
    assert _vmm.alive_chunks() <= chunks_loaded
    grown_mib = (server.status()["memory"]["rss_bytes"] - rss) / MIB
    assert grown_mib < RSS_SLACK_MIB, f"RSS grew {grown_mib:.1f} MiB over {REQUESTS} requests"
    server.stop()
    gc.collect()
    assert _vmm.alive_chunks() == chunks_before  # the engine gave every chunk back
