"""Run by test_lora_sync.py under torchrun (2 processes): adapter-only syncs of a tp2 LoRA actor.

For tg = 1 and tg = 2 the ranks build the tp2 LoRA engine from the HF checkpoint at argv[2] with non-zero
adapters, and beside each other the merged route (`MergedWeights` over the reshard plan's `GroupedWeights`)
and the adapter-only route (`AdapterGatheredWeights`); then the adapters change twice (as an update changes
them) and both routes sync. Rank 0 writes to argv[1], per tg and sync: whether every generation weight is
equal bit for bit, both routes' counted figures, the adapters' shapes, and both models' logits (tg = 1).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def set_adapters(engine, salt: str) -> None:
    import torch

    from hybridflow.models.sharding import shard_tensor
    from tests.lora.common import LORA, full_adapters, full_shape

    tp, tp_rank = engine.layout.tp, engine.coord.tp
    with torch.no_grad():
        for a in engine.lora.adapted:
            full_a, full_b = full_adapters(a.key + salt, LORA.rank, *full_shape(a, tp))
            a.module.lora_A.copy_(shard_tensor(full_a, a.a_spec, tp_rank, tp))
            a.module.lora_B.copy_(shard_tensor(full_b, a.b_spec, tp_rank, tp))


def syncs(tg: int, path: str) -> dict:
    import torch

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine.lora_weights import AdapterGatheredWeights, MergedWeights
    from hybridflow.hybrid_engine.reshard import GroupedWeights
    from tests.engine.conftest import layout_case
    from tests.lora.common import LORA, full_shape

    case = layout_case(path)
    engine = MegatronEngine(case.cfg, ParallelConfig(tp=2), case.optim, total_steps=10, lora=LORA)
    engine.load_hf_checkpoint(case.path)
    set_adapters(engine, "")
    merged = MergedWeights(engine, lambda source: GroupedWeights(source, tg))
    adapters = AdapterGatheredWeights(engine, tg, 2**20)
    out = {"first": adapters.first, "shapes": [(a.column, *full_shape(a, 2)) for a in engine.lora.adapted],
           "rank": LORA.rank, "element": torch.empty((), dtype=engine.dtype).element_size(), "syncs": []}
    for salt in ("/step1", "/step2"):
        set_adapters(engine, salt)
        got = {"merged": merged.refresh(), "adapters": adapters.refresh()}
        a, m = dict(adapters.model.named_parameters()), dict(merged.model.named_parameters())
        got["equal"] = a.keys() == m.keys() and all(torch.equal(a[k], m[k]) for k in a)
        got["changed"] = any(not torch.equal(a[k], adapters.base[k]) for k in adapters.base)
        if tg == 1:
            tokens = case.batch["input_ids"][:2]
            got["logits"] = (adapters.model(tokens), merged.model(tokens))
        out["syncs"].append(got)
    return out


def main(out_path: str, hf_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.engine.distributed import init_process_group

    init_process_group("cpu")
    results = {}
    for tg in (1, 2):
        ps.destroy_model_parallel()
        results[tg] = syncs(tg, hf_path)
    if dist.get_rank() == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
