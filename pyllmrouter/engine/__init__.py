"""The worker process: llama.cpp loaded, one server engine per model (hosting.py),
the probe (probe.py) and the fit (fit.py) run where the devices are masked.

The router starts ``worker.worker_main`` in a spawned process; nothing here is
imported by the router process except that entry point's module, which loads
llama.cpp only inside the worker.
"""
