"""triage worker: classifies support tickets from Redis in length-bucketed batches."""

__version__ = "0.1.0"
