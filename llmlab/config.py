"""Configuration: `EngineConfig` (every engine knob, vLLM's names) and `ModelConfig`
(the architecture, read from a HF `config.json`). `check_device`: the CUDA device a config
names is on this machine (asked by the runner and the benchmarks before anything loads)."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class EngineConfig:
    model: str | None = None            # HF folder, .gguf file, None = embedded SmolLM2, or random-llama3-8b / random-llama3-tiny (random weights: model/random_weights.py)
    tokenizer: str | None = None        # None = the model's own; a HF folder, a .gguf, or "embedded" (the embedded SmolLM2's): for random weights, or to override
    dtype: str = "auto"                 # "auto" = bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"        # "auto" = dtype; "int8" | "fp8_e4m3" (CUDA, compute capability >= 8.9)
    device: str = "auto"                # "auto" = cuda if available else cpu
    backend: str = "auto"               # kernels: "reference" | "torch" | "triton"; "auto" follows the device
    block_size: int = 16                # tokens per KV block
    num_gpu_blocks: int | None = None   # None = size from memory
    gpu_memory_utilization: float = 0.9 # share of GPU memory for weights, activations and KV cache
    cpu_kv_cache_gib: float = 1.0       # KV cache size on a CPU device when num_gpu_blocks is None
    swap_space: float = 0.5             # GiB of host KV blocks for preemption by swap
    max_num_seqs: int | None = None     # requests running at once (a step's batch); None = sized to the device (sizing.py: 64 on a CPU)
    max_num_batched_tokens: int | None = None   # tokens per step; None = sized to the device (sizing.py: 512 on a CPU)
    max_model_len: int | None = None    # None = the model's context length (or what the KV cache holds, if less); more than either is refused
    async_scheduling: bool | None = None   # overlap: schedule and prepare step N+1 while the device runs step N; None = on for CUDA, off on a CPU
    enable_chunked_prefill: bool = True # long prompts run in chunks beside decodes (SARATHI)
    long_prefill_token_threshold: int = 0   # most prompt tokens one request takes per step (0 = no cap); `llmlab serve` uses 64 on a CPU
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix seen before; on as in vLLM (free when nothing is shared: BENCHMARKS.md), --no-enable-prefix-caching turns it off
    preemption_mode: str = "recompute"  # "swap" | "recompute"
    enforce_eager: bool = False         # True = no CUDA graphs for decode steps
    seed: int = 0                       # for requests that sample without their own seed
    tensor_parallel_size: int = 1       # ranks (GPUs) the model is sharded over, Megatron-style
    pipeline_parallel_size: int = 1     # stages the layers are split into, tensor_parallel_size ranks each
    usage_context: str = "offline"      # whose defaults the sizes left None take: "offline" (LLM) or "server" (llmlab serve sets it); not a flag

    def __post_init__(self):
        def integer(x, low, none_ok=False):
            return (none_ok and x is None) or (isinstance(x, int) and not isinstance(x, bool) and x >= low)

        def number(x, low, high=math.inf):   # a finite number in [low, high]
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high

        def flag(x, none_ok=False):
            return (none_ok and x is None) or isinstance(x, bool)

        bs = self.block_size
        # each check is evaluated only after the ones before it passed, so a value of the
        # wrong type gets its own message rather than a TypeError from a later comparison
        checks = [
            # ("" would be the current folder, and pathlib's TypeError would not name the field)
            ("model", lambda: self.model is None or (isinstance(self.model, str) and self.model != "")
             or hasattr(self.model, "__fspath__"),
             "None (the embedded SmolLM2-135M-Instruct) or the path of a HF model folder or a .gguf file"),
            ("tokenizer", lambda: self.tokenizer is None or (isinstance(self.tokenizer, str) and self.tokenizer != "")
             or hasattr(self.tokenizer, "__fspath__"),
             'None (the model\'s own), "embedded", or the path of a HF folder or a .gguf file'),
            ("device", lambda: isinstance(self.device, str) and (
                self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device) is not None),
             "auto, cpu or cuda[:N]"),
            ("dtype", lambda: self.dtype in ("auto", "float32", "float16", "bfloat16"),
             "one of auto, float32, float16, bfloat16"),
            ("backend", lambda: self.backend in ("auto", "reference", "torch", "triton"),
             "auto, reference, torch or triton"),
            ("block_size", lambda: integer(bs, 1) and bs & (bs - 1) == 0,
             "a power of two (the attention kernels tile the cache by it)"),
            ("num_gpu_blocks", lambda: integer(self.num_gpu_blocks, 1, none_ok=True), "None or a positive integer"),
            ("gpu_memory_utilization", lambda: number(self.gpu_memory_utilization, 0, 1)
             and self.gpu_memory_utilization > 0, "in (0, 1]"),
            ("cpu_kv_cache_gib", lambda: number(self.cpu_kv_cache_gib, 0) and self.cpu_kv_cache_gib > 0,
             "a positive number (GiB)"),
            ("swap_space", lambda: number(self.swap_space, 0), "a number >= 0 (GiB)"),
            ("max_num_seqs", lambda: integer(self.max_num_seqs, 1, none_ok=True), "None or an integer >= 1"),
            ("max_num_batched_tokens", lambda: integer(self.max_num_batched_tokens, 1, none_ok=True),
             "None or an integer >= 1"),
            ("long_prefill_token_threshold", lambda: integer(self.long_prefill_token_threshold, 0),
             "an integer >= 0 (0 = no cap)"),
            ("max_model_len", lambda: integer(self.max_model_len, 1, none_ok=True), "None or an integer >= 1"),
            ("async_scheduling", lambda: flag(self.async_scheduling, none_ok=True), "None, True or False"),
            ("enable_chunked_prefill", lambda: flag(self.enable_chunked_prefill), "True or False"),
            ("enable_prefix_caching", lambda: flag(self.enable_prefix_caching), "True or False"),
            ("enforce_eager", lambda: flag(self.enforce_eager), "True or False"),
            ("seed", lambda: integer(self.seed, -2**63), "an integer"),
            ("preemption_mode", lambda: self.preemption_mode in ("swap", "recompute"), "swap or recompute"),
            ("tensor_parallel_size", lambda: integer(self.tensor_parallel_size, 1), "a positive integer"),
            ("pipeline_parallel_size", lambda: integer(self.pipeline_parallel_size, 1), "a positive integer"),
            ("usage_context", lambda: self.usage_context in ("offline", "server"), "offline or server"),
        ]
        for name, ok, expected in checks:
            if not ok():
                raise ValueError(f"EngineConfig.{name} must be {expected}, got {getattr(self, name)!r}")
        self._check_kv_cache_dtype()

    def _check_kv_cache_dtype(self) -> None:
        """int8 runs everywhere; fp8 e4m3 only where the GPU converts it (Ada, Hopper and newer)."""
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError(f"EngineConfig.kv_cache_dtype must be auto, int8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":
            device = self.resolved_device()
            if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 9):
                raise ValueError(f"EngineConfig.kv_cache_dtype='fp8_e4m3' needs a CUDA GPU of compute capability "
                                 f"8.9 or newer (device here: {self.device!r}); use 'int8'")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r} does not support "
                             "tensor_parallel_size or pipeline_parallel_size > 1 yet; use 'auto'")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolved_async_scheduling(self) -> bool:
        """Whether the engine overlaps steps (vLLM's async scheduling): async_scheduling, or
        by device when None. Off with tensor or pipeline parallelism: their workers run each
        step in lockstep with this process."""
        if self.tensor_parallel_size * getattr(self, "pipeline_parallel_size", 1) > 1:
            return False
        if self.async_scheduling is None:
            return self.resolved_device().type == "cuda"
        return bool(self.async_scheduling)

    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "triton" if self.resolved_device().type == "cuda" else "torch"
        return self.backend

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def check_device(name: str, device: torch.device) -> None:
    """A CUDA device the machine has, before anything is loaded onto it (an EngineConfig
    itself may name one anywhere: it only describes an engine)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "torch finds no CUDA GPU"
        raise ValueError(f"EngineConfig.device={name!r}, but there is no CUDA device here ({why}); "
                         "use device='cpu' or 'auto'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"EngineConfig.device={name!r}, but this machine has {torch.cuda.device_count()} "
                         f"CUDA device(s): cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None     # LLaMA-3.1 style: {"rope_type": "llama3", "factor": ..}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None    # Mistral-style local attention; llmlab caps the context at it

    @property
    def context_length(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, capped at a sliding
        window (llmlab's full attention equals the model's only within it). A llama3 rope
        scaling (the only kind llmlab loads) is already counted in max_position_embeddings:
        Llama 3.1 says 131,072 with factor 8 over the original 8,192. The factor stretches the
        rotary frequencies to reach it and is not applied again (as in HF and vLLM)."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def context_source(self) -> str:
        """What sets context_length, in words (for error messages)."""
        if self.context_length < self.max_position_embeddings:
            return (f"its sliding window; max_position_embeddings is {self.max_position_embeddings}, but llmlab "
                    f"runs full attention, which equals the model's only within the window")
        if self.rope_scaling is not None:
            return "max_position_embeddings, which already counts its llama3 rope scaling"
        return "max_position_embeddings in its config.json"

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a HF `config.json` dict; unsupported architectures raise ValueError."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model architecture {model_type!r} (architectures="
                f"{cfg.get('architectures')}); llmlab supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg['hidden_act']!r}; only silu (SwiGLU)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json is missing required fields: {', '.join(missing)}")
        # transformers 5 writes rope settings under "rope_parameters"; older files use
        # "rope_theta" + "rope_scaling" at the top level.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in (None, "default"):
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"unsupported rope scaling type {kind!r}; llmlab supports 'llama3'")
            else:
                scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")}
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )
