"""``triage-bench``: every performance claim measured in one run, on the same tickets, as ratios.

Modules: ``workload`` (tickets, prompt variants), ``modes`` (how each batching
strategy drives the engine), ``gemm`` (device FLOP/s and model FLOP counting),
``report`` (table + JSON), ``plot`` (PNG), ``cli`` (wiring). Imports are lazy so
the GPU script needs little beyond torch + transformers.
"""
