"""Long-tail material for the synthetic ticket generator (data only): pasted logs, stack traces, tracking and
login histories, agent quotes. ``synth.py`` appends them to a ticket to give the stream its long tail; the
ticket's own phrases live in ``synth_phrases.py``.
"""

from __future__ import annotations

# Long-tail attachments: intro lines announcing pasted material.
ATTACH_INTROS = {
    "technical": [
        "Here are the logs:",
        "Log output below:",
        "Stack trace:",
        "Console output:",
        "Pasting the full error log:",
    ],
    "billing": ["My billing history:", "Here is the list of charges:", "Invoices so far:"],
    "account": ["Recent login activity from my security page:", "Here's what the activity log shows:"],
    "shipping": ["Tracking history:", "This is what the tracking page shows:"],
    "other": ["Some more background:", "Here's the longer version:"],
}

LOG_LEVELS = ["INFO", "WARN", "ERROR", "DEBUG", "ERROR", "WARN"]
LOG_COMPONENTS = ["sync-worker", "http-client", "auth", "uploader", "db-pool", "scheduler", "ui-main", "cache"]
LOG_MESSAGES = [
    "request to /api/v2/{path} failed: {error}",
    "retrying in {n}s (attempt {attempt}/5)",
    "connection pool exhausted, waiting for free slot",
    "response code={code} elapsed={n}ms",
    "token refresh failed: {error}",
    "uploaded chunk {attempt} of {n}",
    "cache miss for key user:{customer}",
    "GC pause {n}ms",
    "socket closed by remote host",
    "loaded {n} items from local store",
]
STACK_FRAMES = [
    "at com.acme.sync.Uploader.push(Uploader.java:{n})",
    "at com.acme.net.HttpClient.execute(HttpClient.java:{n})",
    "at android.os.Handler.dispatchMessage(Handler.java:{n})",
    'File "/app/services/{path}.py", line {n}, in handle',
    "at Object.fetchData (main.{hex}.js:{n}:{attempt})",
    "at async Promise.all (index {attempt})",
]
TRACKING_EVENTS = [
    "Departed facility",
    "Arrived at sort facility",
    "Out for delivery",
    "Delivery exception: address not found",
    "In transit",
    "Held at customs",
    "Label created",
    "Delivery attempted, no one home",
    "Arrived at local depot",
]
LOGIN_EVENTS = [
    "login failed",
    "login succeeded",
    "password reset requested",
    "2FA challenge sent",
    "new device added",
    "session revoked",
    "email changed",
]
AGENT_LINES = [
    "Thank you for contacting us.",
    "I'm sorry to hear about the trouble.",
    "Could you please send us a screenshot of the error?",
    "I have escalated this to our specialist team.",
    "Please allow 3-5 business days for a response.",
    "Could you confirm the email address on the account?",
    "We apologise for the inconvenience.",
    "Is there anything else I can help you with?",
]
