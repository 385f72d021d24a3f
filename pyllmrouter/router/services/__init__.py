"""llama-server's router services, beside the models' own endpoints.

    sources         the model list's sources: a preset, a models directory, llama.cpp's cache
    downloads       pulls into llama.cpp's cache, in short-lived processes
    conversations   resumable streams' conversations (X-Conversation-Id)
    streams         a relayed reply's stream of chunks
    events          what the router did, kept and pushed to listeners (/events, /models/sse)
    tools           llama-server's /tools and /cors-proxy in a services worker
"""
