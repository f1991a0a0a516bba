"""RQ integration: ``rq worker --worker-class worker.rqbatch.BatchWorker QUEUE`` (see docs/rq.md).

``BatchWorker`` is imported on first use, so the producer can read ``payload.CLASSIFY_PATH``
without importing RQ's worker machinery.
"""

__all__ = ["BatchWorker"]


def __getattr__(name: str):
    if name == "BatchWorker":
        from worker.rqbatch.worker import BatchWorker

        return BatchWorker
    raise AttributeError(f"module 'worker.rqbatch' has no attribute {name!r}")
