"""Build a model on the meta device and fill it from safetensors files, tensor by tensor.

Tensors are found by their on-disk names; MoE checkpoints keep one tensor per expert,
which lands in its slot of the stacked expert parameter, and the separate q/k/v (gate/up)
tensors land in their rows of the model's fused qkv_proj (gate_up_proj). `ShardPlan`
(tensor parallelism) says which slice of a tensor this rank owns, so each rank reads only
its own bytes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from ringserve.config import ModelConfig, TPShard
from ringserve.config.quantization import FP8_METHODS
from ringserve.errors import ModelLoadError
from ringserve.kernels.kv_quant import FP8_DTYPE, fp8_supported
from ringserve.model.decoder import Experts, Linear, MergedLinear, Transformer
from ringserve.model.fp8 import is_fp8, pair_fp8, scaled_modules, scales_first
from ringserve.model.mxfp4 import pair_quantized

logger = logging.getLogger(__name__)

# On-disk expert tensors -> (stacked parameter, expert index).
_EXPERT_PATTERNS = [
    # Mixtral: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
    (
        re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$"),
        {"1": "gate_proj", "3": "up_proj", "2": "down_proj"},
    ),
    # Qwen3-MoE: mlp.experts.{e}.gate_proj / up_proj / down_proj
    (re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"), None),
]
_RENAMES = [
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"^language_model\."), ""),  # Llama 4 as published (multimodal): its text model
    (re.compile(r"\.feed_forward\."), ".mlp."),  # Llama 4
]
# q and k rows, which RoPE rotates.
_ROTATED = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
# Tensors some checkpoints carry that the model recomputes, or does not run (a vision tower).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|^(vision_model|multi_modal_projector)\.")
# An FP8 KV cache's scales (compressed-tensors' kv_cache_scheme; vLLM's older k_proj.output_scale)
_KV_CACHE_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def checkpoint_param_name(name: str) -> tuple[str, int | None]:
    """Map an on-disk tensor name to (model parameter name, expert index or None)."""
    for pattern, names in _EXPERT_PATTERNS:
        m = pattern.match(name)
        if m:
            prefix, expert, which = m.groups()
            which = names[which] if names else which
            return f"{prefix}.mlp.experts.{which}", int(expert)
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name, None


class ShardPlan:
    """Which part of each tensor this rank holds; the default holds every tensor whole."""

    def local_slice(self, param_name: str, full_shape: tuple[int, ...]):
        """A tuple of slices into the on-disk tensor, or None for all of it. One dimension's
        entry may be a list of slices: their pieces, concatenated along it."""
        return None

    def pads(self, param_name: str) -> bool:
        """Whether the parameter may hold more rows than its slice (zero padding)."""
        return False

    def local_expert(self, expert: int) -> int | None:
        """Where on-disk expert `expert` goes in this rank's stack; None: not on this rank."""
        return expert


def merged_parts(model: Transformer) -> dict[str, tuple[str, slice]]:
    """The checkpoint names of the projections a `MergedLinear` stacks -> (its parameter,
    their rows in it): `...self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, the
    rows after this rank's q heads)."""
    parts = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = module_name.rpartition(".")[0]
            kinds = ("weight", "bias") if module.bias is not None else ("weight",)
            for part, rows in module.part_rows().items():
                for kind in kinds:
                    parts[f"{parent}.{part}.{kind}"] = (f"{module_name}.{kind}", rows)
    return parts


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a model folder: one file, or the shards its index names."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(f"no .safetensors weights in {folder}")
    paths = [os.path.join(folder, f) for f in files]
    for path in paths:
        if not os.path.isfile(path):
            raise ModelLoadError(f"weight file listed in the index is missing: {path}")
    return paths


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    shard: TPShard | None = None,
    fp8_checkpoint: list[str] | None = None,
) -> Transformer:
    """The model's modules with uninitialised storage on `device` (no weights read yet).
    fp8_checkpoint: the tensor names of a row-wise FP8 checkpoint, whose FP8 Linear weights
    (`stored_fp8_weights`) are held as float8 e4m3 with a float32 scale per row."""
    with default_dtype(dtype), torch.device("meta"):
        model = Transformer(config, shard)
        fp8_weights = stored_fp8_weights(model, fp8_checkpoint) if fp8_checkpoint is not None else ()
        if fp8_checkpoint is not None:
            logger.info("FP8 checkpoint: %d projections served in float8 e4m3 as stored", len(fp8_weights))
        for name in fp8_weights:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            weight = getattr(module, attr)  # [out, in], or an expert stack's [E, out, in]
            setattr(
                module, attr, nn.Parameter(torch.empty_like(weight, dtype=FP8_DTYPE), requires_grad=False)
            )
            # a scale per output row: Linear's weight_scale [out], Experts' gate_proj_scale [E, out]...
            setattr(module, attr + "_scale", torch.empty(weight.shape[:-1], dtype=torch.float32))
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own storage: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    for rotary in model.model.rotary_emb.values():
        rotary.reset_buffers()
    return model.eval().requires_grad_(False)


