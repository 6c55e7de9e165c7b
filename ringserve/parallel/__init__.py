"""Parallel axes: each takes explicit process groups from one mesh (mesh.py): tensor
parallelism with its allreduce, the context-parallel ring (pass-KV, pass-Q), expert
parallelism by all-to-all, and the local worlds that tests and calibrations start.

May import attention, kernels and the configuration; never the model or the engine (the
model hands its layers to these modules, not the reverse).
"""
