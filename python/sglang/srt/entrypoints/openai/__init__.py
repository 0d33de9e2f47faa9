"""The OpenAI-compatible API: request models (protocol), /v1/completions and /v1/chat/completions (serving_*), and
the DeepSeek-V4 chat encoder (encoding_dsv4)."""
