"""One rank's share of the model: its weights, its KV cache, and the runner over them."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ringserve.attention.dense import warm_up_cudnn
from ringserve.config import EngineConfig, ModelConfig, TPShard
from ringserve.kernels.kv_quant import FP8_DTYPE, check_fp8_device, kv_storage_dtype
from ringserve.model.eagle3 import HiddenCapture
from ringserve.model.quantize import quantize_weights
from ringserve.model.tp_shard_plan import TensorParallelPlan
from ringserve.model.weights import load_model
from ringserve.parallel.allreduce import AllReduce
from ringserve.parallel.comm import wait_interruptibly
from ringserve.parallel.ep import ExpertParallel, LocalExperts
from ringserve.parallel.mesh import ParallelGroups
from ringserve.parallel.tp import validate_tp
from ringserve.worker.dp_step import DataParallelStep, run_replica_step
from ringserve.worker.graphs import MAX_GRAPH_BATCH, DecodeGraphs
from ringserve.worker.kv_cache import KVCache
from ringserve.worker.kv_calibration import calibrate_kv_scales, checkpoint_kv_scales
from ringserve.worker.kv_groups import KVGroups
from ringserve.worker.runner import ModelRunner
from ringserve.worker.step_input import StepInput

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30
_GPU_ACTIVATION_RESERVE = 4 << 30
# Shapes warmed up: prompts and chunks to 32K (past that a prefill takes over a second and a
# plan is a few percent of it), key pieces to 128K; the others build theirs when first met.
_WARM_UP_CHUNK = 1 << 15
_WARM_UP_KEYS = 1 << 17


class Worker:
    def __init__(
        self,
        model_path: str,
        config: ModelConfig,
        dtype: torch.dtype,
        engine_config: EngineConfig,
        max_model_len: int,
        groups: ParallelGroups,
        allreduce: str = "auto",
        weights: Mapping[str, torch.Tensor] | None = None,
        show_progress: bool = False,
        kv_calibration_ids: list[int] | None = None,
        draft_memory: tuple[int, int] = (0, 0),
        eagle3_capture: tuple[str, tuple[int, ...], int] | None = None,
    ):
        """kv_calibration_ids: the prompt an FP8 KV cache's scales are measured on
        (worker/kv_calibration.py); without it they stay 1.0. draft_memory: (bytes a block
        of a draft model's KV cache takes beside this one's, the draft's weights' bytes) for
        speculative decoding with a draft model (engine/draft_model.py), which the KV budget
        leaves room for. eagle3_capture: (an EAGLE-3 head's folder, the layers it reads, the
        KV group whose slots its hidden-state cache follows): rank 0 keeps that input of the
        head for every token (engine/eagle.py), gathered from every CP rank and replica."""
        self.draft_memory = draft_memory
        self.groups = groups
        self.device = groups.device
        validate_tp(config, groups.tp_size)
        shard = TPShard.of(config, groups.tp_rank, groups.tp_size, groups.ep_rank, groups.ep_size)
        plan = TensorParallelPlan(config, shard) if groups.tp_size > 1 or groups.ep_size > 1 else None
        self.model = load_model(
            config,
            model_path,
            self.device,
            dtype,
            plan=plan,
            show_progress=show_progress and groups.rank == 0,
            tensors=weights,
            shard=shard,
        )
        if engine_config.quantization == "fp8":
            check_fp8_device(self.device, "quantization=fp8")
            count = quantize_weights(self.model, groups.tp_group if groups.tp_size > 1 else None)
            logger.info("quantization fp8: %d weights in float8 e4m3 with a scale per row", count)
        self.all_reduce = AllReduce(groups.tp_group, allreduce, self.device)
        if groups.ep_size > 1:
            self.run_experts = ExpertParallel(
                groups.ep_group,
                config.num_experts,
                groups.ep_replicated_group,
                groups.ep_intra_host_group,
                groups.ep_peer_group,
            )
        else:
            self.run_experts = LocalExperts(self.all_reduce)
        ec = engine_config
        kv_groups = KVGroups.for_model(config)
        kv_dtype = kv_storage_dtype(ec.kv_cache_dtype, dtype)
        if kv_dtype == FP8_DTYPE:
            check_fp8_device(self.device, "kv_cache_dtype=fp8")
        self.num_blocks = self._num_blocks(config, kv_groups, shard, kv_dtype, ec, max_model_len)
        self.kv_cache = KVCache(
            kv_groups,
            self.num_blocks,
            ec.block_size,
            shard.num_kv_heads,
            config.head_dim,
            kv_dtype,
            self.device,
        )
        if eagle3_capture is not None and groups.tp_rank == 0:  # before any graph is captured
            # Rank 0's cache holds every CP rank's and replica's slots; the others send theirs.
            path, layers, group = eagle3_capture
            rank_slots = self.num_blocks * ec.block_size
            slots = groups.dp_size * groups.cp_size * rank_slots + ec.block_size  # and a scratch block
            self.model.hidden_capture = HiddenCapture.start(
                path,
                layers,
                group,
                slots if groups.rank == 0 else 0,
                config.hidden_size,
                dtype,
                self.device,
                rank_slots=rank_slots,
                cp=groups.cp_size,
                replicas=groups.dp_size,
                staging_rows=min(ec.max_num_seqs, MAX_GRAPH_BATCH),  # a decode graph's tokens
            )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.device,
            self.all_reduce,
            self.run_experts,
            max_rows=ec.max_num_seqs,
            max_model_len=max_model_len,
            tp_group=groups.tp_group,
            cp_group=groups.cp_group if groups.cp_size > 1 else None,
        )
        if self.kv_cache.quantized and self.model.kv_cache_scales:
            self.kv_cache.scales.copy_(checkpoint_kv_scales(self.model, config.num_hidden_layers))
            logger.info("FP8 KV cache: the checkpoint's scales (k_scale, v_scale)")
        elif self.kv_cache.quantized and kv_calibration_ids:
            start = time.monotonic()
            scales = calibrate_kv_scales(
                self.runner, kv_calibration_ids, groups.cp_group if groups.cp_size > 1 else None
            )
            logger.info(
                "FP8 KV cache: scales per layer and KV head from %d calibration tokens in %.2f s "
                "(k %.3g..%.3g, v %.3g..%.3g)",
                len(kv_calibration_ids),
                time.monotonic() - start,
                *(x for i in (0, 1) for x in (scales[:, i].min().item(), scales[:, i].max().item())),
            )
        if self.device.type == "cuda" and not ec.enforce_eager:
            self.runner.graphs = self._capture_graphs(ec, groups)
        if self.device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            self._warm_up_prefill(config, shard, dtype, ec, max_model_len)
        if self.device.type == "cuda" and groups.cp_size == 1:
            # Under CP the ring attends instead (parallel/cp.py), with no step of this shape.
            start = time.monotonic()
            self.runner.warm_up_cached_prefill()
            torch.cuda.synchronize(self.device)
            logger.info("compiled the prefill tiles of the paged kernel in %.1f s", time.monotonic() - start)

    def _warm_up_prefill(self, config, shard, dtype, ec: EngineConfig, max_model_len: int) -> None:
        """cuDNN's plans for the prefill shapes traffic meets most, built before it comes
        (attention.warm_up_cudnn); a few seconds at start-up instead of 40-70 ms on the
        first request of each length."""
        start = time.monotonic()
        longest = min(ec.prefill_budget(), max_model_len, _WARM_UP_CHUNK)
        chunks = [n for n in (ec.max_num_batched_tokens, ec.prefill_budget()) if n <= longest]
        shapes = warm_up_cudnn(
            shard.num_heads,
            shard.num_kv_heads,
            config.head_dim,
            dtype,
            self.device,
            longest,
            chunks,
            min(max_model_len - 1, _WARM_UP_KEYS),
        )
        torch.cuda.synchronize(self.device)
        logger.info("built %d cuDNN prefill plans in %.1f s", shapes, time.monotonic() - start)

    def _capture_graphs(self, ec: EngineConfig, groups: ParallelGroups) -> DecodeGraphs | None:
        """Decode graphs where every op of the step can be captured; eager otherwise."""
        if groups.cp_size > 1:
            # The ring's metadata (RingStep: per-rank query and key counts, the attention
            # plan) is made on the host each step, and its sizes change step to step.
            logger.info("context parallelism: decode runs eagerly (no CUDA graphs)")
            return None
        if groups.ep_size > 1:
            # Dispatch sizes (uneven all-to-all splits) are known only on the host.
            logger.info("expert parallelism: decode runs eagerly (no CUDA graphs)")
            return None
        dtype = next(self.model.parameters()).dtype
        if any(not block.experts.on_device(self.device, dtype) for block in self.model.moe_blocks()):
            # The expert-by-expert path reads each expert's token count on the host.
            logger.info(
                "MoE experts in %s run one by one with their token counts read on the host: decode runs "
                "eagerly (no CUDA graphs); bfloat16 on an sm90+ GPU takes the grouped matmul",
                dtype,
            )
            return None
        try:
            return DecodeGraphs(self.runner, min(ec.max_num_seqs, MAX_GRAPH_BATCH))
        except RuntimeError as e:
            logger.warning("decode runs eagerly: capturing CUDA graphs failed (%s)", e)
            return None

    def _num_blocks(
        self, config, kv_groups: KVGroups, shard, dtype, ec: EngineConfig, max_model_len: int
    ) -> int:
        """Blocks from the memory budget; every rank takes the smallest so block ids agree."""
        draft_per_block, draft_weights = self.draft_memory
        per_block = draft_per_block + KVCache.bytes_per_block(
            kv_groups, ec.block_size, shard.num_kv_heads, config.head_dim, dtype
        )
        if ec.num_blocks is not None:
            num_blocks = ec.num_blocks
        else:
            budget = ec.kv_cache_memory
            if budget is None and self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int((free - _GPU_ACTIVATION_RESERVE - draft_weights) * ec.gpu_memory_utilization)
            elif budget is None:
                budget = _CPU_KV_CACHE_BYTES
            # No use for more blocks than every sequence at full length can fill.
            most = ec.max_num_seqs * kv_groups.min_blocks(max_model_len, ec.block_size)
            most = -(-most // self.groups.cp_size) + 1
            num_blocks = max(0, min(budget // per_block, most))
        if self.groups.world_size > 1:
            agreed = torch.tensor([num_blocks], dtype=torch.int64)
            # Rank 0 waits here for the slowest rank's loading: a wait Ctrl-C can end.
            wait_interruptibly(
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.groups.control_group, async_op=True)
            )
            num_blocks = int(agreed.item())
        # CP ranks each hold a share of a sequence; the KV groups share the blocks.
        if num_blocks * self.groups.cp_size < kv_groups.min_blocks(max_model_len, ec.block_size):
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {ec.block_size} tokens per rank) cannot hold "
                f"max_model_len={max_model_len} tokens: give it more memory or blocks, or lower max_model_len"
            )
        return num_blocks

    def execute(
        self,
        step: StepInput | DataParallelStep,
        all_logits: bool = False,
        pending_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The step's logits (on rank 0; under data parallelism None on the other ranks)."""
        if isinstance(step, DataParallelStep):
            return run_replica_step(self, step, all_logits)
        return self.runner.forward(step, all_logits, pending_tokens)
