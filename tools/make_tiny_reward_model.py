"""Write the tiny random reward model that DataFlow tests and examples score with.

A `LlamaForSequenceClassification` (num_labels=1, hidden 32, 2 layers) over
the demo model's character vocabulary (`hybridflow/assets/demo_model`'s
tokenizer files are copied beside it), so it scores the demo model's
(prompt, response) pairs. Its weights are random (seeded): the scores mean
nothing and exist to exercise the reward-model plumbing (loading, batching,
padding, a guard's threshold). The score head is drawn with std 1 rather than
the usual 0.02 so scores spread on both sides of 0 and a guard with threshold
0 passes some samples and rejects others.

Usage::

    python tools/make_tiny_reward_model.py [--out hybridflow/assets/tiny_reward_model] [--seed 0]
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "hybridflow" / "assets" / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
README = """# tiny_reward_model

A random (seed {seed}) `LlamaForSequenceClassification` with one label:
hidden 32, 2 layers, 4 heads, {params:,} parameters, over the 16-token
character vocabulary of `../demo_model` (whose tokenizer files are copied
here; `<pad>` = 0).

**Its weights are random: the scores are meaningless.** It exists for
plumbing tests and examples of reward-model and guard nodes (loading,
batching, padding, thresholds), e.g. `examples/my_rl_flow.py`.

Made by `python tools/make_tiny_reward_model.py --seed {seed}`.
"""


def build(seed: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=1,
        tie_word_embeddings=False)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 1.0 if name.startswith("score") else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "hybridflow" / "assets" / "tiny_reward_model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = build(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(DEMO / name, args.out / name)
    params = sum(p.numel() for p in model.parameters())
    (args.out / "README.md").write_text(README.format(seed=args.seed, params=params))
    print(f"wrote {args.out} ({params:,} parameters)")


if __name__ == "__main__":
    main()
