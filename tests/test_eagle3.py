"""Speculative decoding with an EAGLE-3 head (model/eagle3.py, engine/eagle.py), from tiny
checkpoints written in the layout peers publish: the output is the target's without
speculation (greedy, seeded, preempted, tp=2), and the head's guesses are the ones a dense
re-computation from transformers' hidden states gives (so the target's mix of hidden states,
the token/position pairing and the head's own KV cache are right)."""

import json

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.model.tiny_models import TINY, llama3_rope, save_random_model

from helpers import generate_tokens, varied_prompts

AUX = (2, 4, 5)  # an 8-layer target's defaults: 2, L // 2, L - 3
DRAFT_VOCAB = 128


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import transformers as tf

    config = tf.LlamaConfig(
        **{**TINY, "num_hidden_layers": 8}, tie_word_embeddings=True, rope_parameters=llama3_rope()
    )
    return save_random_model(config, str(tmp_path_factory.mktemp("eagle_target")))


def write_head(
    folder: str, target: str, seed: int = 0, embed: bool = False, aux=None, draft_vocab: int = DRAFT_VOCAB
) -> str:
    """A random EAGLE-3 head for `target` in EAGLE's published layout (config.json with
    LlamaForCausalLMEagle3, draft_vocab_size; midlayer.*, fc, norm, lm_head, d2t, t2d; a head
    over the whole vocabulary without d2t and t2d)."""
    import os

    from safetensors.torch import save_file

    with open(os.path.join(target, "config.json")) as f:
        t = json.load(f)
    h, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d = h // heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    keep = torch.sort(torch.randperm(t["vocab_size"], generator=g)[:draft_vocab]).values
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + w(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(t["intermediate_size"], h),
        "midlayer.mlp.up_proj.weight": w(t["intermediate_size"], h),
        "midlayer.mlp.down_proj.weight": w(h, t["intermediate_size"]),
        "norm.weight": 1 + w(h, scale=0.1),
        "lm_head.weight": w(draft_vocab, h, scale=0.3),
    }
    if draft_vocab < t["vocab_size"]:
        tensors["d2t"] = keep - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(t["vocab_size"], dtype=torch.bool).index_fill_(0, keep, True)
    if embed:
        tensors["embed_tokens.weight"] = w(t["vocab_size"], h)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": t["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "rms_norm_eps": t["rms_norm_eps"],
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "vocab_size": t["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
    }
    if aux is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return write_head(str(tmp_path_factory.mktemp("eagle_head")), target)


