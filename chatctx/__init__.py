"""chatctx: chatbot context and KV-cache management for llama.cpp."""
