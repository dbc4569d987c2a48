"""Convert a checkpoint between formats and TP/PP layouts: `hybridflow reshard`, as a script.

    python tools/reshard.py SRC DST --to hybridflow --tp 2 --pp 2

Everything (options, forms, checks) is `hybridflow/reshard/cli.py`'s; see `--help`.
"""
import os
import sys
from pathlib import Path

# Host work: megatron-core's CPU layer (the dist_checkpointing forms) runs only where no GPU is visible.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridflow.reshard.cli import tool_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(tool_main(sys.argv[1:]))
