"""The rank side of the engine, as vLLM v1's worker: each rank (process) holds its shard of
the model and of the KV cache, receives a StepInput from the driver, and runs the forward
pass (runner.py), with CUDA graphs for decode (graphs.py).

May import model, attention, parallel, kernels and the configuration; never the driver
(ringserve.engine), so a rank process loads no scheduler.
"""
