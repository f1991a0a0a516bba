"""Redis answers, but with an error reply: states that pass (a replica that cannot take writes yet) and refusals
that do not (an ACL without a command the worker needs).

A passing state at start-up is waited out like an unreachable Redis (it was a "configuration error", exit 2, with
nothing classified after Redis healed). A refused command inside the settle script stops the worker with
``permission_denied`` and exit 2: it was retried forever, writing the records before the refusal again on every
attempt (one ticket's result 11 times in 40 s) and never acking, and a warm stop never finished.
"""

from __future__ import annotations

from tests.integration.chaos.conftest import worker_env
from tests.integration.chaos.harness import count_done, push, synth_tickets, tally, wait_until
from tests.integration.chaos.test_redis_restart import WORKER_ACL
from worker.redis_server import free_port

GROUP = "triage"


def test_start_up_waits_out_a_replica_that_cannot_take_writes(launch, chaos_redis, tiny_model_dir, tmp_path):
    env = worker_env(tiny_model_dir, chaos_redis.url, tmp_path, TRIAGE_RECONNECT_MAX_S=1, TRIAGE_CONSUMER="ro-a")
    admin = chaos_redis.client()
    admin.replicaof("127.0.0.1", free_port())  # a primary that is not there: READONLY to every write
    w = launch(env, ready=False)
    first = w.wait_for("waiting_for_redis", timeout_s=120)
    assert "ReadOnly" in first["error"] or "READONLY" in first["error"], first
    assert first["state"] == "replica" and "primary" in first["fix"], first
    assert w.returncode is None and not w.events("setup_failed"), w.stderr_tail()
    admin.replicaof("no", "one")
    w.wait_ready(timeout_s=180)
    tickets = synth_tickets(10, seed=3, prefix="ro")
    push(admin, env["TRIAGE_INPUT_STREAM"], tickets)
    results, dead = env["TRIAGE_RESULTS_STREAM"], env["TRIAGE_DEAD_LETTER_STREAM"]
    wait_until(lambda: count_done(admin, results, dead) >= 10, timeout_s=120, what="10 results", alive=[w])
    assert w.stop(timeout_s=60) == 0, w.stderr_tail()
    t = tally(admin, results, dead, [t["id"] for t in tickets])
    assert t.lost == [] and t.duplicates == 0


def test_drain_against_a_redis_out_of_memory_gives_up_saying_so(launch, chaos_redis, tiny_model_dir, tmp_path):
    """The give-up line said "check TRIAGE_REDIS_URL and that Redis is running" to a Redis that answered OOM."""
    env = worker_env(
        tiny_model_dir,
        chaos_redis.url,
        tmp_path,
        TRIAGE_RECONNECT_MAX_S=0.2,
        TRIAGE_DRAIN_REDIS_TIMEOUT_S=1,
        TRIAGE_CONSUMER="oom-a",
    )
    admin = chaos_redis.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # every write that may grow memory is refused: OOM
    try:
        w = launch(env, "run", "--drain", ready=False)
        assert w.wait(timeout_s=120) == 3, w.stderr_tail()
    finally:
        admin.config_set("maxmemory", 0)
    (gave_up,) = w.events("redis_unreachable")
    assert gave_up["state"] == "out_of_memory" and "maxmemory" in gave_up["action"], gave_up
    assert "TRIAGE_REDIS_URL" not in gave_up["action"] and not w.events("model_loaded")


def test_a_command_the_acl_refuses_stops_the_worker_at_start_up_before_it_reads(
    launch, redis_server_factory, tiny_model_dir, tmp_path
):
    """Found by a write, every restart of a worker that stops on it would count one more delivery of the window's
    entries (dead letters after TRIAGE_MAX_DELIVERIES); found at start-up, nothing was read."""
    without_set = WORKER_ACL.replace(" +set", "")
    assert without_set != WORKER_ACL
    server = redis_server_factory(acl_users={"triage-worker": "pw-1"}, acl_rules={"triage-worker": without_set})
    env = worker_env(tiny_model_dir, server.url_as(user="triage-worker"), tmp_path, TRIAGE_CONSUMER="acl-a")
    admin = server.client()
    push(admin, env["TRIAGE_INPUT_STREAM"], synth_tickets(4, seed=4, prefix="acl"))
    for _ in range(2):  # a restart finds the same, and still reads nothing
        w = launch(env, ready=False)
        assert w.wait(timeout_s=180) == 2, w.stderr_tail()
        (denied,) = w.events("permission_denied")
        assert "SET " in denied["error"] and "XACK" not in denied["error"] and "ACL" in denied["action"]
        assert not w.events("model_loaded")
    assert admin.xpending(env["TRIAGE_INPUT_STREAM"], GROUP)["pending"] == 0
    assert not admin.exists(env["TRIAGE_RESULTS_STREAM"])


def test_a_command_the_acl_takes_away_while_running_stops_the_worker_instead_of_rewriting(
    launch, redis_server_factory, tiny_model_dir, tmp_path
):
    server = redis_server_factory(acl_users={"triage-worker": "pw-1"}, acl_rules={"triage-worker": WORKER_ACL})
    env = worker_env(
        tiny_model_dir,
        server.url_as(user="triage-worker"),
        tmp_path,
        TRIAGE_WINDOW_MAX_ITEMS=4,
        TRIAGE_PASS_MAX_ITEMS=4,
        TRIAGE_RECONNECT_MAX_S=1,
        TRIAGE_CONSUMER="acl-b",
    )
    admin = server.client()
    w = launch(env)
    admin.execute_command("ACL", "SETUSER", "triage-worker", "-xack")
    push(admin, env["TRIAGE_INPUT_STREAM"], synth_tickets(12, seed=4, prefix="acl"))
    assert w.wait(timeout_s=180) == 2, w.stderr_tail()
    (denied,) = w.events("permission_denied")
    assert "XACK" in denied["error"] and "ACL" in denied["action"]
    # one write's records, not one per retry; nothing acknowledged: its entries are still pending, to settle later
    assert admin.xlen(env["TRIAGE_RESULTS_STREAM"]) <= 4
    assert admin.xpending(env["TRIAGE_INPUT_STREAM"], GROUP)["pending"] >= 1
