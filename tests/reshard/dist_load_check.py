"""Run in the suite's 2-process launch (tests/conftest.py, for test_reshard_dist.py): megatron-core's own loader reads the
reshard tool's dist_checkpointing output into a GPTModel at TP2 and computes logits on a fixed batch.

argv: the dist checkpoint, the HF model it was converted from (its config.json), the output file (rank 0
writes the logits, gathered over TP and cut to the vocabulary), and where megatron-core saves the loaded
model again at TP2 (the form a Megatron-LM run at TP2 writes), for the tool to read back.
"""
import os
import sys


def main(dist_dir: str, hf_dir: str, out: str, resaved: str = "") -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.models.config import DecoderConfig

    cfg = DecoderConfig.from_pretrained(hf_dir)
    engine = MegatronEngine(cfg, ParallelConfig(tp=2), layer_kernels=False)  # GPTModel's own layers
    model = engine.module
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), dist_dir))
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        local = model(ids, positions, causal)  # [b, s, V / tp]: this rank's vocabulary slice
    pieces = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(pieces, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        torch.save({"ids": ids, "logits": torch.cat(pieces, -1)[..., :cfg.vocab_size]}, out)
    if resaved:  # megatron-core's own save from both ranks: each layer's tensors in two TP chunks
        if dist.get_rank() == 0:
            os.makedirs(resaved)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), resaved)
    ps.destroy_model_parallel()  # the process group stays for the launch's next script
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:5])
