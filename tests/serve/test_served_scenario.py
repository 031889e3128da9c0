"""The reference's served scenario through HTTP (tests/engine/test_engine.py runs it on the
engine): a chat; a long prompt that grows the K/V at the request and mid-decode; two short
chats that trim it and refill the expert cache; the long conversation's follow-up restored
(cached tokens in `usage`). `/v1/status` and `/metrics` show each step.

Chunks are 4 KiB so that the tiny model grows in many small steps (a K/V cell of the tiny
qwen3_moe in fp32 is 128 bytes, 32 cells a chunk), from 64 cells mapped (a chat and its
reply fit), 32 a step.
"""

from __future__ import annotations

MODEL = "tiny"
WINDOW = 512
ENV = {"STRATA_VMM_CHUNK_BYTES": "4096", "STRATA_KV_GROW_INIT": "64",
       "STRATA_KV_GROW_STEP": "32", "STRATA_KV_GROW_FLOOR": "2",
       "STRATA_LOAN_KEEP_SLOTS": "8"}  # a loan region of the top 8 slots
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
EVENT_KINDS = ("grown", "gave_up", "trimmed", "refilled", "parked", "restored")


def _events(server):
    """{kind: count} from /metrics, which must agree with /v1/status's."""
    from_metrics = {kind: server.metric("strata_engine_events_total", kind=kind)
                    for kind in EVENT_KINDS}
    from_status = server.status()["events"]
    assert from_metrics == {kind: float(from_status[kind]) for kind in EVENT_KINDS}
    return from_status


def _chat(client, text, max_tokens):
    return client.chat.completions.create(model=MODEL, max_tokens=max_tokens,
                                          messages=[{"role": "user", "content": text}],
                                          **GREEDY)


def test_the_served_scenario_over_http(serve_flags, profile, monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    server = serve_flags("--kv-grow", "--expert-profile", str(profile), "--max-context",
                         str(WINDOW), "--prefill-chunk", "32", "--conversation-cache-mib", "4",
                         "--conversation-cache-slots", "2")
    client = server.client()
    status = server.status()
    assert status["kv"]["elastic"] and status["kv"]["cells_mapped"] == 64
    assert status["cache"]["slots"] == status["cache"]["backed_slots"] == 16
    assert server.metric("strata_kv_cells_mapped") == 64

    # A chat: fits the start cells.
    _chat(client, "hi", 6)
    assert server.status()["kv"]["grows"] == 0

    # A long prompt: grown at the request for the prompt, then mid-decode.
    long_prompt = [3 + i % 250 for i in range(250)]
    long = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=60, **GREEDY)
    status, events = server.status(), _events(server)
    assert status["kv"]["grows"] >= 2 and events["grown"] == status["kv"]["grows"]
    assert status["kv"]["cells_mapped"] >= 250 + 59 and status["kv"]["slots_given_up"] > 0
    assert status["cache"]["backed_slots"] < 16 and events["gave_up"] >= 1
    assert events["parked"] == 1  # the chat shared nothing with it
    assert server.metric("strata_kv_cells_mapped") == status["kv"]["cells_mapped"]
    given_up = status["kv"]["slots_given_up"]

    # Two short chats: the long conversation is parked, the K/V trimmed, slots refilled.
    _chat(client, "short one", 6)
    _chat(client, "short two", 6)
    status, events = server.status(), _events(server)
    assert events["trimmed"] >= 1 and events["refilled"] >= 1 and events["parked"] >= 2
    assert status["kv"]["cells_mapped"] < 100 and status["kv"]["refilled"] > 0
    assert status["cache"]["backed_slots"] > 16 - given_up
    assert status["conversations"]["parked"] >= 1
    held = status["conversations"]["host_bytes"]
    assert held >= status["conversations"]["parked_bytes"] > 0
    assert server.metric("strata_conversation_cache_bytes") == held

    # The long conversation's follow-up: restored from its parked copy after growing.
    restored, grown = events["restored"], events["grown"]
    follow = long_prompt + long.choices[0].token_ids[:-1] + [7, 8, 9]
    result = client.completions.create(model=MODEL, prompt=follow, max_tokens=4, **GREEDY)
    cached = result.usage.prompt_tokens_details.cached_tokens
    assert cached == len(long_prompt) + 60 - 1 and result.usage.prompt_tokens == len(follow)
    status, events = server.status(), _events(server)
    assert events["restored"] == restored + 1 and events["grown"] > grown
    assert status["last_request"]["reused_tokens"] == cached
    assert status["cache"]["hit_rate"] is not None and 0 < status["cache"]["hit_rate"] <= 1
    # Five requests' tokens, as usage counted them, in the metrics.
    assert server.metric("strata_reused_tokens_total") >= cached
    assert server.metric("strata_time_to_first_token_seconds_count") == 5
