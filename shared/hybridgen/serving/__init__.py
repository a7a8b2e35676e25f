"""The public API as every process serves it: gRPC service and server, the OpenAI HTTP API, API
keys, the Backend protocol, streamed deltas, detokenization, stop strings and metrics.
"""
