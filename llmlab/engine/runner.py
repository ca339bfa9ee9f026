"""From a scheduler Plan to model inputs, and the forward pass itself.

The flat batch is every prefill chunk's tokens, then one token per decode. For each token
the runner computes its position and the cache slot its K/V goes to
(slot = block_table[position // block_size] * block_size + position % block_size).
"""
from __future__ import annotations

import torch

from llmlab.model.llama import ForwardBatch, LlamaModel
from llmlab.request import Request
from llmlab.sampling import SamplingParams
from llmlab.scheduler import Plan, ScheduledItem

# Batch shapes the warm-up runs: (prefill chunk lengths, context lengths of the decodes).
# Triton compiles a kernel once per constexpr value and per specialization of its integer
# arguments (divisible by 16 or not), so these cover one token, odd and multiple-of-16
# batches, prefill-only and mixed steps, and (the long contexts) every power-of-two number
# of flash-decoding splits, each of which is a different combine kernel.
WARM_UP_SHAPES = ([([7], []), ([5, 12], [2, 40, 2]), ([16], [2] * 16), ([29], [33]), ([], [2]), ([], [2, 40, 2]),
                   ([], [2] * 16)] + [([], [context]) for context in (256, 512, 1024, 2048, 4096, 8192)])


class Runner:
    def __init__(self, model: LlamaModel, kv_cache, block_size: int, device: torch.device,
                 max_num_seqs: int = 0, max_model_len: int = 0, use_cuda_graphs: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        # read once: the decode kernel's split choice depends on how many SMs there are
        self.num_sms = None
        if model.backend == "triton" and device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.graphs = None
        if use_cuda_graphs:
            from llmlab.engine.cuda_graphs import CudaGraphDecoder

            self.graphs = CudaGraphDecoder(model, kv_cache, max_num_seqs, -(-max_model_len // block_size))

    def num_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """Flash-decoding splits for the Triton decode kernel (1 = PagedAttention v1), rounded
        down to a power of two so that few CUDA graphs cover every context length."""
        if self.num_sms is None:
            return 1
        from llmlab.kernels.triton_decode_attention import choose_num_splits

        splits = choose_num_splits(num_seqs, self.model.config.num_kv_heads, max_seq_len, self.num_sms)
        return 1 << (splits.bit_length() - 1)

    def prepare(self, plan: Plan):
        """Returns input_ids [T], positions [T] and the ForwardBatch for the plan."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        cu_seqlens_q, prefill_lens, prefill_tables = [0], [], []
        for item in plan.prefills:
            request, start, end = item.request, item.start_position, item.start_position + item.num_tokens
            input_ids += request.token_ids_between(start, end)
            positions += range(start, end)
            table = request.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu_seqlens_q.append(cu_seqlens_q[-1] + item.num_tokens)
            prefill_lens.append(end)
            prefill_tables.append(table)
        decode_lens, decode_tables = [], []
        for item in plan.decodes:
            request, p = item.request, item.start_position
            input_ids += request.token_ids_between(p, p + 1)
            positions.append(p)
            slots.append(request.block_table[p // bs] * bs + p % bs)
            decode_lens.append(p + 1)
            decode_tables.append(request.block_table)
        num_prefill_tokens = cu_seqlens_q[-1]
        logits_indices = [end - 1 for end in cu_seqlens_q[1:]]
        logits_indices += range(num_prefill_tokens, num_prefill_tokens + len(plan.decodes))

        def ints(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        batch = ForwardBatch(
            num_prefill_tokens=num_prefill_tokens,
            slot_mapping=ints(slots, torch.int64),
            prefill_cu_seqlens_q=ints(cu_seqlens_q),
            prefill_seq_lens=ints(prefill_lens),
            prefill_block_tables=self.pad_tables(prefill_tables),
            decode_seq_lens=ints(decode_lens),
            decode_block_tables=self.pad_tables(decode_tables),
            logits_indices=ints(logits_indices, torch.int64),
            num_splits=self.num_splits(len(decode_lens), max(decode_lens, default=0)),
        )
        return ints(input_ids, torch.int64), ints(positions, torch.int64), batch

    def pad_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables as one int32 [num_seqs, max_blocks] tensor, padded with 0 (kernels
        never read past a sequence's length, so the padding value is never used)."""
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(tables), width)

    def warm_up(self) -> None:
        """Run a few throwaway batches of different shapes so that Triton compiles its kernel
        variants now rather than inside the first requests' steps (a first mixed step took 2 s
        on an H200). They write K/V into blocks that no request owns yet."""
        num_blocks, bs = self.kv_cache.device.shape[2], self.block_size
        for chunks, contexts in WARM_UP_SHAPES:
            lengths = chunks + contexts
            if max(lengths) > (self.max_model_len or 1 << 62) or sum(-(-n // bs) for n in lengths) > num_blocks:
                continue   # a small engine never sees this shape
            plan, next_block = Plan(), 0
            for i, length in enumerate(lengths):
                request = Request("warm-up", None, [0] * length, SamplingParams())
                request.block_table = list(range(next_block, next_block + -(-length // bs)))
                next_block += len(request.block_table)
                if i < len(chunks):
                    plan.prefills.append(ScheduledItem(request, "prefill", length, 0))
                else:
                    plan.decodes.append(ScheduledItem(request, "decode", 1, length - 1))
            self.execute(plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab]: a CUDA graph replay for pure-decode batches when
        graphs were captured, the eager forward otherwise."""
        num_seqs = batch.logits_indices.shape[0]
        if (self.graphs is not None and batch.num_prefill_tokens == 0 and self.model.taps is None
                and self.graphs.can_run(num_seqs)):
            return self.graphs.run(input_ids, positions, batch)
        return self.model.forward(input_ids, positions, batch, self.kv_cache.device, self.kv_cache.device_scales)

    def execute(self, plan: Plan) -> torch.Tensor:
        """Run the plan's forward; logits [len(plan.items), vocab], rows in plan.items order."""
        return self.forward(*self.prepare(plan))
