"""Kernels: Triton and fused element-wise ops, the skinny (decode) matmul, the merge of
partial attention outputs by their log-sum-exp, and programmatic dependent launch.

The bottom layer: imports torch, Triton and the configuration only.
"""
