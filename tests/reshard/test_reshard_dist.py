"""megatron-core dist_checkpointing: the tool's output, loaded by megatron-core itself at TP2 on 2 gloo
processes, gives the HF model's logits; and what megatron-core saves from that TP2 model converts back to the
HF model bit for bit."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.models.checkpoint import load_decoder
from tests.reshard.conftest import assert_same_hf, write_model
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def tool(*args) -> None:
    """tools/reshard.py in its own process (dist_checkpointing's saver starts a multiprocessing manager)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools/reshard.py"), *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_megatron_core_loads_the_tools_output_at_tp2_with_the_hf_logits(tmp_path):
    write_model(tmp_path / "hf", "qwen2")  # QKV bias, tied embeddings, GQA (2 KV heads, one per TP rank)
    tool(tmp_path / "hf", tmp_path / "dist", "--to", "dist", "--tp", 2)
    assert (tmp_path / "dist" / "metadata.json").is_file()
    torchrun("tests/reshard/dist_load_check.py", 2, tmp_path / "dist", tmp_path / "hf", tmp_path / "out.pt",
             tmp_path / "megatron_tp2", timeout=240)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        want = load_decoder(tmp_path / "hf")(got["ids"])
    torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
    # What megatron-core itself saved at TP2 from the loaded model (two chunks per tensor, [gate; up] halves
    # from both ranks) reads back to the same HF model: the tool's writing and its reading, both checked.
    tool(tmp_path / "megatron_tp2", tmp_path / "from_megatron", "--to", "hf", "--config", tmp_path / "hf")
    assert_same_hf(tmp_path / "hf", tmp_path / "from_megatron")
