"""The built-in generator at tg = 2 (two gloo processes) equals the whole model on one rank:
logits, greedy tokens, keyed samples and their log-probs."""
import pytest
import torch

from hybridflow.models import Decoder, DecoderConfig, get_bridge
from hybridflow.rollout import Generator, SamplingParams

PAD = 0


def case(tied: bool, tp: int):
    """A tiny model whose vocabulary (37) needs padding to split, and a left-padded prompt batch."""
    cfg = DecoderConfig(model_type="llama", vocab_size=37, hidden_size=64, intermediate_size=96, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=tied, qkv_bias=True)
    dec = Decoder(cfg).init_weights(std=0.3, seed=3)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    bridge = get_bridge(cfg, 16, tp)
    full = bridge.hf_to_megatron(get_bridge(cfg).generation_to_hf(dict(dec.state_dict())))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 37, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return cfg, bridge, full, {"ids": ids * mask, "mask": mask}


def shard_decoder(cfg: DecoderConfig, bridge, full: dict, group, rank: int, size: int) -> Decoder:
    """Rank `rank`'s generation shard of the whole model `full` (megatron names, as `case` returns it) in the
    `size`-way `group`, as the 3D-HybridEngine's generation model holds it."""
    from hybridflow.hybrid_engine.tensor_parallel import GroupTensorParallel, generation_shard

    model = Decoder(cfg, GroupTensorParallel(group, bridge.padded_vocab))
    missing, unexpected = model.load_state_dict(generation_shard(bridge, full, rank, size), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def generate_all(model: Decoder, gen: Generator, batch: dict) -> dict:
    ids, mask = batch["ids"], batch["mask"]
    with torch.no_grad():
        logits = model(ids, mask)
    greedy = gen.generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))
    keys = torch.tensor([11, 12, 13])
    sampled = gen.generate(ids, mask, SamplingParams(max_new_tokens=8, temperature=1.0, n=2), row_keys=keys)
    return {"logits": logits, "greedy_tokens": greedy.responses, "greedy_log_probs": greedy.log_probs,
            "sampled_tokens": sampled.responses, "sampled_log_probs": sampled.log_probs}


@pytest.fixture(scope="module")
def launched(two_process_launch):
    return torch.load(two_process_launch["tp_generate"])  # tp_generate_check.py, in the 2-process launch


@pytest.mark.timeout(600)  # its setup may run the 2-process launch (tests/conftest.py)
@pytest.mark.parametrize("tied", [False, True])
def test_tg2_generator_equals_one_rank(launched, tied):
    cfg, bridge, full, batch = case(tied, tp=1)
    model = Decoder(cfg)
    model.load_state_dict(bridge.megatron_to_generation(full), strict=False)
    want = generate_all(model.eval(), Generator(model, PAD), batch)
    got = launched[tied]
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=0)
    for key in ("greedy_tokens", "sampled_tokens"):
        assert torch.equal(got[key], want[key]), key
    for key in ("greedy_log_probs", "sampled_log_probs"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)


def test_a_tp_decoder_refuses_groups_that_do_not_split_it():
    from hybridflow.models.decoder import local_config

    cfg, *_ = case(False, tp=1)
    with pytest.raises(ValueError, match="cannot split 2 KV heads"):
        local_config(cfg, 4)
