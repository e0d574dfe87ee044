"""Serving ReFusion checkpoints with vLLM: the native export a server loads (`serving.export`), the pinned vLLM
environment (`requirements-vllm*.txt`, built by `scripts/serve.sh`) and the vLLM plugin that lets a ReFusion
checkpoint draft for vLLM's speculative decoding (`refusion_vllm/`)."""
