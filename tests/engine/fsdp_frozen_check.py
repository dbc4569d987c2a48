"""The tiny reward model sharded by FSDP2 at 2 ranks (run by torchrun from tests/conftest.py's two-process launch).

Scores the pairs of `pairs()` three ways: each rank its own uneven share straight through
`FSDPRewardModel.score` (7 rows = 4 micro-batches of 2 against 2 rows = 1, so rank 1 runs 3 idle passes);
one row on rank 0 and none on rank 1; and the whole list through `RewardModelWorker` under
`reward.engine: fsdp` in a `LocalWorkerGroup` (the trainer's dispatch: DP_SPLIT halves). Each rank also
scores its shares with the whole model (`load_hf_model`, today's "hf" engine) in the same process. Rank 0
writes everything to argv[1]; tests/engine/test_fsdp_frozen.py compares it with one process.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RM = os.path.join(ROOT, "hybridflow", "assets", "tiny_reward_model")
MICRO = 2
SHARES = {"uneven": ((0, 7), (7, 9)), "one_and_none": ((0, 1), (1, 1))}  # case -> (rank 0's rows, rank 1's)


def pairs() -> list[tuple[str, str]]:
    """12 (prompt, response) pairs of different lengths, so micro-batches pad differently."""
    return [(f"question {i}: " + "why " * (i % 4), "answer " + "x" * (1 + 3 * i % 7)) for i in range(12)]


def main(out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, ROOT)
    import torch.distributed as dist

    from hybridflow.config.schema import RewardConfig
    from hybridflow.controller.local_group import LocalWorkerGroup
    from hybridflow.data import fields as F
    from hybridflow.engine.fsdp_frozen import load_sharded_classifier
    from hybridflow.parallel.process_group import init_process_group
    from hybridflow.rollout.hf import load_hf_model
    from hybridflow.workers.rl_workers import RewardModelGroup, RewardModelWorker

    init_process_group("cpu")
    rank = dist.get_rank()
    rm = load_sharded_classifier(RM)
    whole = load_hf_model(RM)
    rows = pairs()
    result = {"local_fraction": rm.local_fraction(), "bytes_read": rm.bytes_read,
              "local_numel": sum(p.to_local().numel() for p in rm.model.parameters())}
    for case, shares in SHARES.items():
        start, end = shares[rank]
        got = rm.score(rows[start:end], MICRO)
        parts = [None, None]
        dist.all_gather_object(parts, {"fsdp": got, "whole": whole.score(rows[start:end], MICRO)})
        result[case] = parts
    group = RewardModelGroup(LocalWorkerGroup(RewardModelWorker, None,
                                              RewardConfig(model_path=RM, engine="fsdp", micro_batch_size=MICRO)))
    scored = group.score({F.PROMPT_TEXT: [p for p, _ in rows], F.RESPONSE_TEXT: [r for _, r in rows]})
    result["worker"] = scored[F.SCORES]
    result["worker_is_sharded"] = type(group.group._worker.model).__name__  # noqa: SLF001 (this rank's worker)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
