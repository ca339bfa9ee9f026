"""The KV cache tensors: one device tensor for all layers, a host mirror for swapping,
and how many blocks fit in memory."""
from __future__ import annotations

import torch

from llmlab.config import EngineConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens in every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


class KVCache:
    """device: [num_layers, 2 (k, v), num_device_blocks, block_size, Hkv, D]; host: the same
    with num_host_blocks (pinned on CUDA so copies run asynchronously)."""

    def __init__(self, model: ModelConfig, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (model.num_layers, 2)
        tail = (block_size, model.num_kv_heads, model.head_dim)
        self.device = torch.zeros(*shape, num_device_blocks, *tail, dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.host = torch.zeros(*shape, num_host_blocks, *tail, dtype=dtype, pin_memory=pin)

    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs to the host."""
        if copies:
            src, dst = zip(*copies)
            self.host[:, :, list(dst)] = self.device[:, :, list(src)].to("cpu")

    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs to the device."""
        if copies:
            src, dst = zip(*copies)
            self.device[:, :, list(dst)] = self.host[:, :, list(src)].to(self.device.device, non_blocking=True)


def num_blocks_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                   weights_bytes: int, activation_bytes: int = 0) -> tuple[int, int]:
    """(device blocks, host blocks). An explicit num_gpu_blocks wins. On CUDA the device
    gets gpu_memory_utilization of the card minus weights and the peak activation memory
    (measured by the caller with a worst-case forward); on a CPU, cpu_kv_cache_gib."""
    per_block = bytes_per_block(model, config.block_size, dtype)
    host_blocks = int(config.swap_space * 2**30) // per_block
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks, host_blocks
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = total * config.gpu_memory_utilization - weights_bytes - activation_bytes
    else:
        budget = config.cpu_kv_cache_gib * 2**30
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError("no memory is left for the KV cache; lower the model size or raise "
                         "gpu_memory_utilization / cpu_kv_cache_gib")
    return blocks, host_blocks
