"""Everything that runs a model for chatctx, behind one protocol.

::

    base          the protocols (Backend, Lease, Stream, Codec, TextEmbedder) and result types
    pool          the slot pool: which conversation's cache sits in which sequence, first come
    swap          caches swapped out of a slot, to RAM and disk
    engine/       llama.cpp in this process (Engine)
    llama_server/ llama.cpp's llama-server over HTTP (LlamaServerBackend)
    router        many backends as one: placement by cached prefix, failover
    dry           a backend that runs no model: exact counts and cache plans, for replays
    device        the process's memory and the GPU's, for turn records

A backend takes token-exact prompts from the context builder and reports what its KV cache
did; the session never needs to know which one it talks to.
"""
