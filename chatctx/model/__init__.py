"""What chatctx knows about a model without running it: pure Python, never llama.cpp.

::

    gguf       read a GGUF's metadata and tensor table
    template   chat templates (the GGUF's Jinja template, or a named built-in format)
    codec      exact token counts and prompts: the model's vocabulary through tiktoken
    kv         planning KV cache reuse (which cached spans a new prompt can keep)
    memory     planning memory: weights, KV cache and compute buffers for a context size
    paths      where model files come from (``CHATCTX_HOME``, ``CHATCTX_MODEL``, the default)
    embedder   the sentence embedder's GGUF, converted once from its bundled weights
    cpus       how many threads this process should use

The backends (``chatctx.backends``) run models; everything here is what they, the context
builder and the planners share.
"""
