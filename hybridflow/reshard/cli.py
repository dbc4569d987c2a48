"""`hybridflow reshard SRC DST --to FORMAT [--tp N --pp N]`: the command line of the resharding tool.

`hybridflow/cli.py` hands this module its whole argument list (`--help`
included), so the parser lives beside the code it drives. Errors in what the
user asked for are ConfigError / FileNotFoundError, which `hybridflow.cli`
prints as one line (`hybridflow: error: ...`, exit status 2); run as
`tools/reshard.py`, `main` prints them the same way itself.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.errors import ConfigError

EPILOG = """\
forms (SRC's format is found from its files; DST is written beside itself and renamed when complete):
  HF -> hybridflow training checkpoint at a layout (a run starts from it with trainer.resume=auto
  when DST is its OUTPUT_DIR/EXPERIMENT/checkpoints; --make-vocab-size-divisible-by as the run's):
      hybridflow reshard models/qwen runs/qwen/checkpoints --to hybridflow --tp 2 --pp 2
  hybridflow checkpoint (root, step_N or its actor/ or critic/ directory) -> another layout:
      hybridflow reshard runs/x/checkpoints ckpt/t1p1 --to hybridflow --tp 1 --pp 1 --config models/qwen
  HF MoE -> a run at tp 2, dp 2, experts split over 2 ranks (actor.parallel.ep=2):
      hybridflow reshard models/qwen3_moe ckpt/ep2 --to hybridflow --tp 2 --dp 2 --ep 2
  hybridflow checkpoint -> HF for release (a critic becomes a one-label ...ForTokenClassification):
      hybridflow reshard runs/x/checkpoints/step_000100 release/ --to hf --config models/qwen [--role critic]
  HF or hybridflow -> megatron-core dist_checkpointing (what Megatron-LM's GPTModel loads at --tp):
      hybridflow reshard models/qwen ckpt/qwen_dist --to dist --tp 2
  dist_checkpointing -> HF or hybridflow:
      hybridflow reshard ckpt/qwen_dist release/ --to hf --config models/qwen
  an FSDP engine's torch DCP checkpoint (a step with its actor/ or critic/, or that directory) -> any format:
      hybridflow reshard runs/x/checkpoints/step_000100 release/ --to hf --config models/qwen [--role critic]
  HF (or any) -> an FSDP checkpoint (whole tensors; FSDPEngine.load takes it at any world size):
      hybridflow reshard models/qwen ckpt/qwen_fsdp --to fsdp
checks: --dry-run prints every output file and tensor (shape, source, bytes) and writes nothing;
--verify reads DST back and compares every tensor with SRC, bit for bit; --verify-logits also
compares the logits of both on a fixed batch. Refused before anything is written: a TP that does
not divide the attention heads, KV heads or MLP features, a PP that does not divide the layers,
an architecture other than llama, qwen2 and mistral, a non-empty DST without --overwrite.
"""


def _size(text: str) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    number = text.rstrip("bBkKmMgGiI")
    unit = text[len(number):].lower()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB or 500MiB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return int(value)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from hybridflow.checkpoint.format import ROLES
    from hybridflow.reshard.formats import FORMATS

    p = argparse.ArgumentParser(
        prog="hybridflow reshard", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Convert a checkpoint between HF safetensors, megatron-core dist_checkpointing, "
                    "hybridflow training checkpoints (megatron-core shards at any TP/PP) and FSDP engine "
                    "checkpoints (torch DCP); tensor by tensor.")
    p.add_argument("src", type=Path, help="the checkpoint to read (HF, dist_checkpointing, hybridflow or FSDP)")
    p.add_argument("dst", type=Path, help="the directory to write")
    p.add_argument("--to", required=True, choices=tuple(FORMATS), help="the format of DST")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size of DST (hybridflow, dist)")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline stages of DST (hybridflow)")
    p.add_argument("--virtual-pp", type=_positive, default=1, dest="virtual_pp",
                   help="model chunks per pipeline stage of DST (hybridflow; a run's actor.parallel.virtual_pp)")
    p.add_argument("--dp", type=_positive, default=1,
                   help="data-parallel replicas of DST (hybridflow: each rank reads its own file)")
    p.add_argument("--cp", type=_positive, default=1,
                   help="context-parallel ranks of DST (hybridflow: each reads its own file; a run's parallel.cp)")
    p.add_argument("--ep", type=_positive, default=1,
                   help="expert-parallel size of DST (hybridflow, an MoE model: each shard holds experts / ep of "
                        "every layer's experts, as a run at parallel.ep writes them)")
    p.add_argument("--role", choices=ROLES, default="actor",
                   help="which model of a hybridflow checkpoint to read (default actor)")
    p.add_argument("--config", type=Path,
                   help="the model's config.json or directory, for a checkpoint without one beside it")
    p.add_argument("--make-vocab-size-divisible-by", type=_positive, default=128, dest="divisible_by",
                   help="Megatron's vocabulary padding (a multiple of this times --tp); the run's "
                        "model.make_vocab_size_divisible_by (default 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the weights (default: keep SRC's)")
    p.add_argument("--max-shard-size", type=_size, default=5 * 2**30, dest="max_shard_bytes",
                   help="HF: start a new safetensors file past this size (default 5GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST (once the new one is complete)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument("--verify", action="store_true", help="read DST back and compare every tensor with SRC")
    p.add_argument("--verify-logits", action="store_true",
                   help="also compare the logits of SRC and DST on a fixed batch (loads both models)")
    p.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")
    return p


def main(argv: list[str]) -> int:
    from hybridflow.reshard.convert import Request, run

    args = build_parser().parse_args(argv)
    req = Request(**vars(args))
    result = run(req)
    if result is not None:
        print(result.summary(req.dst))
    return 0


def tool_main(argv: list[str]) -> int:
    """`main` for a script of its own (tools/reshard.py): bad input is one line and exit status 2."""
    try:
        return main(argv)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"hybridflow: error: {exc}", file=sys.stderr)
        return 2
