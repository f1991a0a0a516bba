"""Redis dies mid-run (kill -9 of the test-owned server, AOF with appendfsync always) and comes
back on the same port: the worker reconnects with backoff and finishes; nothing is lost.

The server requires a password and the worker logs in as a least-privilege ACL user, so the
same run also shows that the worker re-authenticates after a restart, that the command list
in docs/reliability.md is enough, and that no credential reaches the logs, even in the
connection errors of the outage.
"""

from __future__ import annotations

import time

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import count_done, push, record, sized, synth_tickets, tally, wait_until
from tests.integration.chaos.redis_server import RedisServer

ADMIN_PASSWORD = "adm1n-P@ss/w0rd#chaos"
WORKER_PASSWORD = "w0rker-S3cret:with@odd/chars"
# The worker's least privileges (docs/reliability.md, "Redis ACL"): its own keys, these commands.
WORKER_ACL = (
    "~chaos:* resetchannels -@all +client|setname +xgroup|create +xgroup|delconsumer +xreadgroup +ping "
    "+xpending +xinfo|groups +xrange +xack +xadd +xtrim +xclaim +set +get +exists +del +type +multi +exec "
    "+evalsha +eval"
)


def test_redis_restart_mid_run_loses_nothing(launch, redis_server_factory, tiny_model_dir, tmp_path):
    n = sized(500, 5000)
    outages = sized(1, 3)
    server: RedisServer = redis_server_factory(
        password=ADMIN_PASSWORD, acl_users={"triage-worker": WORKER_PASSWORD}, acl_rules={"triage-worker": WORKER_ACL}
    )
    env = worker_env(
        tiny_model_dir,
        server.url_as(user="triage-worker"),
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=32,
        TRIAGE_PASS_MAX_ITEMS=32,
        TRIAGE_RECONNECT_MAX_S=1,
        TRIAGE_MAX_INPUT_TOKENS=96,
        TRIAGE_CONSUMER="restart-a",
    )
    client = server.client()
    tickets = synth_tickets(n, seed=5, prefix="rr")
    push(client, env["TRIAGE_INPUT_STREAM"], tickets)
    results, dead = env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]

    with launch(env) as w:
        downs = []
        for k in range(outages):
            at = n * (k + 1) // (outages + 2)
            wait_until(
                lambda at=at: count_done(server.client(), results, dead) >= at,
                timeout_s=300,
                what=f"{at} results",
                alive=[w],
            )
            t0 = time.monotonic()
            server.crash()
            time.sleep(sized(2.0, 3.0))
            server.start()
            downs.append(round(time.monotonic() - t0, 1))
        wait_until(
            lambda: count_done(server.client(), results, dead) >= n,
            timeout_s=sized(300, 1200),
            interval_s=0.5,
            what="every ticket done after the restarts",
            explain=lambda: _state(server, env, w),
            alive=[w],
        )
        assert w.stop() == 0, w.stderr_tail()

    client = server.client()
    t = tally(client, results, dead, [tk["id"] for tk in tickets])
    assert t.lost == [], f"{len(t.lost)} lost"
    assert not t.dead
    unavailable = w.events("redis_unavailable")
    assert unavailable, "the outage was not noticed"
    assert w.events("redis_reconnected"), "no reconnect logged"
    delays = [e.get("retried_after_s") for e in unavailable if e.get("retried_after_s") is not None]
    assert delays and max(delays) <= 1.0 + 1e-9  # capped by TRIAGE_RECONNECT_MAX_S
    output = "\n".join(w.lines + w.stdout_lines)
    for secret in (WORKER_PASSWORD, ADMIN_PASSWORD, "w0rker-S3cret"):
        assert secret not in output, "a password reached the logs"
    assert "triage-worker:***@" in output  # the URL is logged, masked
    record(
        "redis_restart",
        tickets=n,
        outages=outages,
        down_s=downs,
        unavailable_logs=len(unavailable),
        duplicates=t.duplicates,
        lost=len(t.lost),
    )


def _state(server: RedisServer, env: dict, w) -> str:
    c = server.client()
    stream = env["TRIAGE_INPUT_STREAM"]
    groups = c.xinfo_groups(stream) if c.exists(stream) else "no input stream"
    pending = c.xpending(stream, env.get("TRIAGE_GROUP", "triage")) if groups != "no input stream" else None
    done = count_done(c, env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"])
    return (
        f"done: {done}\ninput groups: {groups}\npending: {pending}\n"
        f"heartbeats: {[c.get(k) for k in c.keys(env['TRIAGE_HEARTBEAT_KEY_PREFIX'] + '*')]}\n"
        f"worker log tail:\n{w.stderr_tail(60)}"
    )
