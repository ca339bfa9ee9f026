"""The Triton backend: one file per contract name (`triton/<name>.py` defines `<name>`; the
contract in `kernels/__init__.py` imports it on first use), and the helpers they share:
flash_decoding.py (the split count and the split-K reduce), decode_attention_bf16.py and
decode_attention_q8.py (the kernels the decode_attention dispatcher picks from),
q8_configs.py and prefill_configs.py (the 8-bit decode and the prefill variants'
catalogues), sample_passes.py, sample_radix.py and sample_graph.py (the sampler's passes and
their CUDA graphs), pdl.py (programmatic dependent launch). Nothing here imports the
contract."""
