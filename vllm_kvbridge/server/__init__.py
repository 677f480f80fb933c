"""``vllm-kvbridge serve``: an OpenAI-compatible HTTP server in front of a pipeline.

:mod:`~vllm_kvbridge.server.app` builds the FastAPI app, :mod:`~vllm_kvbridge.server.protocol`
holds the request schemas, :mod:`~vllm_kvbridge.server.metrics` the Prometheus metrics.
"""
