"""Tools for tests, benches and the demo: generated GGUF models (tinymodels.py,
scripted.py), ggml rpc-servers and llama-server on loopback (loopback.py), and
the demo."""
