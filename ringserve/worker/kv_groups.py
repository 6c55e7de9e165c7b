"""Layers grouped by how far back they read the KV cache, so each group keeps only the
blocks its own layers can still see (per-layer-type block accounting, as vLLM's hybrid
KV-cache manager does).

Layers with the same lookback (full attention: unbounded; a sliding window W: W - 1; a
chunk C: up to C - 1) form a group; each group has its own block table per sequence, and
a group whose lookback is bounded releases the blocks before it. All groups take their
blocks from one pool.

Memory: the groups all have `group_size` layers (a layer type with more layers is cut into
several groups of that size, each with its own table, as vLLM does; where its count is not
a multiple, its last group is smaller and its blocks leave some tensors unused), and there
are `group_size` KV tensors, not one per layer: layer j of every group uses tensor j. So a
block id is one block in each of the group_size tensors,

    bytes per block = 2 (k, v) * group_size * block_size * NKV * D * element size,

and a sequence of L tokens holds ceil(L / block_size) blocks in each full group and about
lookback / block_size + 1 in each windowed one. For gpt-oss (12 sliding-128 and 12 full
layers: two groups of 12) that is 12 layers' worth of L + 128 tokens instead of 24 layers'
worth of L; for Gemma 3 (5 sliding per full layer) one full group and five windowed ones.

One group (no window, or one window on every layer: Mistral) is the whole model: tensor j
is layer j, as without groups. Under context parallelism a logical block lies on the same
rank in every group (the layout places each group's tables alike), each rank's share of a
group's table on that rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.config import ModelConfig, first_visible_block


@dataclass(frozen=True)
class KVGroup:
    lookback: int | None  # the most keys before its own position a query sees; None: all
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    layer_group: tuple[int, ...]  # per layer: its group
    layer_tensor: tuple[int, ...]  # per layer: its KV tensor
    group_size: int  # layers per group: the number of KV tensors

    @classmethod
    def for_model(cls, config: ModelConfig) -> KVGroups:
        num_layers = config.num_hidden_layers
        lookbacks = [config.attention_window(i).lookback() for i in range(num_layers)]
        if len(set(lookbacks)) == 1:
            return cls.one_group(num_layers, lookbacks[0])
        by_lookback: dict[int | None, list[int]] = {}
        for layer, lookback in enumerate(lookbacks):
            by_lookback.setdefault(lookback, []).append(layer)
        size = min(len(layers) for layers in by_lookback.values())
        groups, layer_group, layer_tensor = [], [0] * num_layers, [0] * num_layers
        for lookback, layers in by_lookback.items():
            for first in range(0, len(layers), size):
                for j, layer in enumerate(layers[first : first + size]):
                    layer_group[layer], layer_tensor[layer] = len(groups), j
                groups.append(KVGroup(lookback, tuple(layers[first : first + size])))
        return cls(tuple(groups), tuple(layer_group), tuple(layer_tensor), size)

    @classmethod
    def one_group(cls, num_layers: int, lookback: int | None = None) -> KVGroups:
        """Every layer in one group (tensor j is layer j)."""
        layers = tuple(range(num_layers))
        return cls((KVGroup(lookback, layers),), (0,) * num_layers, layers, num_layers)

    @property
    def lookbacks(self) -> tuple[int | None, ...]:
        return tuple(g.lookback for g in self.groups)

    def min_blocks(self, num_tokens: int, block_size: int) -> int:
        return min_blocks(self.lookbacks, num_tokens, block_size)


def min_blocks(lookbacks: tuple[int | None, ...], num_tokens: int, block_size: int) -> int:
    """The fewest blocks a sequence of num_tokens tokens holds over groups with these
    lookbacks, computed a chunk at a time (its peak, computed a token at a time): a full
    group all of them, a windowed group the blocks the window of the first token of the
    last block touches (the widest of any token's windows in the last block, and no
    earlier token's window spans more blocks)."""
    blocks = -(-num_tokens // block_size)
    first_of_last = (blocks - 1) * block_size  # the position of the last block's first token
    total = 0
    for lookback in lookbacks:
        first = first_visible_block(first_of_last, block_size, lookback)
        total += blocks - first
    return total