def stored_fp8_weights(model: Transformer, checkpoint_names) -> set[str]:
    """The model's weights a row-wise FP8 checkpoint (per channel or per tensor: a scale per
    row holds it exactly) stores in FP8 whole: a Linear's with every part of a merged one
    (q/k/v, gate/up), and stacked MoE experts' (Experts) where every expert's gate, up and
    down projections are (their FP8 matmuls take all three). Left to dequantise: the LM
    head, and fused experts (Llama 4, gpt-oss: their FP8 layout is column-major)."""
    merged = merged_parts(model)
    linear_parts: dict[str, set[str]] = {}  # a Linear's weight -> its scaled (merged) parts
    expert_parts: dict[str, set[tuple[str, int]]] = {}  # an expert stack -> (weight, expert)
    for module in scaled_modules(checkpoint_names):
        param_name, expert = checkpoint_param_name(module + ".weight")
        if expert is None:
            target, _ = merged.get(param_name, (param_name, None))
            linear_parts.setdefault(target, set()).add(param_name)
        else:
            expert_parts.setdefault(param_name.rpartition(".")[0], set()).add((param_name, expert))
    stored = set()
    for target, got in linear_parts.items():
        module = model.get_submodule(target.rpartition(".")[0])
        if isinstance(module, Linear) and module is not model.lm_head:
            if len(got) == (len(module.parts) if isinstance(module, MergedLinear) else 1):
                stored.add(target)
    for owner, got in expert_parts.items():
        if isinstance(model.get_submodule(owner), Experts) and len(got) == 3 * model.config.num_experts:
            stored.update(f"{owner}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    return stored


def checkpoint_names(folder: str, tensors: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Every tensor name of a checkpoint (the files' headers only)."""
    if tensors is not None:
        return list(tensors)
    names = []
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            names += list(f.keys())
    return names


def _file_tensors(folder: str):
    """(name, origin, read(index)) for every tensor of a folder's safetensors files."""
    for path in checkpoint_files(folder):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type for bad headers
            raise ModelLoadError(f"cannot read weight file {path}: {e}") from e
        with handle as f:
            for name in scales_first(f.keys()):

                def read(index, name=name, f=f):
                    source = f.get_slice(name)
                    return read_index(source, index(tuple(source.get_shape())))

                yield name, path, read


def read_index(source, index) -> torch.Tensor:
    """source[index] for a tensor or a safetensors slice; a list of slices in one dimension
    reads each piece and concatenates them along it (e.g. one TP rank's gate and up columns
    of a fused [E, H, 2I] tensor)."""
    if index is None:
        return source[...]  # [...] reads a 0-dim tensor too ([:] cannot)
    for dim, entry in enumerate(index):
        if isinstance(entry, list):
            pieces = [source[index[:dim] + (piece,) + index[dim + 1 :]] for piece in entry]
            return torch.cat(pieces, dim=dim)
    return source[index]


def deinterleave_heads(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q or k projection rows [n * D, ...] -> each head's rows reordered even ones first, then
    odd ones: RoPE on interleaved pairs (2i, 2i + 1) (Llama 4) becomes the half-split RoPE on
    pairs (i, i + D/2), with the same q.k (both reordered alike; norms over D unchanged)."""
    heads = rows.reshape(-1, head_dim // 2, 2, *rows.shape[1:])
    return heads.transpose(1, 2).reshape(rows.shape)


def _memory_tensors(tensors: Mapping[str, torch.Tensor]):
    for name in scales_first(tensors):
        tensor = tensors[name]

        def read(index, tensor=tensor):
            return read_index(tensor, index(tuple(tensor.shape)))

        yield name, "memory", read


def load_weights(
    model: Transformer,
    folder: str,
    plan: ShardPlan | None = None,
    show_progress: bool = False,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Copy every checkpoint tensor into its place in `model`, checking names and shapes.

    tensors: take the weights from this mapping (Hugging Face names) instead of the
    folder's files, e.g. a transformers model's state_dict in a benchmark.
    """
    plan = plan or ShardPlan()
    params = dict(model.named_parameters())
    merged = merged_parts(model)
    # What must be filled, by checkpoint name: every parameter, a merged one by its parts.
    expected = {n: p for n, p in params.items() if n not in {target for target, _ in merged.values()}}
    expected.update({part: params[target] for part, (target, _) in merged.items()})
    filled: dict[str, set] = {}
    from tqdm import tqdm

    # No bar object unless it is shown: tqdm makes a multiprocessing lock even when disabled,
    # and a parallel rank that is stopped by a signal would leave that semaphore behind.
    progress = tqdm(total=len(expected), desc="Loading weights", unit="tensor") if show_progress else None
    source = pair_quantized(_memory_tensors(tensors) if tensors is not None else _file_tensors(folder))
    config = model.config
    quantization = config.quantization
    if quantization is not None and quantization.method in FP8_METHODS:
        source = pair_fp8(source, quantization.block)
    for name, origin, read in source:
        if _IGNORED.search(name):
            continue
        if kv_scale := _KV_CACHE_SCALE.search(name):
            which = 0 if (kv_scale[2] or kv_scale[3]) == "k" else 1
            model.kv_cache_scales[int(kv_scale[1]), which] = read(lambda shape: None).float().flatten().cpu()
            continue
        param_name, expert = checkpoint_param_name(name)
        # The plan slices by checkpoint name (q_proj, ...); the rows go into the merged parameter.
        target_name, rows = merged.get(param_name, (param_name, None))
        param = params.get(target_name)
        if param is None:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            logger.warning("ignoring tensor %s in %s: the model has no such parameter", name, origin)
            continue
        if expert is not None:
            expert = plan.local_expert(expert)
            if expert is None:
                continue  # another expert-parallel rank's expert: not read
        target = param[expert] if expert is not None else param
        if rows is not None:
            target = target[rows]
        index = lambda shape, param_name=param_name: plan.local_slice(param_name, shape)  # noqa: E731
        scale = None
        try:
            if is_fp8(param):  # served as stored: its bytes and its rows' scales
                tensor, scale = read.stored(index)
            else:
                tensor = read(index)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} from {origin} (truncated file?): {e}") from e
        if is_fp8(tensor) and scale is None:
            raise ModelLoadError(
                f"tensor {name} in {origin} is {tensor.dtype} without a weight_scale beside it "
                "(ringserve dequantises FP8 weights of a compressed-tensors or fp8 quantization_config)"
            )
        if (
            plan.pads(param_name)
            and tensor.shape[0] < target.shape[0]
            and tensor.shape[1:] == target.shape[1:]
        ):
            # The last rank's vocabulary rows run past the vocabulary: zero the padding.
            target[tensor.shape[0] :].zero_()
            target = target[: tensor.shape[0]]
        if config.rope_interleaved and param_name.endswith(_ROTATED):
            tensor = deinterleave_heads(tensor, config.head_dim)
            scale = None if scale is None else deinterleave_heads(scale, config.head_dim)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name} in {origin} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
        if scale is not None:
            owner, _, attr = target_name.rpartition(".")
            scales = getattr(model.get_submodule(owner), attr + "_scale")
            scales = scales if expert is None else scales[expert]
            (scales if rows is None else scales[rows]).copy_(scale)
        done = filled.setdefault(param_name, set())
        done.add(expert)
        if progress is not None and (expert is None or len(done) == param.shape[0]):
            progress.update(1)
    if progress is not None:
        progress.close()
    stacked = {
        f"{module_name}.{p}"
        for module_name, module in model.named_modules()
        if isinstance(module, Experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    missing = []
    for name, param in expected.items():
        done = filled.get(name, set())
        if name in stacked:
            absent = sorted(set(range(param.shape[0])) - done)
            missing += [f"{name}[expert {e}]" for e in absent]
        elif not done:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint in {folder} lacks {len(missing)} tensor(s): {shown}")


def load_model(
    config: ModelConfig,
    folder: str,
    device: torch.device,
    dtype: torch.dtype,
    plan: ShardPlan | None = None,
    show_progress: bool = False,
    tensors: Mapping[str, torch.Tensor] | None = None,
    shard: TPShard | None = None,
) -> Transformer:
    fp8_checkpoint = None
    quantization = config.quantization
    if quantization is not None and quantization.method in FP8_METHODS and quantization.block is None:
        if fp8_supported(device):
            fp8_checkpoint = checkpoint_names(folder, tensors)
        else:
            logger.warning(
                "FP8 checkpoint on a GPU without FP8 matmuls: its weights dequantised to %s", dtype
            )
    model = build_model(config, device, dtype, shard, fp8_checkpoint)
    load_weights(model, folder, plan, show_progress, tensors)
    return model
