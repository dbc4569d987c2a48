"""megatron-core dist_checkpointing: the tool's output, loaded by megatron-core itself at TP2 on 2 gloo
processes, gives the HF model's logits; and what megatron-core saves from that TP2 model converts back to the
HF model bit for bit."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.models.checkpoint import load_decoder
from tests.reshard.conftest import assert_same_hf

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def tool(*args) -> None:
    """tools/reshard.py in its own process (dist_checkpointing's saver starts a multiprocessing manager)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools/reshard.py"), *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_megatron_core_loads_the_tools_output_at_tp2_with_the_hf_logits(two_process_launch, tmp_path):
    """The launch (tests/conftest.py) wrote a Qwen2-shaped HF model (QKV bias, tied embeddings, GQA: 2 KV
    heads, one per TP rank), converted it with this tool to a dist checkpoint at TP2, and ran
    dist_load_check.py on it at 2 ranks."""
    hf, launch = two_process_launch["dist_hf"], two_process_launch
    assert (launch["dist"] / "metadata.json").is_file()
    got = torch.load(launch["dist_logits"], weights_only=True)
    with torch.no_grad():
        want = load_decoder(hf)(got["ids"])
    torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
    # What megatron-core itself saved at TP2 from the loaded model (two chunks per tensor, [gate; up] halves
    # from both ranks) reads back to the same HF model: the tool's writing and its reading, both checked.
    tool(launch["dist_resaved"], tmp_path / "from_megatron", "--to", "hf", "--config", hf)
    assert_same_hf(hf, tmp_path / "from_megatron")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_hf_to_dist_to_hf_is_bit_exact_for_qwen3_and_its_experts(tmp_path, family):
    """megatron-core stacks a layer's experts on a second leading axis of one key ([L, E, ...]); each expert's
    tensors are read back from their own slot, and QK-norm's weights from theirs."""
    from tests.reshard.conftest import write_model

    write_model(tmp_path / "hf", family)
    tool(tmp_path / "hf", tmp_path / "dist", "--to", "dist")
    tool(tmp_path / "dist", tmp_path / "out", "--to", "hf", "--config", tmp_path / "hf")
    assert_same_hf(tmp_path / "hf", tmp_path / "out")
