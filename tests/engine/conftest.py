"""Tiny models shared by the engine tests (world size 1, gloo, in this process)."""
import pytest
import torch

from hybridflow.models import DecoderConfig
from hybridflow.models.bridge import get_bridge
from hybridflow.models.decoder import Decoder

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
            max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def tiny_model(**overrides):
    cfg = DecoderConfig.from_hf_dict({**TINY, **overrides})
    dec = Decoder(cfg).init_weights(std=0.2, seed=0)
    return cfg, dec, get_bridge(cfg).generation_to_hf(dict(dec.state_dict()))


def rl_batch(vocab: int, b: int = 4, t: int = 5, r: int = 4, seed: int = 0):
    """Left-padded prompts + right-padded responses, as rollout produces them."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([5, 3, 4, 1])[:b]
    resp_len = torch.tensor([4, 2, 1, 3])[:b]
    pm = (torch.arange(t)[None] >= (t - prompt_len)[:, None]).long()
    rm = (torch.arange(r)[None] < resp_len[:, None]).long()
    prompts = torch.randint(4, vocab, (b, t), generator=g) * pm
    responses = torch.randint(4, vocab, (b, r), generator=g) * rm
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pm, rm], 1),
            "responses": responses, "response_mask": rm}


def grouped_rl_batch(vocab: int, seed: int = 2):
    """GRPO's shape: rl_batch's 4 prompts sampled 2, 3, 2 and 1 times, their rows interleaved (as a
    shuffled mini-batch holds them), each row with its own response of 1 to 4 tokens."""
    batch = rl_batch(vocab)
    rows = [0, 1, 0, 2, 1, 0, 3, 2]
    out = {k: v[rows].clone() for k, v in batch.items()}
    r = out["responses"].shape[1]
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(r)[None] < torch.tensor([4, 2, 1, 3, 4, 2, 3, 1])[:, None]).long()
    out["responses"] = torch.randint(4, vocab, mask.shape, generator=g) * mask
    out["response_mask"] = mask
    out["input_ids"][:, -r:], out["attention_mask"][:, -r:] = out["responses"], mask
    return out


def assert_one_adam_step_close(got: dict, want: dict, before: dict, lr: float) -> None:
    """Weights after Adam's first step from `before`, taken by two computations of the same gradients (two
    model codes, or one at another summation order), compared element by element.

    That step is lr * g / (|g| + eps) (with bias correction m = g, v = g^2): lr * sign(g) where |g| >> eps,
    which float rounding cannot move, so there the two agree within 5% of lr. Where a gradient is within a
    few eps of 0 (0 up to rounding, both steps under half of lr), the step's size and sign are rounding's:
    there the two agree within lr (measured: one element of 6144 in a Qwen2 MLP stepped 0.196 lr on one code
    and 0.251 lr on the other on an AVX2 CPU, equal on AVX-512)."""
    assert got and got.keys() == want.keys(), sorted(set(got) ^ set(want))
    settled = 0
    for name, value in got.items():
        start, value, other = before[name].cpu(), value.cpu(), want[name].cpu()
        rounding = ((value - start).abs() < 0.5 * lr) & ((other - start).abs() < 0.5 * lr)
        settled += int((~rounding).sum())
        over = (value - other).abs() > torch.where(rounding, lr, 0.05 * lr)
        assert not over.any(), (f"{name}: {int(over.sum())} of {value.numel()} elements differ by more than "
                                f"the allowance, up to {float((value - other).abs()[over].max()) / lr:.3f} lr")
    assert settled > 0, "no weight moved by half of lr: `before` is not the weights before the step"


@pytest.fixture(scope="session")
def megatron_world():
    """One process group for every engine test in this process."""
    from hybridflow.engine.distributed import init_process_group
    init_process_group("cpu")
    yield


def dp_case():
    """A fixed batch and optimizer for the data-parallel equivalence test."""
    from hybridflow.config.schema import ActorConfig, OptimConfig
    from hybridflow.data import fields as F
    cfg, _, hf = tiny_model()
    batch = rl_batch(cfg.vocab_size)
    g = torch.Generator().manual_seed(5)
    batch[F.OLD_LOG_PROBS] = -2.0 + 0.3 * torch.randn(batch["responses"].shape, generator=g)
    batch[F.ADVANTAGES] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    optim = OptimConfig(lr=1e-2, grad_clip=100.0)
    # Two prompts' worth per mini-batch, so the global batch is one mini-batch.
    actor_cfg = ActorConfig(optim=optim, ppo_mini_batch_size=4, ppo_micro_batch_size=1)
    return cfg, hf, batch, optim, actor_cfg


def write_layout_model(path):
    """The tiny model with tied embeddings (a last-stage copy at pp > 1) as an HF checkpoint at `path`."""
    from hybridflow.models.checkpoint import save_hf_checkpoint

    cfg, _, hf = tiny_model(tie_word_embeddings=True)
    save_hf_checkpoint(hf, cfg.to_hf_dict(), path)
    return path


def layout_case(path):
    """Model, batch and optimizer shared by the layout tests: the one-rank run and the 4-rank launch."""
    from types import SimpleNamespace

    from hybridflow.config.schema import ActorConfig, OptimConfig
    from hybridflow.data import fields as F

    cfg = DecoderConfig.from_pretrained(path)
    batch = rl_batch(cfg.vocab_size)
    g = torch.Generator().manual_seed(7)
    batch[F.OLD_LOG_PROBS] = -2.0 + 0.3 * torch.randn(batch["responses"].shape, generator=g)
    batch[F.ADVANTAGES] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    # Adam with a large eps moves each weight in proportion to its gradient, so the updated weights
    # compare tightly; clipping at 0.5 is active (the norm is ~2) and so tests the gradient norm.
    optim = OptimConfig(lr=1e-2, eps=1.0, grad_clip=0.5)
    actor_cfg = ActorConfig(optim=optim, ppo_mini_batch_size=4, ppo_micro_batch_size=1)
    value_head = 0.1 * torch.randn(1, cfg.hidden_size, generator=g)
    returns = torch.randn(batch["responses"].shape, generator=g)  # the critic's targets
    return SimpleNamespace(cfg=cfg, path=str(path), batch=batch, optim=optim, actor_cfg=actor_cfg,
                           value_head=value_head, returns=returns, grouped=grouped_rl_batch(cfg.vocab_size))
