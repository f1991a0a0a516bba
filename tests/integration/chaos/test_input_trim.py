"""The input stream stays bounded: each write trims it (XTRIM MINID ~) below the oldest entry that
any consumer group on the stream still needs (its oldest pending entry, else the one after its
last delivered one). Another group that lags behind keeps everything it has not settled.
TRIAGE_INPUT_TRIM=false leaves the stream alone. Before this, acknowledged tickets stayed in the
stream forever (XLEN = every ticket ever sent).
"""

from __future__ import annotations

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import push, record, synth_tickets, tally

NODE_SLACK = 200  # `~` trimming removes whole radix-tree nodes (stream-node-max-entries = 100)


def _drain(launch, env) -> None:
    w = launch(env, "run", "--drain")
    assert w.wait(timeout_s=300) == 0, w.stderr_tail()


def test_input_stream_is_trimmed_below_what_every_group_needs(launch, chaos_redis, tiny_model_dir, tmp_path):
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=64,
        TRIAGE_PASS_MAX_ITEMS=64,
        TRIAGE_MAX_INPUT_TOKENS=48,
    )
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    client = chaos_redis.client()
    first = synth_tickets(1000, seed=31, prefix="a")
    ids = push(client, stream, first)
    # a second group on the same stream (an audit consumer) has settled 200 entries and holds 100 more
    client.xgroup_create(stream, "audit", id="0")
    held = client.xreadgroup("audit", "auditor", {stream: ">"}, count=300)[0][1]
    client.xack(stream, "audit", *[sid for sid, _ in held[:200]])

    _drain(launch, env)
    assert tally(client, results, dead, [t["id"] for t in first]).lost == []
    kept = client.xrange(stream, min="-", max="+", count=1)[0][0].decode()
    assert _id(kept) <= _id(ids[200]), "an entry the audit group still holds was trimmed"
    assert client.xlen(stream) >= 800
    assert len(client.xrange(stream, min=ids[200], max="+")) == 800  # everything the audit group needs is there

    client.xgroup_destroy(stream, "audit")  # the audit consumer goes away: only the worker's group remains
    second = synth_tickets(500, seed=32, prefix="b")
    push(client, stream, second)
    _drain(launch, env)
    trimmed_len = client.xlen(stream)
    assert trimmed_len <= NODE_SLACK, f"the input stream still holds {trimmed_len} settled entries"
    lag = next(g for g in client.xinfo_groups(stream) if g["name"] == b"triage")["lag"]
    assert lag == 0, "the producer's backlog check needs the group's lag (XINFO GROUPS) after trimming"

    third = synth_tickets(300, seed=33, prefix="c")
    push(client, stream, third)
    _drain(launch, {**env, "TRIAGE_INPUT_TRIM": "false"})
    untrimmed_len = client.xlen(stream)
    assert untrimmed_len == trimmed_len + len(third)
    t = tally(client, results, dead, [x["id"] for x in first + second + third])
    assert t.lost == [] and t.duplicates == 0
    record(
        "input_trim",
        tickets=len(first) + len(second) + len(third),
        xlen_with_lagging_group=1000 - 200,
        xlen_trimmed=trimmed_len,
        xlen_untrimmed=untrimmed_len,
    )


def _id(sid: str) -> tuple[int, int]:
    ms, seq = sid.split("-")
    return int(ms), int(seq)


def test_a_windows_last_write_trims_what_the_window_settled(launch, chaos_redis, tiny_model_dir, tmp_path):
    """The trim stayed at or below the lowest entry this process held, the entries being written included, until
    the window was done: a window whose last pass held its oldest entry (passes go shortest first) stayed whole in
    the stream once everything was settled (XLEN 600 of 600), until some later write."""
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_WINDOW_TARGET_S=0,  # one window of everything
        TRIAGE_WINDOW_MAX_ITEMS=1000,
        TRIAGE_PASS_MAX_ITEMS=32,
        TRIAGE_MAX_INPUT_TOKENS=48,
    )
    stream, results, dead = env["TRIAGE_INPUT_STREAM"], env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    client = chaos_redis.client()
    tickets = [{"id": "long-0", "text": "my parcel is late and the invoice is wrong " * 20}]  # the last pass
    tickets += [{"id": f"short-{i}", "text": f"refund {i}"} for i in range(599)]
    push(client, stream, tickets)
    _drain(launch, env)
    t = tally(client, results, dead, [x["id"] for x in tickets])
    assert t.lost == [] and t.duplicates == 0
    assert client.xlen(stream) <= NODE_SLACK, "settled entries stayed in the stream after the last write"
