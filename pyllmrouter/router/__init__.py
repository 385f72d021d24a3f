"""The router process: admission, eviction, fit decisions, the worker pool.

Nothing in this package imports llama_cpp or the extension (tests/project/test_boundary.py):
requirements come from the probe cache (memory.py) or from a worker.  The
Python API is ``api.Router``.
"""
