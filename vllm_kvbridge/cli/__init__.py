"""The ``vllm-kvbridge`` command line."""
