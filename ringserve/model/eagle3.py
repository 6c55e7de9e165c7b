"""EAGLE-3 draft heads (Li et al., 2025), in the layout peers publish (EAGLE's own
checkpoints, e.g. EAGLE3-LLaMA3.1-Instruct-8B, and vLLM's): one decoder layer that drafts
from the target's own hidden states.

The target keeps, for every token it computes, fc(cat(h_a, h_b, h_c)) [H]: the hidden states
entering three of its layers (by default 2, L // 2 and L - 3; the checkpoint's
`eagle_aux_hidden_state_layer_ids` when given), mixed by the head's `fc` [H, 3 H_target]
(`HiddenCapture`, stored by token slot in a cache beside the KV cache: the same block ids).
The head at position i reads the token at i + 1 and that mix g_i (or, for its own later
guesses, its own previous output):

    x = [input_layernorm(embed(token)), hidden_norm(g)]              [T, 2H]
    h = attention(x) + g          (q, k, v from 2H wide rows; RoPE at position i)
    h = mlp(post_attention_layernorm(h)) + h
    logits = lm_head(norm(h))     [T, draft vocabulary];  the next input hidden state is h

and guesses the token at i + 2. A draft id d is target id d + d2t[d] (a smaller draft
vocabulary). `norm_before_residual` (vLLM's field): the residual is hidden_norm(g), not g.
Weight names: fc.weight, midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm.weight, lm_head.weight, d2t, t2d
(unused), and embed_tokens.weight or none (the target's embedding then).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ringserve.config import ModelConfig, TPShard
from ringserve.errors import ModelLoadError
from ringserve.model.decoder import (
    MLP,
    Attention,
    Linear,
    MergedLinear,
    RotaryEmbedding,
    VocabParallelEmbedding,
    make_norm,
)
from ringserve.parallel.comm import gather_rows

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass
class Eagle3Checkpoint:
    """An EAGLE-3 head's folder, read and checked against its target (no weights yet)."""

    path: str
    config: ModelConfig  # its decoder layer's; vocabulary: the target's (its embedding)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose input hidden states it reads
    norm_before_residual: bool

    @classmethod
    def read(cls, path: str, target: ModelConfig) -> Eagle3Checkpoint:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(f"EAGLE-3 head: no config.json in {path}")
        with open(config_path) as f:
            raw = json.load(f)
        archs = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ModelLoadError(
                f"{config_path}: not an EAGLE-3 head (architectures {archs}; expected one of {ARCHITECTURES})"
            )
        from transformers import LlamaConfig

        fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
        hf = LlamaConfig(**{**fields, "num_hidden_layers": 1, "vocab_size": target.vocab_size})
        config = ModelConfig.from_hf(hf, "LlamaForCausalLM")
        target_hidden = raw.get("target_hidden_size") or target.hidden_size
        if target_hidden != target.hidden_size:
            raise ModelLoadError(
                f"EAGLE-3 head {path} reads hidden states of width {target_hidden}; the model's are "
                f"{target.hidden_size}: it was trained for another model"
            )
        if config.hidden_size != target.hidden_size:
            raise ModelLoadError(
                f"EAGLE-3 head {path} is {config.hidden_size} wide and the model {target.hidden_size}: "
                "a head of another width than its model is not supported (it shares the model's embedding)"
            )
        n = target.num_hidden_layers
        layers = tuple(raw.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))
        if len(layers) != 3 or not all(0 < i < n for i in layers):
            raise ModelLoadError(
                f"EAGLE-3 head {path}: aux layers {list(layers)} do not fit a {n}-layer model"
            )
        draft_vocab = raw.get("draft_vocab_size") or target.vocab_size
        return cls(path, config, draft_vocab, layers, bool(raw.get("norm_before_residual")))

    def tensors(self) -> dict[str, torch.Tensor]:
        return read_tensors(self.path)

    def has_embedding(self) -> bool:
        """Whether it has an embedding of its own (read from safetensors headers; a .bin
        counts as none)."""
        from safetensors import safe_open

        for path in weight_files(self.path):
            if path.endswith(".safetensors"):
                with safe_open(path, framework="pt", device="cpu") as f:
                    if "embed_tokens.weight" in f.keys():
                        return True
        return False

    def weight_bytes(self) -> int:
        """Its weight files' bytes: what its weights take at most in memory."""
        return sum(os.path.getsize(f) for f in weight_files(self.path))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """The hidden-state cache's bytes per token slot (one [H] mix)."""
        return self.config.hidden_size * torch.empty((), dtype=dtype).element_size()


