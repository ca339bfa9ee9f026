"""Kernels written in Gluon, Triton's lower-level language (explicit layouts, shared memory,
TMA and MMA fragments): the 8-bit decode attention for Hopper, which the Triton backend's
decode_attention dispatcher runs where it is supported, and the warp-specialized prefill
attention for Hopper, which prefill_attention runs for the `-ws` configs."""
