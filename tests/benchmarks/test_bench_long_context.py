"""`hybridflow bench long_context`: the actor's update on one long sequence at cp = 1 and 2."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_long_context  # noqa: E402


@pytest.mark.timeout(400)
def test_cp2_halves_a_ranks_activations_and_computes_the_same_loss(tmp_path, capsys):
    """The activation count is autograd's saved bytes (exact, not a timing): at cp = 2 a rank holds about
    half of cp = 1's (its S/2 tokens, each still attending to all S keys, plus the gathered K and V), as the
    planner's model says; and the same seeded model and sequence give the same loss on both layouts
    (tolerance: cp = 2 sums the attention and the loss over two ranks' chunks in another order)."""
    bench_long_context.main(["--seq", "512", "--cps", "1,2", "--layers", "1", "--hidden", "64", "--vocab", "512",
                             "--json", str(tmp_path / "lc.json")])
    assert "model says" in capsys.readouterr().out
    one, two = json.loads((tmp_path / "lc.json").read_text())["rows"]
    assert (one["cp"], two["cp"], one["oom"], two["oom"]) == (1, 2, False, False)
    assert len(two["ranks"]) == 2
    ratio = two["activation_mib"] / one["activation_mib"]
    assert ratio <= 0.6, ratio  # issue 41's target
    assert ratio == pytest.approx(two["predicted_activation_ratio"], abs=0.1)
    losses = [r["loss"] for r in one["ranks"] + two["ranks"]]
    assert losses[0] is not None and losses == pytest.approx([losses[0]] * 3, rel=1e-5)
