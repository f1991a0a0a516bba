"""Batch worker for RQ: ``rq worker --worker-class worker.rqbatch.BatchWorker QUEUE`` (see docs/rq.md)."""

from worker.rqbatch.worker import BatchWorker

__all__ = ["BatchWorker"]
