"""Prefill/decode disaggregation: a prefill server computes a prompt's KV state and first token, then writes them
into the memory of the decode server that decodes the rest (transfer.py: the transport; bootstrap.py and
messages.py: how the two sides agree on a request's room and report its end)."""
