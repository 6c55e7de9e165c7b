"""The model: one decoder definition for every supported family (decoder.py, single-GPU code
with Hugging Face parameter names), its fused MoE experts, weight loading (safetensors, GGUF,
MXFP4) with the shard plan of each parallel layout, and tiny random models for tests.

May import kernels, attention, parallel and the configuration; never the engine.
"""
