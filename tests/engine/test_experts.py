"""Expert parallelism in the engine: the name mapping (here), and the engine at tp2 x ep2 on 4 processes
(tests/engine/ep_check.py in the 4-process launch): export, and generation from the gathered experts."""
import pytest
import torch

from hybridflow.engine.experts import ExpertShard, expert_of


def test_each_rank_holds_its_block_of_experts_under_local_numbers():
    first, second = ExpertShard(8, 2, 0), ExpertShard(8, 2, 1)
    name = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert expert_of(name) == 5 and expert_of("decoder.layers.3.mlp.router.weight") is None
    assert first.local(name) is None
    assert second.local(name) == "decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight"
    assert second.global_name(second.local(name)) == name
    assert first.local("decoder.layers.3.mlp.router.weight") == "decoder.layers.3.mlp.router.weight"
    assert ExpertShard(8, 1, 0).local(name) == name
    with pytest.raises(ValueError, match="does not divide"):
        ExpertShard(6, 4, 0)


@pytest.mark.slow
def test_tp2_ep2_exports_the_checkpoint_and_generates_the_decoders_tokens(four_process_launch):
    """At tp2 x ep2 each rank holds a TP half of half the experts. The export (TP then expert-parallel
    gathers) is the checkpoint bit for bit; the generation model, the other rank's experts gathered and then
    regrouped to tg = 1 or 2, greedily generates the plain decoder's tokens (a token sent to the wrong
    rank's expert changes them); the training forward gives the decoder's logits, and a model whose ranks swapped
    their experts does not; at tg = 2 a switch receives only the other rank's experts' TP shard:
    (ep - 1) / ep of the expert bytes over tp."""
    from hybridflow.models.checkpoint import load_hf_state_dict

    got = torch.load(four_process_launch["experts"])
    hf = load_hf_state_dict(four_process_launch["experts_hf"])
    assert got["export"].keys() == hf.keys() and all(torch.equal(got["export"][k], hf[k]) for k in hf)
    # The training forward: the plain decoder's logits (float32; TP-split matmuls and another summation order
    # in the experts' weighted sum: 2e-5 absolute, as the engine's tests allow), and far off once every rank
    # holds its peer's experts, as if the dispatcher had sent each token to the wrong rank.
    assert got["logits_gap"] < 2e-5 and got["swapped_logits_gap"] > 1e-2, got
    experts = sum(t.numel() * t.element_size() for k, t in hf.items() if ".experts." in k)
    for tg in (1, 2):
        assert torch.equal(got[f"tg{tg}"]["tokens"], got["want"]), tg
        assert got[f"tg{tg}"]["reshard/expert_bytes_gathered"] == experts / 2 / 2
    assert got["tg2"]["reshard/bytes_received"] == experts / 2 / 2
