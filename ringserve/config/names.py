"""The names of choices that options and configuration check, kept apart from the code
that implements them, so that reading them imports neither Triton nor torch.distributed."""

# config.json's hidden_act values the gated MLP implements (kernels/skinny_matmul.py)
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# --allreduce: torch's (NCCL, gloo), the direct-access one-shot / two-shot, or chosen by size
ALLREDUCE_BACKENDS = ("auto", "torch", "one_shot", "two_shot")
# --cp-algo: the context-parallel ring, or chosen per step from new against cached tokens
CP_ALGOS = ("auto", "pass_kv", "pass_q")
# --kv-cache-dtype (vLLM's names): auto keeps the model's dtype; fp8 / fp8_e4m3 store float8
# e4m3 with a scale per layer and KV head (kernels/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# --quantization: online quantisation of a checkpoint's weights (model/quantize.py); None: none
QUANTIZATION_METHODS = ("fp8",)