def weight_files(path: str) -> list[str]:
    """An EAGLE-3 checkpoint's weight files: its .safetensors, or else its PyTorch .bin."""
    names = sorted(os.listdir(path))
    files = [n for n in names if n.endswith(".safetensors")] or [n for n in names if n.endswith(".bin")]
    if not files:
        raise ModelLoadError(f"EAGLE-3 head {path}: no .safetensors or .bin weights")
    return [os.path.join(path, n) for n in files]


def read_tensors(path: str, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE-3 checkpoint by name (weight_files): all of them, or only
    `names` (from safetensors without reading the others)."""
    from safetensors import safe_open

    out = {}
    for full in weight_files(path):
        if full.endswith(".safetensors"):
            with safe_open(full, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if names is None or key in names:
                        out[key] = f.get_tensor(key)
        else:
            tensors = torch.load(full, map_location="cpu", weights_only=True)
            out.update(tensors if names is None else {k: v for k, v in tensors.items() if k in names})
    return out


class HiddenCapture(nn.Module):
    """The target's side: fc(cat(hidden states entering `layers`)) of each new token, written
    to `cache` [slots, H] at the token's slot in KV group `group`. fc is applied a part at a
    time (acc += h_j @ fc_j^T), so no [T, 3H] concatenation is ever held.

    Only rank 0 keeps a cache (the other ranks' has zero slots), with every CP rank's and
    every data-parallel replica's slots: slot (replica r, CP rank c, local slot s) is
    r * replica_slots + c * rank_slots + s, i.e. the engine's block id * block_size + offset
    with the drafter's replica offset (parallel/cp/layout.py, engine/draft_model.py). Under
    context or data parallelism (`travels`) each rank of tensor rank 0 keeps its step's
    mixes with their slots; after the forward the runner gathers a replica's to its CP rank
    0 (`gather_ring`), and the replicas' leaders theirs to rank 0 (`gather_replicas`), which
    stores them. A step of at most staging_rows tokens (every step a decode graph replays)
    keeps them in persistent buffers, written inside the captured region, so a replay
    refreshes them; a longer (eager) step keeps references to its own tensors."""

    def __init__(
        self,
        layers: tuple[int, ...],
        fc_weight: torch.Tensor,
        cache: torch.Tensor,
        group: int,
        rank_slots: int = 0,
        cp: int = 1,
        replicas: int = 1,
        staging_rows: int = 0,
    ):
        super().__init__()
        self.layers = layers
        width = fc_weight.shape[1] // len(layers)
        self.parts = [fc_weight[:, j * width : (j + 1) * width] for j in range(len(layers))]
        self.cache = cache
        self.group = group
        self.rank_slots = rank_slots  # slots of one CP rank's pool (its blocks x block size)
        self.replica_slots = cp * rank_slots
        self.ring = cp > 1  # a replica's mixes meet on its CP rank 0
        self.replicas = replicas
        # A step's mixes [T, H] and their slots [T] in the replica: in the staging buffers
        # (None here), or a longer eager step's own tensors.
        self.step_mix: torch.Tensor | None = None
        self.step_slots: torch.Tensor | None = None
        rows = staging_rows if self.travels else 0
        self.staging = fc_weight.new_zeros(rows, fc_weight.shape[0])
        self.staging_slots = torch.zeros(rows, dtype=torch.int64, device=fc_weight.device)

    @classmethod
    def start(
        cls, path: str, layers, group: int, num_slots: int, hidden: int, dtype, device, **layout
    ) -> HiddenCapture:
        """The head's fc from its checkpoint at `path`, and an empty cache of num_slots mixes;
        layout: rank_slots, cp, replicas and staging_rows (the constructor's)."""
        fc = read_tensors(path, ("fc.weight",))["fc.weight"].to(device=device, dtype=dtype)
        cache = torch.zeros(num_slots, hidden, dtype=dtype, device=device)
        return cls(tuple(layers), fc, cache, group, **layout)

    @property
    def travels(self) -> bool:
        """Whether the step's mixes go to rank 0 after the forward, rather than into the cache."""
        return self.ring or self.replicas > 1

    def add(self, layer: int, hidden: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
        part = self.parts[self.layers.index(layer)]
        return torch.matmul(hidden, part.t()) if acc is None else torch.addmm(acc, hidden, part.t())

    def store(self, mix: torch.Tensor, ctx) -> None:
        slots = ctx.slot_mapping[self.group]
        if not self.travels:
            self.cache.index_copy_(0, slots, mix.to(self.cache.dtype))
        elif mix.shape[0] <= self.staging.shape[0]:
            self.staging[: mix.shape[0]].copy_(mix)
            self.staging_slots[: mix.shape[0]].copy_(slots)
            self.step_mix = self.step_slots = None  # (an earlier eager step's, never gathered)
        else:
            self.step_mix, self.step_slots = mix, slots.to(torch.int64)

    def _step(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's step: count tokens' mixes [count, H] and slots [count]."""
        if self.step_mix is not None:
            mix, slots = self.step_mix[:count], self.step_slots[:count]
            self.step_mix = self.step_slots = None
            return mix, slots
        return self.staging[:count], self.staging_slots[:count]

    def gather_ring(self, owners: torch.Tensor, cp_group) -> None:
        """Under CP, after the step's forward: owners [T] (the CP rank computing each of the
        step's tokens, packed order) -> the replica's mixes and their slots on its CP rank 0
        (stored there when it is rank 0)."""
        counts = torch.bincount(owners, minlength=dist.get_world_size(cp_group)).tolist()
        mix, slots = self._step(counts[dist.get_rank(cp_group)])
        mixes = gather_rows(mix, counts, cp_group)
        slots = gather_rows(slots, counts, cp_group)
        if mixes is None:  # not CP rank 0
            return
        offsets = [rank * self.rank_slots + s.to(mixes[0].device) for rank, s in enumerate(slots)]
        self.step_mix, self.step_slots = torch.cat(mixes), torch.cat(offsets)
        if self.replicas == 1:
            self._flush(0)

    def gather_replicas(self, counts: list[int], dp_group) -> None:
        """Under data parallelism, on a replica's leader after its forward (counts: each
        replica's new tokens this step, 0 for an idle one) -> every replica's mixes in rank
        0's cache."""
        mix, slots = self._step(counts[dist.get_rank(dp_group)])  # none for an idle replica
        mixes = gather_rows(mix, counts, dp_group)
        slots = gather_rows(slots, counts, dp_group)
        if mixes is None:  # not rank 0
            return
        for replica, (rows, where) in enumerate(zip(mixes, slots)):
            self.step_mix, self.step_slots = rows, where
            self._flush(replica)

    def _flush(self, replica: int) -> None:
        """The gathered step (step_mix, step_slots) into the cache, at replica's slots."""
        where = self.step_slots.to(self.cache.device) + replica * self.replica_slots
        self.cache.index_copy_(0, where, self.step_mix.to(self.cache.dtype))
        self.step_mix = self.step_slots = None


class _Backbone(nn.Module):
    """What ModelRunner reads of a model: embedding, layers, norm, RoPE tables."""

    def __init__(self, config: ModelConfig, shard: TPShard):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, 0, config.vocab_size
        )
        self.layers = nn.ModuleList([_Eagle3Layer(config, shard)])
        self.norm = make_norm(config, config.hidden_size)
        self.rotary_emb = nn.ModuleDict({"default": RotaryEmbedding(config)})


class _Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, shard: TPShard):
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = make_norm(config, hidden)
        self.hidden_norm = make_norm(config, hidden)
        self.self_attn = Attention(config, 0, shard)
        # q, k and v read [embedding; hidden state], twice the model's width.
        attn = self.self_attn
        q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        attn.qkv_proj = MergedLinear(
            2 * hidden, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, False
        )
        self.post_attention_layernorm = make_norm(config, hidden)
        self.mlp = MLP(hidden, config.intermediate_size, config.hidden_act)


class Eagle3Head(nn.Module):
    """The draft head, with a Transformer's protocol (ModelRunner and its decode graphs run it):
    `forward(tokens, positions, ctx)` -> the normalised state [T, H] whose `compute_logits`
    score the draft vocabulary. Its other input and output are buffers the caller fills and
    reads, so a captured graph reads and writes them in place: `hidden_in` [>= T, H], each
    new token's input hidden state, and `hidden_out` [>= T, H], the next one (pre-norm)."""

    def __init__(self, checkpoint: Eagle3Checkpoint):
        super().__init__()
        config = checkpoint.config
        self.config = config
        self.shard = TPShard.whole(config)
        self.model = _Backbone(config, self.shard)
        self.lm_head = Linear(config.hidden_size, checkpoint.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(checkpoint.draft_vocab_size, dtype=torch.int64))
        self.norm_before_residual = checkpoint.norm_before_residual
        self.hidden_capture = None  # a head captures nothing (the model protocol's field)
        self.hidden_in: torch.Tensor | None = None
        self.hidden_out: torch.Tensor | None = None

    @property
    def logits_width(self) -> int:
        return self.lm_head.weight.shape[0]

    def forward(self, input_ids, positions, ctx):
        t = input_ids.shape[0]
        hidden = self.hidden_in[:t]
        layer = self.model.layers[0]
        pos = self.model.rotary_emb["default"](positions, hidden.dtype)
        g = layer.hidden_norm(hidden)
        residual = g if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(self.model.embed_tokens(input_ids, ctx)), g], dim=-1)
        h, residual = layer.post_attention_layernorm(layer.self_attn(x, pos, ctx), residual)
        normed, prenorm = self.model.norm(layer.mlp(h, ctx), residual)
        self.hidden_out[:t].copy_(prenorm)
        return normed

    def compute_logits(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> [N, draft vocabulary] float32 (into out when given; Linear.float_output)."""
        return self.lm_head.float_output(normed, out)

    def target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, draft vocabulary] -> [B] int64 target ids: the likeliest entry, mapped by d2t."""
        draft = logits.argmax(dim=-1)
        return draft + self.d2t[draft]

    def load(self, tensors: dict[str, torch.Tensor], target_embedding: torch.Tensor) -> None:
        """The checkpoint's tensors (Eagle3Checkpoint.tensors) into the head; the embedding is
        the target's (shared, not copied) unless the checkpoint has its own. A head over the
        whole vocabulary may leave d2t out (every offset 0, as vLLM reads it)."""
        layer = self.model.layers[0]
        own = {"norm.weight": self.model.norm.weight, "lm_head.weight": self.lm_head.weight}
        if "d2t" in tensors or self.d2t.shape[0] < self.config.vocab_size:
            own["d2t"] = self.d2t
        else:
            self.d2t.zero_()
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            own[f"midlayer.{name}.weight"] = getattr(layer, name).weight
        own["midlayer.self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        own["midlayer.mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        merged = {
            f"midlayer.self_attn.{part}.weight": (layer.self_attn.qkv_proj, part)
            for part in ("q_proj", "k_proj", "v_proj")
        }
        merged.update(
            {
                f"midlayer.mlp.{part}.weight": (layer.mlp.gate_up_proj, part)
                for part in ("gate_proj", "up_proj")
            }
        )
        missing = [name for name in [*own, *merged] if name not in tensors]
        if missing:
            raise ModelLoadError(f"EAGLE-3 head: missing tensors {missing}")
        with torch.no_grad():
            for name, param in own.items():
                _copy(param, tensors[name], name)
            for name, (module, part) in merged.items():
                _copy(module.weight[module.part_rows()[part]], tensors[name], name)
            embedding = tensors.get("embed_tokens.weight")
            if embedding is not None:
                _copy(self.model.embed_tokens.weight, embedding, "embed_tokens.weight")
            else:
                self.model.embed_tokens.weight = nn.Parameter(target_embedding, requires_grad=False)


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ModelLoadError(f"EAGLE-3 head: {name} is {list(value.shape)}, expected {list(param.shape)}")
    param.copy_(value.to(param.dtype))
