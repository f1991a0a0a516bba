"""Redis Streams side of the worker: source (consumer group), sink (results, dead letters), run loop."""
