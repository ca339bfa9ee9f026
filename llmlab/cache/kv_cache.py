"""The KV cache tensors: one device tensor for all layers, a host mirror for swapping,
and how many blocks fit in memory.

A quantized cache (EngineConfig.kv_cache_dtype "int8" or "fp8_e4m3") stores 8-bit codes
and, beside them, one float32 scale per token per kv head (kernels.reference.quantize).
The scales are laid out by block like the codes, so a block id names both: a swap copies
both, and prefix caching, preemption and the block tables need nothing new.
"""
from __future__ import annotations

import torch

from llmlab.config import EngineConfig, ModelConfig

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the cache stores: the model's dtype for "auto", else 8-bit codes."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in KV_CACHE_DTYPES.values()


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens in every layer (codes and scales for a quantized cache)."""
    element = torch.empty((), dtype=dtype).element_size()
    per_row = model.head_dim * element + (SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)
    return 2 * model.num_layers * block_size * model.num_kv_heads * per_row


class KVCache:
    """device: [num_layers, 2 (k, v), num_device_blocks, block_size, Hkv, D]; host: the same
    with num_host_blocks (pinned on CUDA so copies run asynchronously). `dtype` is what the
    cache stores (kv_cache_dtype()); when it is quantized, device_scales and host_scales
    [num_layers, 2, num_blocks, block_size, Hkv] float32 hold the scales, else they are None."""

    def __init__(self, model: ModelConfig, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (model.num_layers, 2)
        tail = (block_size, model.num_kv_heads, model.head_dim)
        pin = device.type == "cuda"
        self.dtype = dtype
        self.bytes_per_block = bytes_per_block(model, block_size, dtype)
        self.device = torch.zeros(*shape, num_device_blocks, *tail, dtype=dtype, device=device)
        # empty, not zeros: a host block is read only after a swap-out wrote it, and on a CPU
        # untouched pages cost no memory (swap_space's 0.5 GiB was resident in every engine)
        self.host = torch.empty(*shape, num_host_blocks, *tail, dtype=dtype, pin_memory=pin)
        self.device_scales = self.host_scales = None
        if is_quantized(dtype):
            self.device_scales = torch.zeros(*shape, num_device_blocks, *tail[:2], dtype=SCALE_DTYPE, device=device)
            self.host_scales = torch.empty(*shape, num_host_blocks, *tail[:2], dtype=SCALE_DTYPE, pin_memory=pin)

    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs to the host, scales with their blocks."""
        if copies:
            src, dst = zip(*copies)
            self.host[:, :, list(dst)] = self.device[:, :, list(src)].to("cpu")
            if self.device_scales is not None:
                self.host_scales[:, :, list(dst)] = self.device_scales[:, :, list(src)].to("cpu")

    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs to the device, scales with their blocks."""
        if copies:
            src, dst = zip(*copies)
            to_device = dict(device=self.device.device, non_blocking=True)
            self.device[:, :, list(dst)] = self.host[:, :, list(src)].to(**to_device)
            if self.device_scales is not None:
                self.device_scales[:, :, list(dst)] = self.host_scales[:, :, list(src)].to(**to_device)


def num_blocks_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                   weights_bytes: int, activation_bytes: int = 0) -> tuple[int, int]:
    """(device blocks, host blocks). An explicit num_gpu_blocks wins. On CUDA the device
    gets gpu_memory_utilization of the card minus weights and the peak activation memory
    (measured by the caller with a worst-case forward); on a CPU, cpu_kv_cache_gib.
    `dtype` is the model's; config.kv_cache_dtype says what a block stores."""
    per_block = bytes_per_block(model, config.block_size, kv_cache_dtype(config.kv_cache_dtype, dtype))
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
