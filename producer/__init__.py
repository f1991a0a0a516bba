"""The producer side of triage: push support tickets into the worker's Redis stream, get results back.

from producer import TriageClient
client = TriageClient()                      # TRIAGE_* env (ProducerSettings)
sent = client.submit_many(["I was charged twice", {"text": "App crashes", "id": "T-2"}])
results = client.wait(sent, timeout_s=30)      # {ticket_id: Result}, each answering its own send
"""

from producer.client import BacklogFull, Submitted, TriageClient
from producer.redis_errors import AclRefused, WrongType
from producer.results import Result
from producer.rq_client import enqueue_ticket, enqueue_tickets, triage_queue
from producer.settings import ProducerSettings
from producer.synth import generate_tickets, iter_tickets
from producer.tickets import InvalidTicket, ticket_fields

__all__ = [
    "AclRefused",
    "BacklogFull",
    "InvalidTicket",
    "ProducerSettings",
    "Result",
    "Submitted",
    "TriageClient",
    "generate_tickets",
    "iter_tickets",
    "ticket_fields",
    "enqueue_ticket",
    "enqueue_tickets",
    "triage_queue",
    "WrongType",
]
