"""Attention: dense and windowed prefill over packed sequences (dense.py, local.py), the plan
of which key blocks each query block sees (plan.py), and paged decode over the KV cache
through block tables (paged.py).

May import the kernels and the configuration; nothing above (no model, no process groups).
"""
