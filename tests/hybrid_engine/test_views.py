"""Generation weights are views of the training engine; sampling agrees with the engine's log-probs."""
import pytest
import torch

from hybridflow.config.schema import ActorConfig, OptimConfig, ParallelConfig
from hybridflow.data import fields as F
from hybridflow.engine import MegatronEngine
from hybridflow.hybrid_engine import bind_parameters, generation_model
from hybridflow.models.decoder import Decoder
from hybridflow.rollout import Generator, SamplingParams
from hybridflow.roles import Actor
from tests.engine.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.fixture(scope="module")
def megatron_world():
    from hybridflow.engine.distributed import init_process_group
    init_process_group("cpu")


def test_bind_parameters_rejects_wrong_names_and_shapes():
    cfg, dec, _ = tiny_model()
    views = dict(dec.named_parameters())
    with pytest.raises(KeyError, match="missing"):
        bind_parameters(Decoder(cfg), {k: v for k, v in views.items() if k != "norm.weight"})
    bad = dict(views, **{"norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="norm.weight"):
        bind_parameters(Decoder(cfg), bad)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_engine_log_probs_and_follow_updates(temperature):
    cfg, _, hf = tiny_model()
    engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-2), total_steps=10)
    engine.load_hf_state_dict(hf)
    model = generation_model(engine)
    params = engine.named_params()
    assert model.embed.weight.data_ptr() == params["embedding.word_embeddings.weight"].data_ptr()
    assert model.layers[1].attn.qkv.weight.data_ptr() == \
        params["decoder.layers.1.self_attention.linear_qkv.weight"].data_ptr()

    gen = Generator(model, pad_token_id=0)
    actor = Actor(ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size=6), engine, temperature=temperature)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    mask = (prompts != 0).long()
    sampling = SamplingParams(max_new_tokens=6, temperature=temperature, n=2, stop_token_ids=(2,))

    def roll(seed):
        out = gen.generate(prompts, mask, sampling, generator=torch.Generator().manual_seed(seed))
        batch = {F.INPUT_IDS: torch.cat([out.prompts, out.responses], 1),
                 F.ATTENTION_MASK: torch.cat([out.prompt_mask, out.response_mask], 1),
                 F.RESPONSES: out.responses, F.RESPONSE_MASK: out.response_mask}
        return out, batch

    out, batch = roll(0)
    recomputed = actor.compute_log_probs(batch, micro_batch_size=4)[F.OLD_LOG_PROBS]
    m = out.response_mask.bool()
    torch.testing.assert_close(recomputed[m], out.log_probs[m], atol=1e-4, rtol=1e-4)

    # One update later the generator samples from the new weights without any sync step.
    adv = torch.ones(out.responses.shape) * out.response_mask
    actor.update({**batch, F.OLD_LOG_PROBS: recomputed, F.ADVANTAGES: adv}, step=0)
    out2, batch2 = roll(1)
    recomputed2 = actor.compute_log_probs(batch2, micro_batch_size=4)[F.OLD_LOG_PROBS]
    m2 = out2.response_mask.bool()
    torch.testing.assert_close(recomputed2[m2], out2.log_probs[m2], atol=1e-4, rtol=1e-4)
