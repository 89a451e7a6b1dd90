"""Tandem gateway: OpenAI-compatible HTTP (SSE) and gRPC front door.

Validates and tokenizes requests, enqueues them on the Redis admission streams and relays each
request's token stream back to its client (`relay.py`). Imports `tandem_core` and `tandem_proto`
only: no JAX, no engine, no other service.
"""
