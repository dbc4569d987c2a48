"""The fixed batch the tests on SmolLM2's real weights share: one rank in-process and TP = 3 under torchrun."""
import json
import shutil
from pathlib import Path

import torch

from hybridflow.data.tokenizer import Tokenizer
from tests.data.conftest import gsm8k_questions

RESPONSES = ("The answer is 42.", "Let me think step by step: 3 + 4 = 7", "No.")


def real_batch(model_dir) -> dict:
    """Three GSM8K questions in the chat template (left-padded) and three answers (right-padded)."""
    tok = Tokenizer.from_path(model_dir)
    prompts = [tok.encode(tok.render_prompt([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in gsm8k_questions(3)]
    responses = [tok.encode(r, add_special_tokens=False) for r in RESPONSES]
    t, r = max(map(len, prompts)), max(map(len, responses))
    parts = {k: torch.zeros(3, n, dtype=torch.long) for k, n in
             (("prompts", t), ("attention_prompt", t), ("responses", r), ("response_mask", r))}
    for i, (p, a) in enumerate(zip(prompts, responses)):
        parts["prompts"][i, t - len(p):] = torch.tensor(p)
        parts["attention_prompt"][i, t - len(p):] = 1
        parts["responses"][i, :len(a)] = torch.tensor(a)
        parts["response_mask"][i, :len(a)] = 1
    return {"input_ids": torch.cat([parts["prompts"], parts["responses"]], 1),
            "attention_mask": torch.cat([parts["attention_prompt"], parts["response_mask"]], 1),
            "responses": parts["responses"], "response_mask": parts["response_mask"]}


def update_case(batch: dict) -> tuple[dict, object]:
    """The batch with fixed old log-probs and advantages, and an actor config for one update of all 3 rows.

    Adam with eps = 1 moves each weight by about lr x its gradient (gradients here are far below eps), so the
    weights after one step compare the gradients themselves (lr 100 lifts the steps far above float32
    rounding of the weights); clipping at 1.0 is active.
    """
    from hybridflow.config.schema import ActorConfig, OptimConfig
    from hybridflow.data import fields as F

    g = torch.Generator().manual_seed(3)
    batch = dict(batch)
    mask = batch["response_mask"]
    batch[F.OLD_LOG_PROBS] = (-1.0 + 0.2 * torch.randn(mask.shape, generator=g)) * mask
    batch[F.ADVANTAGES] = torch.randn(mask.shape, generator=g) * mask
    cfg = ActorConfig(optim=OptimConfig(lr=100.0, eps=1.0, grad_clip=1.0), ppo_mini_batch_size=3,
                      ppo_micro_batch_size=3)
    return batch, cfg


TP3_LAYERS = 4  # the TP = 3 check runs SmolLM2's first 4 of 30 layers (see first_layers)

# Weights compared after the update: the embedding (tied, so the output layer's gradient too), a column-
# and a row-parallel matrix of the first layer, the fused gate/up of the last, and the final norm.
WATCHED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.0.self_attn.o_proj.weight", f"model.layers.{TP3_LAYERS - 1}.mlp.up_proj.weight",
           f"model.layers.{TP3_LAYERS - 1}.mlp.down_proj.weight", "model.norm.weight")


def first_layers(model_dir, out, layers: int = TP3_LAYERS) -> Path:
    """The model of `model_dir` cut to its first `layers` decoder layers (the real weights; the embedding,
    vocabulary, heads and final norm unchanged), written to `out` with its tokenizer files."""
    from hybridflow.models.checkpoint import load_hf_state_dict, save_hf_checkpoint

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    kept = {k: v for k, v in load_hf_state_dict(model_dir).items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_hf_checkpoint(kept, config, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out
