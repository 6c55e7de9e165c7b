"""Configuration: the model (read from a Hugging Face config.json and its families'
fields), the parallel layout, the engine, and the names of the choices options offer.

The base layer beside errors and options: imports torch (dtypes) but neither Triton nor
torch.distributed, so options and tools read it cheaply.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from ringserve.config.dense_families import DENSE_FAMILY_FIELDS
from ringserve.config.moe_families import MOE_FAMILY_FIELDS, TEXT_MODEL_OF
from ringserve.config.names import GATED_ACTIVATIONS
from ringserve.config.quantization import WeightQuantization, parse_quantization
from ringserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2ForCausalLM",
    "Gemma3ForCausalLM",
    "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration",  # its text model (Llama 4 Scout / Maverick as published)
    "GptOssForCausalLM",
)
# What each family sets beyond the Llama shape (config_dense_families / config_moe_families).
FAMILY_FIELDS = {**DENSE_FAMILY_FIELDS, **MOE_FAMILY_FIELDS}


@dataclass(frozen=True)
class AttentionWindow:
    """Which keys a query sees in one layer, with transformers' masks (masking_utils):
    a query at position p sees keys k <= p that also satisfy

    - sliding W: p - W < k (itself and the W - 1 keys before it);
    - chunk C: k // C == p // C (only its own chunk of C positions).

    Neither: full causal attention. Both may be set (a key must pass both).
    """

    sliding: int | None = None
    chunk: int | None = None

    def __post_init__(self):
        for name in ("sliding", "chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"AttentionWindow.{name} must be a positive integer or None, got {value!r}")

    @property
    def is_full(self) -> bool:
        return self.sliding is None and self.chunk is None

    def first_visible(self, position):
        """The first key position a query at `position` (an int or an integer tensor) sees;
        it never decreases as the position grows."""
        first = position - position  # 0, as an int or a tensor like position
        if self.sliding is not None:
            first = _maximum(first, position - self.sliding + 1)
        if self.chunk is not None:
            first = _maximum(first, position // self.chunk * self.chunk)
        return first

    def lookback(self) -> int | None:
        """The most keys before its own position a query may see (None: unbounded)."""
        spans = [w - 1 for w in (self.sliding, self.chunk) if w is not None]
        return min(spans) if spans else None


FULL_ATTENTION = AttentionWindow()


def _maximum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def first_visible_block(position: int, block_size: int, reach: AttentionWindow | int | None) -> int:
    """The first block with a key a query at `position` may see: the one host definition
    (attention/paged.py's kernel repeats the exact rule on the device).

    reach a window (one layer's): exact, the block of window.first_visible(position), what
    that layer's attention reads. reach a lookback (an int; None: block 0): the block of
    position - lookback, for what keeps blocks for several layers at once (a KV group, the
    CP layout's recent blocks). It never lies after the exact block of any window whose
    lookback is no wider, so those blocks hold every key their layers read.
    """
    if isinstance(reach, AttentionWindow):
        return reach.first_visible(position) // block_size
    if reach is None:
        return 0
    return max(0, position - reach) // block_size


def attention_windows_from_hf(hf, num_layers: int) -> tuple[AttentionWindow, ...]:
    """Each layer's window from a transformers config: `layer_types` where the config has
    it (full_attention, sliding_attention with `sliding_window`, chunked_attention with
    `attention_chunk_size`), else `sliding_window` on every layer (Mistral, Mixtral)."""
    sliding = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        return (AttentionWindow(sliding=sliding),) * num_layers
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    by_type = {
        "full_attention": FULL_ATTENTION,
        "sliding_attention": AttentionWindow(sliding=sliding),
        "chunked_attention": AttentionWindow(chunk=getattr(hf, "attention_chunk_size", None)),
    }
    unknown = sorted(set(layer_types) - set(by_type))
    if unknown:
        raise ModelLoadError(
            f"layer_types {unknown} are not supported (ringserve knows {', '.join(by_type)})"
        )
    return tuple(by_type[t] for t in layer_types)


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, read off a Hugging Face config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v
    o_proj_bias: bool = False  # a bias on o_proj (Llama-style attention_bias: all four)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    hidden_act: str = "silu"  # of the gated MLP: act(gate_proj(x)) * up_proj(x)
    # Gemma 3 (text): see config_dense_families.gemma3_fields.
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this), not 1/sqrt(head_dim)
    norm_unit_offset: bool = False  # RMSNorm weights w applied as (1 + w), in float32
    sandwich_norms: bool = False  # a norm before and after attention and after the MLP too
    embedding_scale: float | None = None  # embeddings times this (sqrt(hidden)) in the model dtype
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Per layer, its key in hf.rope_parameters when that holds a RoPE per layer type (Gemma 3's
    # "sliding_attention" and "full_attention"); (): one RoPE for every layer.
    rope_layer_types: tuple[str, ...] = ()
    # Mixture of experts (0 experts: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    moe_layers: tuple[int, ...] | None = None  # Llama 4: the MoE layers, when listed
    # How the router weighs the experts: "softmax" (softmax over all, top-k, optional
    # renormalisation), "sigmoid_scaled_input" (Llama 4: top-k logits, sigmoid, the expert's
    # input scaled by it), "topk_softmax" (gpt-oss: softmax over the top-k logits).
    moe_router: str = "softmax"
    # How expert weights are stored: "per_expert" (one tensor per expert and projection),
    # "fused_concat" (Llama 4: gate_up_proj [E, H, 2I], gate then up) or "fused_interleaved"
    # (gpt-oss: gate and up columns alternate).
    experts_layout: str = "per_expert"
    experts_bias: bool = False  # gpt-oss: biases on gate_up_proj and down_proj
    swiglu: tuple[float, float] | None = None  # gpt-oss: clamped SwiGLU (alpha, limit)
    shared_expert_intermediate_size: int = 0  # Llama 4: a dense expert every token runs
    # Attention variants (Llama 4, gpt-oss)
    o_proj_bias: bool = False
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    nope_layers: tuple[int, ...] = ()  # Llama 4: layers without RoPE
    rope_interleaved: bool = False  # Llama 4: RoPE rotates pairs (2i, 2i + 1) of each head
    qk_l2_norm: bool = False  # Llama 4: weightless RMS norm of q and k heads after RoPE
    # Llama 4 NoPE layers: q scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
    attn_temperature: tuple[float, float] | None = None  # (floor_scale, attn_scale)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: torch.dtype = torch.float32
    # Per layer: which keys a query sees (sliding windows, attention chunks); () is all full.
    attention_windows: tuple[AttentionWindow, ...] = ()
    hf_config: object = field(default=None, repr=False)  # the transformers config, for RoPE
    # A pre-quantised checkpoint's format (config.json quantization_config); None: plain weights.
    quantization: WeightQuantization | None = None

    @classmethod
    def from_pretrained(cls, folder: str) -> ModelConfig:
        path = os.path.join(folder, "config.json")
        if not os.path.isdir(folder):
            raise ModelLoadError(f"model folder not found: {folder}")
        if not os.path.isfile(path):
            raise ModelLoadError(f"no config.json in model folder {folder}")
        try:
            with open(path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"ringserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quantization = parse_quantization(raw.get("quantization_config"), arch)
        if quantization is not None and quantization.method == "mxfp4" and arch != "GptOssForCausalLM":
            raise ModelLoadError(
                f"{arch}: quantization_config.quant_method='mxfp4' is not supported "
                "(ringserve dequantises gpt-oss's MXFP4 experts only)"
            )
        from transformers import AutoConfig  # slow import: only when a model is loaded

        hf = AutoConfig.from_pretrained(folder)
        if arch in TEXT_MODEL_OF:  # a multimodal checkpoint: ringserve runs its text model
            config = cls.from_hf(hf.text_config, TEXT_MODEL_OF[arch])
            if _declared_dtype(hf.text_config) is None:  # the whole model's, then
                config.dtype = _declared_dtype(hf) or config.dtype
        else:
            config = cls.from_hf(hf.get_text_config(), arch)
        config.quantization = quantization
        return config

    @classmethod
    def from_hf(cls, hf, arch: str) -> ModelConfig:
        family = FAMILY_FIELDS[arch](hf) if arch in FAMILY_FIELDS else {}
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        num_experts = 0
        if arch == "MixtralForCausalLM":
            num_experts = hf.num_local_experts
        elif arch == "Qwen3MoeForCausalLM":
            num_experts = getattr(hf, "num_experts", None) or hf.num_local_experts
        dtype = _declared_dtype(hf) or torch.float32
        fields = dict(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            o_proj_bias=bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act=getattr(hf, "hidden_act", "silu"),
            num_experts=num_experts,
            num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
            if num_experts
            else 0,
            # Mixtral always renormalises its top-k weights; Qwen3-MoE says so in its config.
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
            decoder_sparse_step=getattr(hf, "decoder_sparse_step", None) or 1,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            dtype=dtype,
            attention_windows=attention_windows_from_hf(hf, hf.num_hidden_layers),
            hf_config=hf,
        )
        fields.update(family)
        config = cls(**fields)
        _refuse_unsupported(config, hf)
        return config

    @property
    def context_length(self) -> int:
        """The longest sequence the model was made for: max_position_embeddings, or, for a
        YaRN RoPE, its original length times its factor when that is longer (as vLLM derives
        it: a config can extend a model by YaRN without raising max_position_embeddings)."""
        length = self.max_position_embeddings
        hf = self.hf_config
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        ropes = [params.get(t) or {} for t in set(self.rope_layer_types)] or [params]
        for rope in ropes:
            kind = rope.get("rope_type", rope.get("type"))
            original, factor = rope.get("original_max_position_embeddings"), rope.get("factor")
            if kind == "yarn" and original and factor:
                length = max(length, int(original * factor))
        return length

    @property
    def attention_scale(self) -> float:
        """The factor on q.k before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_key(self, layer: int) -> str:
        """Which RoPE table layer `layer` uses: its layer type's (Gemma 3) or the one "default"."""
        return self.rope_layer_types[layer] if self.rope_layer_types else "default"

    def attention_window(self, layer: int) -> AttentionWindow:
        """Which keys layer `layer`'s queries see."""
        return self.attention_windows[layer] if self.attention_windows else FULL_ATTENTION

    @property
    def has_local_attention(self) -> bool:
        """Whether any layer attends through a sliding window or attention chunks."""
        return any(not w.is_full for w in self.attention_windows)

    @property
    def all_layers_local(self) -> bool:
        """Whether every layer attends through a window (so no layer reads a sequence's
        blocks before the longest lookback, and those can be released)."""
        return bool(self.attention_windows) and all(not w.is_full for w in self.attention_windows)

    @property
    def local_lookback(self) -> int | None:
        """The most keys before its own position a query of a windowed layer sees; None
        when every layer is full."""
        spans = [w.lookback() for w in self.attention_windows if not w.is_full]
        return max(spans) if spans else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` uses the MoE block (Qwen3-MoE keeps some dense)."""
        if not self.is_moe:
            return False
        if self.moe_layers is not None:
            return layer in self.moe_layers
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def _declared_dtype(hf) -> torch.dtype | None:
    """The dtype a transformers config declares for its weights, if any."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _refuse_unsupported(config: ModelConfig, hf) -> None:
    """Fields that change the math and that the model does not implement: refused by name,
    never run silently wrong."""
    arch = config.architecture
    # The MLP's activations (HF's ACT2FN names, applied to gate_proj's output); experts run silu only
    supported = ("silu",) if config.is_moe else tuple(GATED_ACTIVATIONS)
    if config.hidden_act not in supported:
        field_name = "hidden_activation" if hasattr(hf, "hidden_activation") else "hidden_act"
        raise ModelLoadError(
            f"{arch} with {field_name}={config.hidden_act!r} is not supported "
            f"(ringserve implements {', '.join(supported)} here)"
        )
    unimplemented = {
        "mlp_bias": "biases on the MLP projections",
        "attn_logit_softcapping": "capped attention scores",
        "use_bidirectional_attention": "bidirectional attention",
    }
    for name, what in unimplemented.items():
        if getattr(hf, name, None):
            raise ModelLoadError(
                f"{arch} with {name}={getattr(hf, name)!r} is not supported (ringserve has no {what})"
            )
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    per_type = [params[t] for t in sorted(set(config.rope_layer_types))] or [params]
    for rope in per_type:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in ("dynamic", "longrope"):
            raise ModelLoadError(
                f"{arch} with rope_type={rope_type!r} is not supported "
                "(its frequencies change with the sequence length; ringserve's are fixed)"
            )
        partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ModelLoadError(
                f"{arch} with partial_rotary_factor={partial!r} is not supported (ringserve rotates whole heads)"
            )


@dataclass(frozen=True)
class TPShard:
    """The sizes one tensor-parallel rank holds: its heads, MLP columns and vocabulary rows."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int  # KV heads are replicated when size > num_key_value_heads
    kv_head_start: int  # the first KV head this rank holds
    intermediate_size: int
    moe_intermediate_size: int
    vocab_start: int
    vocab_size: int  # rows held; the last rank's may run past the vocabulary (padding)
    expert_start: int = 0  # expert parallelism: this rank holds experts expert_start ..
    num_experts: int = 0  # .. expert_start + num_experts - 1, each whole

    @classmethod
    def whole(cls, config: ModelConfig) -> TPShard:
        return cls.of(config, 0, 1)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int, ep_rank: int = 0, ep_size: int = 1) -> TPShard:
        """ep_size > 1: experts are spread whole over the EP ranks instead of split by TP."""
        per_rank_vocab = -(-config.vocab_size // size)
        experts_per_rank = config.num_experts // ep_size
        return cls(
            rank=rank,
            size=size,
            num_heads=config.num_attention_heads // size,
            num_kv_heads=max(1, config.num_key_value_heads // size),
            # size > KV heads: ranks rank * kv // size share one head (the q heads it serves)
            kv_head_start=rank * config.num_key_value_heads // size,
            intermediate_size=config.intermediate_size // size,
            moe_intermediate_size=config.moe_intermediate_size // (size if ep_size == 1 else 1),
            vocab_start=rank * per_rank_vocab,
            vocab_size=per_rank_vocab,
            expert_start=ep_rank * experts_per_rank,
            num_experts=experts_per_rank,
        )


# The mesh's named dimensions, outermost first: world rank = (dp_rank x cp + cp_rank) x tp + tp_rank.
MESH_AXES = ("dp", "cp", "tp")
# The products of axes an EP group may span, in the order tried when several give the same
# ep: inner axes first (their ranks sit closer, on fewer hosts), then those with dp.
_EP_AXES_ORDER = (("tp",), ("cp",), ("cp", "tp"), ("dp",), ("dp", "tp"), ("dp", "cp"), ("dp", "cp", "tp"))


@dataclass
class ParallelConfig:
    """Sizes of the mesh's axes (dp replicas of tp x cp ranks) and of the EP groups over them.

    dp None: ep / (tp x cp) when ep is more than tp, cp and tp x cp give (`ep=4` alone is
    dp=4, ep=4, as vLLM's EP over DP x TP), else 1.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    ranks_per_host: int | None = None  # of the whole world (None: one host); parallel/mesh.py
    dp: int | None = None

    def __post_init__(self):
        if self.dp is None:
            inner = self.tp * self.cp
            needs_dp = self.ep not in (1, self.tp, self.cp, inner) and self.ep % inner == 0
            self.dp = self.ep // inner if needs_dp else 1
        for name in ("tp", "cp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.ep_axes  # noqa: B018 - validates ep against the axes

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def ep_axes(self) -> tuple[str, ...]:
        """The mesh dimensions the EP group spans (outermost first): a product of axes equal to ep."""
        if self.ep == 1:
            return ()
        for axes in _EP_AXES_ORDER:
            if math.prod(self.size(a) for a in axes) == self.ep and all(self.size(a) > 1 for a in axes):
                return axes
        raise ValueError(
            f"ep={self.ep} is no product of the mesh's axes dp={self.dp}, cp={self.cp}, tp={self.tp} "
            f"(it may be tp, cp, dp or a product of them: {', '.join(self._ep_choices())}): "
            "experts are spread over the ranks of those axes"
        )

    def _ep_choices(self) -> list[str]:
        sizes = {}
        for axes in _EP_AXES_ORDER:
            n = math.prod(self.size(a) for a in axes)
            if n > 1 and all(self.size(a) > 1 for a in axes):
                sizes.setdefault(n, " x ".join(axes))
        return [f"{n} ({name})" for n, name in sorted(sizes.items())] or ["1 (no other axis is above 1)"]

    @property
    def ep_spans_dp(self) -> bool:
        """EP groups reach across replicas: every replica takes part in every MoE layer of
        every step (lockstep), an idle one with no tokens."""
        return "dp" in self.ep_axes


@dataclass
class EngineConfig:
    """How the engine spends memory and work per step."""

    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int | None = None  # None: from kv_cache_memory (or the GPU's free memory)
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: a default per device
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048  # token budget of a step while some sequence decodes
    max_prefill_tokens: int | None = None  # of a step while none does; None: prefill_budget()
    max_num_seqs: int = 256  # sequences running at once
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs for decode
    kv_cache_dtype: str = "auto"  # names.KV_CACHE_DTYPES: auto (the model's dtype) or fp8
    quantization: str | None = None  # names.QUANTIZATION_METHODS: the weights quantised at load

    def prefill_budget(self) -> int:
        """Tokens a step computes while no sequence decodes: large chunks for a prompt alone
        (SGLang's max_prefill_tokens is 16384 too), never below max_num_batched_tokens."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return max(16384, self.max_num_batched_tokens)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, model_dtype: torch.dtype, device: torch.device):
    """'auto' takes the checkpoint's dtype (float16 on a CPU becomes bfloat16, which it runs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu" and model_dtype == torch.float16:
            return torch.bfloat16
        return model_dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
