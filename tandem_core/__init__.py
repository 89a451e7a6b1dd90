"""Shared runtime for every Tandem service: types, errors, settings blocks, the Redis key
schema and streams, the KV chunk codec, gRPC helpers, metrics and logging.

It MUST NOT import JAX or any service package: the gateway image ships without JAX.
"""
