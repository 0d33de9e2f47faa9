"""OpenAI-compatible serving pieces: the DeepSeek-V4 chat encoder (encoding_dsv4) lives here."""
