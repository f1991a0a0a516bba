"""The consumer-name claim's assumption about heartbeats that do not state their TTL (pure: no Redis)."""

from worker.settings import Settings
from worker.stream.health import DEFAULT_TTL_S


def test_the_ttl_assumed_for_a_heartbeat_that_states_none_is_the_settings_default():
    """health.py imports no settings; this keeps its assumption (how long a live holder may go between beats, for a
    worker from before heartbeats said their TTL) equal to what such a worker ran with unless configured."""
    assert Settings.model_fields["heartbeat_ttl_s"].default == DEFAULT_TTL_S
