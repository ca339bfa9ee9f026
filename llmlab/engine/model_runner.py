"""ModelRunner: the model's whole life, from weights on disk to logits of a Plan.

At start-up, in this order:
  load        the model folder (or the LlamaModel given), the tokenizer beside it (model/loader.py)
  distribute  tensor parallelism: the model cut into shards, one per rank (parallel/executor.py)
  prepack     on a CPU, each weight in oneDNN's blocked layout (kernels.prepack, host_memory.py)
  profile     on CUDA, the peak activation memory of a worst-case forward
  KV cache    as many blocks as the memory left holds (cache/kv_cache.py: num_blocks_for), and
              max_model_len within the model's context and the cache (sizing.max_model_len_for)
  sizes       max_num_seqs and max_num_batched_tokens left None, for this device and cache
              (sizing.py); `self.config` is the config with them set
Then the engine's warm-up (warm_up.py: everything compiled or captured at start-up) makes
the decode CUDA graphs (`make_decode_graphs`) and runs throwaway batches through `execute`.
Then every step: `swap` (block copies of the plan), `prepare_step` (batch.py: the flat
batch, staged in persistent buffers, input_buffers.py) and `forward` (logits). `prepare`
and `execute` do the same for any plan (dummy ones too) with fresh tensors.

The runner knows nothing of requests' futures: the engine hands it a Plan, it hands back
logits. Sampling and the bookkeeping after the step are the engine's and the scheduler's.
"""
from __future__ import annotations

import torch

