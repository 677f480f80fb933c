"""Benchmarks behind ``vllm-kvbridge bench``; each prints ratios to ceilings measured in the same run."""
