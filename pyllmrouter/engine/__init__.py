"""The worker process: llama.cpp loaded, one server engine per model (hosting.py),
the probe (probe.py) and the fit (fit.py) run where the devices are masked.

The router starts ``worker.main`` in a fresh interpreter (router/workers/handle.py), its
device mask already in its environment; nothing here is imported by the router
process.
"""