from llmlab.cache.kv_cache import KVCache, kv_cache_dtype, num_blocks_for
from llmlab import sizing
from llmlab.config import EngineConfig, ModelConfig, check_device
from llmlab.engine import batch as batches
from llmlab.cuda_graphs.decode import CudaGraphDecoder
from llmlab.engine.host_memory import keep_freed_memory
from llmlab.engine.input_buffers import InputBuffers
from llmlab.cuda_graphs.prompt import TOKEN_SIZES, PromptGraphs
from llmlab import kernels
from llmlab.model.llama import ForwardBatch, LlamaModel
from llmlab.model.loader import load_model
from llmlab.plan import Plan


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaModel | None = None, tokenizer=None, decoder_layer=None,
                 cuda_graphs=CudaGraphDecoder):
        """Loads `config.model`, or runs the given model (and tokenizer), e.g. random weights;
        `decoder_layer`: a class that runs each layer instead (LlamaModel.with_decoder_layer);
        `cuda_graphs`: the class of the decode-step CUDA graphs `make_decode_graphs` builds."""
        self.config = config
        self.device = config.resolved_device()
        check_device(config.device, self.device)
        if cuda_graphs is not CudaGraphDecoder and config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            # checked before the workers start: every rank captures llmlab's own graphs
            raise ValueError("a plugged-in cuda_graphs runs on one device: the tensor-parallel ranks capture "
                             "llmlab's CudaGraphDecoder (tensor_parallel_size and pipeline_parallel_size 1)")
        self.cuda_graphs = cuda_graphs
        self.dtype = config.resolved_dtype()
        # the one home of the kernel backend: every forward's batch carries it, the engine's
        # sampler is given it; the model itself (maybe the caller's) is never changed
        self.backend = config.resolved_backend()
        self.block_size = config.block_size
        if model is None:
            model, found = load_model(config, self.device, self.dtype)
            tokenizer = tokenizer if tokenizer is not None else found
        self.tokenizer = tokenizer
        # tensor parallelism (llmlab.engine.parallel.executor): this process is rank 0 and keeps one
        # shard; its forward also runs the shards of tensor_parallel_size - 1 workers
        self.executor = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            from llmlab.engine.parallel.executor import ParallelExecutor

            self.executor = ParallelExecutor(config, model.config)   # starts the workers
            model = self.executor.distribute(model)   # rank 0's shard; its config has its heads
        if decoder_layer is not None:
            if self.executor is not None:
                raise ValueError("a plugged-in decoder_layer runs on one device: its layer has no tensor- or "
                                 "pipeline-parallel collectives (tensor_parallel_size and pipeline_parallel_size 1)")
            model = model.with_decoder_layer(decoder_layer)   # a new model object: the caller's is unchanged
        if self.device.type == "cpu":
            kernels.prepack(model.matrices())   # oneDNN's blocked weight layout, made once
            keep_freed_memory()               # no page faults for every large temporary
        self.model = model
        self.model_config: ModelConfig = model.config
        # read once: the decode kernel's split choice depends on how many SMs there are
        self.num_sms = None
        if self.backend == "triton" and self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

        weights_bytes = model.num_parameters() * model.embed.element_size()
        self.num_device_blocks, self.num_host_blocks = num_blocks_for(
            config, self.model_config, self.dtype, self.device, weights_bytes, self.profile_activation_bytes())
        self.kv_cache_tokens = self.num_device_blocks * self.block_size   # reported beside max_model_len
        # the sizes left None, for this device and cache: from here on self.config has them
        self.config, self.sizes = sizing.resolve(config, self.num_device_blocks)
        try:
            self.max_model_len = sizing.max_model_len_for(config, self.model_config, self.kv_cache_tokens)
        except ValueError:
            if self.executor is not None:   # the workers started already
                self.executor.shutdown()
            raise
        self.kv_cache = KVCache(self.model_config, self.num_device_blocks, self.num_host_blocks, self.block_size,
                                kv_cache_dtype(config.kv_cache_dtype, self.dtype), self.device)

        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.buffers = InputBuffers(self.device, self.max_blocks_per_seq)   # every step's inputs
        self.graphs = None   # decode-step CUDA graphs, once the warm-up made them (make_decode_graphs)
        self.prompt_graphs = None   # graphs of steps that hold a prompt (make_prompt_graphs)

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence ids, and its tokenizer's if that names another."""
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    # ---- start-up ----------------------------------------------------------------------
    def profile_activation_bytes(self) -> int:
        """Peak extra memory of a worst-case forward (full token budget), measured on CUDA."""
        if self.device.type != "cuda" or self.config.num_gpu_blocks is not None:
            return 0
        tokens = sizing.token_budget(self.config)   # what the step budget will be
        plan = batches.dummy_plan(self.block_size, prefills=[(tokens, tokens)])
        probe = KVCache(self.model_config, batches.num_blocks_of(plan, self.block_size), 0,
                        self.block_size, self.dtype, self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.model.forward(*self.prepare(plan), probe.device, probe.device_scales)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del probe
        torch.cuda.empty_cache()
        # over an 8-bit cache, a prefill's attention may first dequantize the sequences' blocks
        # into a 16-bit scratch (the default prefill config; the probe above ran a 16-bit cache)
        scratch = kernels.prefill_scratch_bytes(self.config.kv_cache_dtype != "auto")
        return int(peak * 1.2) + scratch   # headroom for allocator fragmentation

    def make_decode_graphs(self):
        """The decode-step CUDA graphs that `forward` replays from now on: CudaGraphDecoder
        (cuda_graphs/decode.py) or the class plugged in as `cuda_graphs`, or with tensor parallelism
        every rank's at once (parallel/cuda_graphs.py); making them captures each size of their
        batch-size ladder with one split. Called once, by the warm-up (warm_up.py), which
        captures the rest."""
        config = self.config
        self.graphs = (self.cuda_graphs(self.model, self.kv_cache, config.max_num_seqs, self.max_blocks_per_seq,
                                        self.backend)
                       if self.executor is None else  # parallel/cuda_graphs.py
                       self.executor.cuda_graphs(self.model, self.kv_cache, config.max_num_seqs,
                                                 self.max_blocks_per_seq, self.backend))
        return self.graphs

    def make_prompt_graphs(self):
        """The graphs that `forward` replays from now on for steps that hold a prompt, of up to
        512 tokens: the whole step, captured per padded token count (cuda_graphs/prompt.py).
        Called once, by the warm-up; not with tensor parallelism, a plugged-in decoder layer
        or the knob off (kernels.knobs.prompt_graphs): None then."""
        max_tokens = sizing.token_budget(self.config)
        if (kernels.knobs.prompt_graphs and self.executor is None and self.model.plugged_layers is None
                and max_tokens >= TOKEN_SIZES[0]):
            self.prompt_graphs = PromptGraphs(self.model, self.kv_cache, max_tokens, self.max_blocks_per_seq,
                                              self.backend)
        return self.prompt_graphs

    # ---- every step ----------------------------------------------------------------------
    def swap(self, swap_out_copies: list[tuple[int, int]], swap_in_copies: list[tuple[int, int]]) -> None:
        """The plan's block copies between device and host, out before in (swap-ins may
        reuse the blocks just swapped out); every tensor-parallel rank caches its own heads."""
        self.kv_cache.swap_out(swap_out_copies)
        self.kv_cache.swap_in(swap_in_copies)
        if self.executor is not None:
            self.executor.swap(swap_out_copies, swap_in_copies)

    def num_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """Flash-decoding splits of a decode step (1 = PagedAttention v1): the contract's
        `kernels.decode_num_splits`, for this GPU's SMs and this cache."""
        return kernels.decode_num_splits(num_seqs, self.model_config.num_kv_heads, max_seq_len, self.num_sms,
                                         quantized=self.config.kv_cache_dtype != "auto")

    def prepare(self, plan: Plan):
        """input_ids [T], positions [T] and the ForwardBatch of any plan (batches.prepare), in
        fresh tensors."""
        return batches.prepare(plan, self.block_size, self.device, self._splits_of(plan), self.backend)

    def prepare_step(self, plan: Plan, previous=None):
        """The same for the engine's step, staged in the persistent buffers (no host sync on
        CUDA). `previous`: (rows, tokens) of the step in flight, whose sampled tokens the
        pending requests take as inputs on the device (async scheduling)."""
        return batches.prepare(plan, self.block_size, self.device, self._splits_of(plan), self.backend,
                              self.buffers, previous)

    def _splits_of(self, plan: Plan) -> int:
        max_context = max((item.start_position + 1 for item in plan.decodes), default=0)
        return self.num_splits(len(plan.decodes), max_context)

    def forward(self, input_ids, positions, batch: ForwardBatch, eager: bool = False) -> torch.Tensor:
        """Logits [sampling items, vocab]: when graphs were captured (and neither hook points nor
        `eager` ask to see every kernel), a decode graph's replay for a pure-decode batch, the
        prompt graphs' for any other step they hold; the eager forward otherwise."""
        if self.graphs is not None and not eager and self.model.taps is None:
            if batch.num_prefill_tokens == 0 and self.graphs.can_run(batch.logits_indices.shape[0]):
                return self.graphs.run(input_ids, positions, batch)
            if (self.prompt_graphs is not None
                    and self.prompt_graphs.can_run(input_ids.shape[0], batch.prefill_seq_lens.shape[0])):
                return self.prompt_graphs.run(input_ids, positions, batch)
        return self.model.forward(input_ids, positions, batch, self.kv_cache.device, self.kv_cache.device_scales)

    def execute(self, plan: Plan) -> torch.Tensor:
        """Run the plan's forward; logits [len(plan.sampling_items), vocab], in that order."""
        return self.forward(*self.prepare(plan))