def _eagle(folder: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": folder, "num_speculative_tokens": k}


def reference_guesses(target: str, head: str, tokens: list[int], k: int) -> list[int]:
    """The head's k guesses after `tokens`, computed densely from the published equations:
    transformers' hidden states entering layers AUX, fc, then the head over positions
    0 .. n - 2 (token i + 1 with the mix at i) and its own outputs after that."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    w = load_file(f"{head}/model.safetensors")
    cfg = model.config
    h, heads, kv, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    d = h // heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    with torch.no_grad():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        mix = torch.cat([states[i][0] for i in AUX], dim=-1) @ w["fc.weight"].T  # [n, H]
        embed = w.get("embed_tokens.weight", model.model.embed_tokens.weight)
        rope_config = type(cfg)(
            **{**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        )
        rotary = LlamaRotaryEmbedding(rope_config)
        inputs = tokens[1:]  # token i + 1 at position i
        hidden = mix[:-1]
        guesses = []
        for _ in range(k):
            n = len(inputs)
            x = torch.cat(
                [
                    rms(embed[inputs], w["midlayer.input_layernorm.weight"]),
                    rms(hidden, w["midlayer.hidden_norm.weight"]),
                ],
                dim=-1,
            )
            q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)[None]
            kk = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)[None]
            v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)[None]
            cos, sin = rotary(v, torch.arange(n)[None])
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            kk, v = kk.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            attn = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
            attn = attn[0].transpose(0, 1).reshape(n, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T
            r = attn + hidden
            m = rms(r, w["midlayer.post_attention_layernorm.weight"])
            m = (
                torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
                * (m @ w["midlayer.mlp.up_proj.weight"].T)
            ) @ w["midlayer.mlp.down_proj.weight"].T
            out = m + r
            draft = int((rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            guesses.append(draft + (int(w["d2t"][draft]) if "d2t" in w else 0))
            inputs, hidden = inputs + [guesses[-1]], torch.cat([hidden, out[-1:]])
    return guesses


def _record_guesses(llm) -> list[tuple[list[int], list[int]]]:
    """Spy on the drafter: (a sequence's tokens, the guesses made for it) at every step."""
    drafter, seen = llm.engine.drafter, []
    fill = drafter.fill

    def spy(batch):
        fill(batch)
        seen.extend(
            (seq.token_slice(0, seq.num_tokens), list(seq.draft_token_ids))
            for seq in batch.seqs
            if seq.draft_token_ids
        )

    drafter.fill = spy
    return seen


def _fixed_k(drafter, k: int) -> None:
    """k guesses every decoding step (a random head keeps too few for adaptive k to ask more)."""
    drafter.num_drafts = lambda seq, max_context: (
        min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1) if seq.num_uncomputed_tokens == 1 else 0
    )


@pytest.mark.parametrize("graph_path", [False, True])
def test_guesses_are_the_heads_own(target, head, graph_path):
    """Each step's 3 guesses equal a dense re-computation from transformers' hidden states: in
    a first round (the head following chunked prefills, then its own KV past the last
    computed position), and in a second that hits the prefix cache (the hidden states of
    cached blocks were kept). graph_path: the head's passes go through its decode graphs'
    path (run eagerly on the CPU: padded rows, pass 1 in the verify shape, the hidden states
    in the head's buffers)."""
    prompts = [p * 2 for p in varied_prompts(3, seed=1)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    options = dict(max_num_batched_tokens=16, max_prefill_tokens=16, speculative_config=_eagle(head))
    with LLM(target, device="cpu", dtype="float32", block_size=4, **options) as llm:
        _fixed_k(llm.engine.drafter, 3)
        seen = _record_guesses(llm)
        if graph_path:
            from ringserve.worker.graphs import DecodeGraphs

            runner = llm.engine.drafter.runner
            runner.graphs = graphs = DecodeGraphs(runner, max_batch=32, capture=False)
            replays, run = [], graphs.run
            graphs.run = lambda step, pending=None: replays.append(step.is_verify) or run(step, pending)
        llm.generate(prompts, params, use_tqdm=False)
        first_round = len(seen)
        again = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 4 for o in again)
    assert first_round > 10 and len(seen) > first_round
    assert sum(len(g) == 3 for _, g in seen) > 10
    assert not graph_path or (len(replays) > 10 and any(replays))  # decode passes, and verify-shaped ones
    for tokens, guesses in seen:
        assert guesses == reference_guesses(target, head, tokens, len(guesses)), tokens


def test_greedy_output_equals_the_engine_without_speculation(target, head):
    """100 prompts; the random head's guesses are kept now and then (and adaptive k
    follows); the tokens are the target's."""
    prompts = varied_prompts(100, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain, _, _ = generate_tokens(target, prompts, params)
    spec, stats, _ = generate_tokens(target, prompts, params, speculative_config=_eagle(head))
    assert spec == plain and stats.num_drafts > 100, stats


@pytest.mark.parametrize("layout", ["seeded", "preempted", "tp2", "cp2", "dp2", "dp2cp2"])
def test_output_equals_the_engine_without_speculation(target, head, tmp_path, layout):
    """Seeded sampling draw for draw; too few blocks (preemption frees a sequence's hidden
    states and the head's cache with them); tp=2 (the head on rank 0 reads the embedding
    from the target's files, its checkpoint having none); cp=2 (each rank computes its own
    tokens' hidden states, gathered to rank 0 by global slot); dp=2 (each replica's, whose
    block ids and rows overlap the other's, gathered to rank 0); both (a replica's gathered
    on its CP rank 0, then the replicas' on rank 0)."""
    prompts = varied_prompts(8, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options = {}
    if layout == "seeded":
        params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    elif layout == "preempted":
        options = dict(num_blocks=30, max_model_len=96)
    else:
        options = {layout[i : i + 2]: 2 for i in range(0, len(layout), 3)} | {"timeout_s": 60}
        if layout == "dp2":  # steps of more than 4 tokens pass their own mixes, decode ones staged
            options["max_num_seqs"] = 4
    plain, _, _ = generate_tokens(
        target, prompts, params, **{k: v for k, v in options.items() if k not in ("tp", "cp", "dp")}
    )
    with LLM(
        target, device="cpu", dtype="float32", block_size=4, speculative_config=_eagle(head), **options
    ) as llm:
        _fixed_k(llm.engine.drafter, 3)
        seen = _record_guesses(llm)
        spec = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        stats, preemptions = llm.engine.spec_stats, llm.engine.num_preemptions
    assert spec == plain and stats.num_draft_tokens > 50, stats
    assert (preemptions > 0) == (layout == "preempted")
    for tokens, guesses in seen[::7]:  # the head's guesses are still its own
        assert guesses == reference_guesses(target, head, tokens, len(guesses)), tokens


def test_head_checkpoints_load_and_are_checked(target, head, tmp_path):
    """A head with its own embedding and named aux layers, and one over the whole vocabulary
    without d2t, load (and guess as the dense re-computation says); what does not fit the
    target is refused with the reason."""
    import os

    from ringserve.config import ModelConfig
    from ringserve.errors import ModelLoadError
    from ringserve.model.eagle3 import Eagle3Checkpoint

    own = write_head(str(tmp_path / "own"), target, seed=5, embed=True, aux=AUX)
    vocab = json.load(open(f"{target}/config.json"))["vocab_size"]
    whole = write_head(str(tmp_path / "whole"), target, seed=7, draft_vocab=vocab)
    for folder in (own, whole):
        with LLM(
            target, device="cpu", dtype="float32", block_size=4, speculative_config=_eagle(folder)
        ) as llm:
            _fixed_k(llm.engine.drafter, 2)
            seen = _record_guesses(llm)
            llm.generate(
                varied_prompts(2, seed=6), SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
            )
        assert seen and all(g == reference_guesses(target, folder, t, len(g)) for t, g in seen)
    config = ModelConfig.from_pretrained(target)
    assert Eagle3Checkpoint.read(head, config).aux_layers == AUX
    bad = write_head(str(tmp_path / "bad"), target, aux=(2, 4, 9))
    with pytest.raises(ModelLoadError, match="aux layers"):
        Eagle3Checkpoint.read(bad, config)
    with open(os.path.join(bad, "config.json")) as f:
        raw = json.load(f)
    for change, message in [
        ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
        ({"target_hidden_size": 128, "eagle_aux_hidden_state_layer_ids": list(AUX)}, "another model"),
        ({"hidden_size": 128, "eagle_aux_hidden_state_layer_ids": list(AUX)}, "128 wide"),
    ]:
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump({**raw, **change}, f)
        with pytest.raises(ModelLoadError, match=message):
            Eagle3Checkpoint.read(bad, config)
    from safetensors.torch import load_file, save_file

    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({**raw, "eagle_aux_hidden_state_layer_ids": list(AUX)}, f)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    del tensors["midlayer.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensors"):
        LLM(target, device="cpu", dtype="float32", speculative_config=_eagle(bad))


def test_the_kv_budget_holds_the_heads_caches(target, head):
    """Per block: the target's KV, the head's one-layer KV, and block_size hidden mixes."""
    from ringserve.config import ModelConfig
    from ringserve.worker.kv_cache import KVCache
    from ringserve.worker.kv_groups import KVGroups

    c = ModelConfig.from_pretrained(target)
    per_layer = KVCache.bytes_per_block(
        KVGroups.for_model(c), 4, c.num_key_value_heads, c.head_dim, torch.float32
    )
    per_block = per_layer + per_layer // c.num_hidden_layers + 4 * c.hidden_size * 4
    budget = 4 << 20
    with LLM(target, device="cpu", dtype="float32", block_size=4, kv_cache_memory=budget,
             speculative_config=_eagle(head)) as llm:  # fmt: skip
        assert llm.engine.block_manager.num_blocks == budget // per_block
        # every block's slots and the scratch block's (padded rows of a graph write there)
        assert llm.engine.drafter.capture.cache.shape == ((budget // per_block + 1) * 4, c.hidden_size)
