"""The checkpoint resharding tool (`hybridflow reshard SRC DST`): HF safetensors, megatron-core
`dist_checkpointing` and hybridflow training checkpoints, converted between any TP/PP layouts."""
