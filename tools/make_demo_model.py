"""Build the tiny warm-started model and the data that ``make demo`` trains on.

``make demo`` runs GRPO on CPU on the built-in addition task
(:mod:`hybridflow.data.arithmetic`, ``"042+917="`` -> ``"0959"``). RL from a
random model would spend its whole budget finding the output format, so this
tool ships a ~0.86M-parameter Llama-style model that a short supervised phase
has brought to a modest greedy accuracy: high enough that GRPO groups hold both
rewarded and unrewarded answers, low enough that RL visibly improves it.

Accuracy rises sharply during SFT (a few percent to over half within ~80
steps), so the checkpoint is chosen by measurement, not by step count: the
model is evaluated every ``--eval-every`` steps on a validation split and the
first checkpoint whose accuracy lies in ``[--band-low, --band-high]`` is
kept. Its accuracy on the shipped held-out test split is reported separately.

One draw without replacement (:func:`hybridflow.data.arithmetic.generate_splits`)
yields every split, so RL prompts, SFT problems, validation and test are
pairwise disjoint. Written under ``--out`` (default ``hybridflow/assets``)::

    arithmetic/train.parquet   RL prompts
    arithmetic/sft.parquet     the supervised problems
    arithmetic/test.parquet    held-out evaluation prompts
    demo_model/                config.json, model.safetensors, tokenizer files, README.md

(the validation split is not written; the seed reproduces it). The same
``--seed`` and arguments give bit-identical files with the same torch build.

Tokenization is exactly the RL trainer's: the prompt goes through
:class:`~hybridflow.data.dataset.PromptDataset` with ``apply_chat_template=False``
(``<bos>`` + one token per character) and the response is the answer's
characters followed by ``<eos>``. Every sequence has the same length, so greedy
exact match needs only one teacher-forced forward pass (:func:`greedy_correct`).

Usage::

    python tools/make_demo_model.py [--out hybridflow/assets] [--seed 0]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from hybridflow.config.schema import DataConfig
from hybridflow.data.arithmetic import generate_splits, write_parquet
from hybridflow.data.dataset import PromptDataset
from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer
from hybridflow.models.checkpoint import save_decoder
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import Decoder

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "hybridflow" / "assets"
DATA_DIR, MODEL_DIR, MOE_MODEL_DIR = "arithmetic", "demo_model", "demo_moe_model"
CHARS = "0123456789+="
DIGITS = 3
MAX_PROMPT_LENGTH = 16  # what the demo's data config uses; prompts are 9 tokens
# Ids fixed by build_char_tokenizer: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then CHARS.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4 + len(CHARS),
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "torch_dtype": "float32",
}
# `--moe`: the mixture-of-experts sibling (Qwen3-MoE: QK-norm; 8 experts of 192 features, 2 per token, so
# each token's MLP computes what the dense model's 384 features do).
MOE_MODEL_CONFIG: dict[str, Any] = {
    **MODEL_CONFIG, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "norm_topk_prob": True,
}


@dataclass(frozen=True)
class Recipe:
    """Supervised-phase settings. The defaults reach the band in 150-300 steps
    (seeds differ), under a minute on two idle CPU cores."""

    seed: int = 0
    batch_size: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_steps: int = 2000
    eval_every: int = 5
    band: tuple[float, float] = (0.25, 0.35)


@dataclass
class Problems:
    """Tokenized problems. ``sequences[N, P + A]`` = prompt ids (``P``, BOS
    included) then response ids (``A`` = answer characters + EOS)."""

    sequences: torch.Tensor
    prompt_len: int
    prompts: list[str]
    answers: list[str]

    def __len__(self) -> int:
        return self.sequences.shape[0]


@dataclass
class Selection:
    """The chosen checkpoint and how training got there."""

    step: int
    val_accuracy: float
    state: dict[str, torch.Tensor]
    in_band: bool
    seconds: float
    history: list[tuple[int, float]] = field(default_factory=list)


# -- data ----------------------------------------------------------------------------

def write_data(out_dir: Path, n_rl: int, n_sft: int, n_val: int, n_test: int,
               seed: int) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Write train/sft/test parquet files; returns their paths and the validation rows.

    One draw of ``n_rl + n_sft + n_val + n_test`` distinct problems is cut in
    that order, so no problem is in two splits.
    """
    train, test = generate_splits(n_rl + n_sft + n_val, n_test, DIGITS, seed)
    parts = {"train": train[:n_rl], "sft": train[n_rl:n_rl + n_sft], "val": train[n_rl + n_sft:]}
    for split in ("sft", "val"):
        for i, row in enumerate(parts[split]):
            row["extra_info"].update(split=split, index=i)
    paths = {name: write_parquet(rows, out_dir / f"{name}.parquet")
             for name, rows in (("train", parts["train"]), ("sft", parts["sft"]), ("test", test))}
    return paths, parts["val"]


def load_problems(tokenizer: Tokenizer, files: Path | Sequence[Path]) -> Problems:
    """Tokenize prompt files exactly as the RL trainer does, then append answer + EOS."""
    cfg = DataConfig(apply_chat_template=False, max_prompt_length=MAX_PROMPT_LENGTH,
                     overlong_prompts="error")
    dataset = PromptDataset(cfg, tokenizer, files)
    answers = [str(r.ground_truth) for r in dataset.records]
    responses = [ids + [tokenizer.eos_token_id]
                 for ids in tokenizer.encode_batch(answers, add_special_tokens=False)]
    rows = [list(r.input_ids) + resp for r, resp in zip(dataset.records, responses)]
    prompt_lens = {len(r.input_ids) for r in dataset.records}
    if len(prompt_lens) != 1 or len({len(row) for row in rows}) != 1:
        raise ValueError(f"{files}: prompts and answers must have fixed lengths for this tool")
    return Problems(torch.tensor(rows, dtype=torch.long), prompt_lens.pop(),
                    [r.prompt_text for r in dataset.records], answers)


def problems_from_rows(tokenizer: Tokenizer, rows: list[dict[str, Any]]) -> Problems:
    """:func:`load_problems` for rows kept in memory (via a temporary parquet file)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_problems(tokenizer, write_parquet(rows, Path(tmp) / "rows.parquet"))


# -- model, loss and evaluation --------------------------------------------------

def build_model(seed: int, moe: bool = False) -> Decoder:
    config = MOE_MODEL_CONFIG if moe else MODEL_CONFIG
    return Decoder(DecoderConfig.from_hf_dict(config)).init_weights(std=0.02, seed=seed)


def response_logits(model: Decoder, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits[N, A, V] that predict the response tokens ``sequences[:, prompt_len:]``."""
    return model(sequences[:, :-1])[:, prompt_len - 1:]


def sft_loss(model: Decoder, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Mean cross-entropy over the response tokens only (answer + EOS)."""
    logits = response_logits(model, sequences, prompt_len)
    return F.cross_entropy(logits.flatten(0, 1), sequences[:, prompt_len:].flatten())


@torch.no_grad()
def greedy_correct(model: Decoder, problems: Problems, batch_size: int = 1000) -> torch.Tensor:
    """Bool[N]: would greedy decoding produce exactly answer + EOS?

    Yes iff the argmax at every response position equals the target: then each
    greedy step is fed the same prefix as this teacher-forced pass.
    """
    was_training = model.training
    model.eval()
    out = []
    for seqs in problems.sequences.split(batch_size):
        pred = response_logits(model, seqs, problems.prompt_len).argmax(-1)
        out.append((pred == seqs[:, problems.prompt_len:]).all(-1))
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def greedy_decode(model: Decoder, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """LongTensor[N, new_tokens]: plain greedy decoding, one full forward per token
    (the slow reference that :func:`greedy_correct` shortcuts)."""
    ids = prompt_ids
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt_ids.shape[1]:]


def accuracy(model: Decoder, problems: Problems) -> float:
    """Greedy exact-match accuracy (answer and EOS) on ``problems``."""
    return greedy_correct(model, problems).float().mean().item()


# -- supervised phase ------------------------------------------------------------

def _lr_at(step: int, recipe: Recipe) -> float:
    return recipe.lr * min(1.0, (step + 1) / max(1, recipe.warmup_steps))


def _band_distance(acc: float, band: tuple[float, float]) -> float:
    return max(band[0] - acc, acc - band[1], 0.0)


def train_until_band(model: Decoder, sft: Problems, val: Problems, recipe: Recipe) -> Selection:
    """AdamW on ``sft`` until a validation accuracy lands in ``recipe.band``.

    Stops at the first evaluation inside the band, or once accuracy has passed
    the band or ``max_steps`` are done; then the evaluated checkpoint closest
    to the band is returned (``in_band`` says whether it is inside).
    """
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                            weight_decay=recipe.weight_decay)
    start = time.perf_counter()
    history: list[tuple[int, float]] = []
    best: Selection | None = None
    order, cursor = torch.randperm(len(sft), generator=gen), 0
    model.train()
    for step in range(recipe.max_steps + 1):
        if step % recipe.eval_every == 0 or step == recipe.max_steps:
            acc = accuracy(model, val)
            history.append((step, acc))
            miss = _band_distance(acc, recipe.band)
            if best is None or miss < _band_distance(best.val_accuracy, recipe.band):
                best = Selection(step, acc, copy.deepcopy(model.state_dict()), False, 0.0)
            print(f"step {step:4d}  val acc {acc:6.1%}  ({time.perf_counter() - start:5.1f}s)", flush=True)
            if acc >= recipe.band[0]:
                break  # inside the band, or past it: more steps only move further away
        if step == recipe.max_steps:
            break
        if cursor + recipe.batch_size > len(sft):
            order, cursor = torch.randperm(len(sft), generator=gen), 0
        batch = sft.sequences[order[cursor:cursor + recipe.batch_size]]
        cursor += recipe.batch_size
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe)
        loss = sft_loss(model, batch, sft.prompt_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"SFT loss became {loss.item()} at step {step}; lower --lr")
    best.in_band = _band_distance(best.val_accuracy, recipe.band) == 0.0
    best.seconds = time.perf_counter() - start
    best.history = history
    model.load_state_dict(best.state)
    return best


# -- checks and output -----------------------------------------------------------

@torch.no_grad()
def same_up_to_ties(model: Decoder, prompt_ids: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor,
                    tol: float = 1e-4) -> bool:
    """Do two greedy continuations[N, R] agree, except where ``model`` scores the
    two differing tokens within ``tol`` (an untrained model has near-ties that
    float rounding breaks either way)?"""
    for row in (ours != theirs).any(-1).nonzero().flatten().tolist():
        j = int((ours[row] != theirs[row]).nonzero()[0])
        logits = model(torch.cat([prompt_ids[row], ours[row, :j]])[None])[0, -1]
        if logits[ours[row, j]] - logits[theirs[row, j]] > tol:
            return False
    return True


def check_with_transformers(model_dir: Path, model: Decoder, problems: Problems, n: int = 64) -> None:
    """transformers loads ``model_dir``; its logits match ``model``'s, its greedy
    ``generate`` gives the same tokens as :func:`greedy_decode` and is right on
    exactly the prompts :func:`greedy_correct` marks."""
    import transformers  # dev dependency; only this check needs it

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    sub = Problems(problems.sequences[:n], problems.prompt_len, problems.prompts[:n], problems.answers[:n])
    n, width = len(sub), sub.sequences.shape[1] - sub.prompt_len
    prompt_ids = hf_tok(sub.prompts, return_tensors="pt")["input_ids"]
    if not torch.equal(prompt_ids, sub.sequences[:, :sub.prompt_len]):
        raise AssertionError("transformers tokenizes the prompts differently from hybridflow")
    with torch.no_grad():
        torch.testing.assert_close(hf_model(sub.sequences).logits, model.eval()(sub.sequences),
                                   atol=1e-4, rtol=1e-4)
        out = hf_model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                                max_new_tokens=width, pad_token_id=PAD_ID)
    # generate stops once every row has emitted EOS and pads finished rows: do the same to ours.
    generated = F.pad(out[:, sub.prompt_len:], (0, width + sub.prompt_len - out.shape[1]), value=PAD_ID)
    ours = greedy_decode(model, prompt_ids, width)
    ours = ours.masked_fill((ours == EOS_ID).long().cumsum(-1) - (ours == EOS_ID).long() > 0, PAD_ID)
    if not same_up_to_ties(model, prompt_ids, ours, generated):
        raise AssertionError("transformers' greedy generate differs from hybridflow's greedy decoding")
    hf_correct = (generated == sub.sequences[:, sub.prompt_len:]).all(-1)
    expected = greedy_correct(model, sub)
    if not torch.equal(hf_correct, expected):
        raise AssertionError(f"transformers greedy correctness {hf_correct.tolist()} "
                             f"differs from the teacher-forced eval {expected.tolist()}")
    shown = [i for i in range(n) if hf_correct[i]][:2] + [i for i in range(n) if not hf_correct[i]][:2]
    for prompt, ids, ok in ((sub.prompts[i], generated[i], hf_correct[i]) for i in shown):
        print(f"  HF generate {prompt!r} -> {hf_tok.decode(ids)!r} ({'correct' if ok else 'wrong'})")
    print(f"transformers check passed: same greedy tokens as hybridflow, "
          f"{int(hf_correct.sum())}/{n} correct as the eval predicts")


def model_readme(command: str, recipe: Recipe, sel: Selection, test_acc: float,
                 sizes: dict[str, int], n_params: int, moe: bool = False) -> str:
    band = f"{recipe.band[0]:.0%}-{recipe.band[1]:.0%}"
    reached = "was" if sel.in_band else "was NOT reached; the closest checkpoint was kept, at"
    what = ("Qwen3-MoE-style model (4 layers, hidden 128, 4 heads with QK-norm, 8 SwiGLU experts of 192 "
            "features and 2 per token, 16-token character vocabulary) for `make demo-moe`" if moe else
            "Llama-style model (4 layers, hidden 128, 4 heads,\nSwiGLU 384, 16-token character vocabulary) for "
            "`make demo`")
    made = ("with the same `../arithmetic/*.parquet` as `../demo_model`" if moe
            else "together with `../arithmetic/*.parquet`")
    return f"""# {MOE_MODEL_DIR if moe else MODEL_DIR}

A {n_params:,}-parameter {what}: GRPO on the
built-in 3-digit addition task (`hybridflow/data/arithmetic.py`).

Made, {made}, by `tools/make_demo_model.py`:

    {command}

- seed {recipe.seed}; supervised phase on the {sizes['sft']} problems of
  `../arithmetic/sft.parquet`: AdamW, lr {recipe.lr} ({recipe.warmup_steps} warm-up steps),
  batch {recipe.batch_size}, loss on the answer and EOS tokens only.
- Chosen by measured accuracy: the first evaluation (every {recipe.eval_every} steps, on
  {sizes['val']} validation problems that are not shipped) inside {band}
  {reached} step {sel.step} ({sel.step * recipe.batch_size:,} sequences, {sel.seconds:.0f} s on CPU);
  validation accuracy {sel.val_accuracy:.1%}.
- **Held-out greedy exact-match accuracy (answer and EOS): {test_acc:.1%}** on the
  {sizes['test']} prompts of `../arithmetic/test.parquet`, which share no problem
  with `train.parquet` ({sizes['train']} RL prompts) or `sft.parquet`.

Prompt: `<bos>` then one token per character (`"042+917="` -> 9 ids), exactly
as `PromptDataset` with `apply_chat_template: false` tokenizes it; response:
the 4 answer characters then `<eos>`. Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2,
`<unk>`=3, then `0123456789+=` as 4..15.
"""


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Recipe]:
    d = Recipe()
    p = argparse.ArgumentParser(prog="python tools/make_demo_model.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes OUT/arithmetic and OUT/demo_model")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--rl", type=int, default=10000, help="RL training prompts (train.parquet)")
    p.add_argument("--sft", type=int, default=20000, help="supervised problems (sft.parquet)")
    p.add_argument("--val", type=int, default=1000, help="validation problems that choose the checkpoint")
    p.add_argument("--test", type=int, default=1000, help="held-out problems (test.parquet)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--band-low", type=float, default=d.band[0], help="target validation accuracy, lower end")
    p.add_argument("--band-high", type=float, default=d.band[1], help="target validation accuracy, upper end")
    p.add_argument("--skip-hf-check", action="store_true", help="do not load the result with transformers")
    p.add_argument("--moe", action="store_true", help=f"the mixture-of-experts sibling, written to "
                   f"OUT/{MOE_MODEL_DIR} (the data files are the dense model's: regenerated into a temporary "
                   "directory, not rewritten)")
    args = p.parse_args(argv)
    if not 0 <= args.band_low <= args.band_high <= 1:
        p.error("need 0 <= --band-low <= --band-high <= 1")
    recipe = Recipe(seed=args.seed, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                    weight_decay=args.weight_decay, max_steps=args.max_steps, eval_every=args.eval_every,
                    band=(args.band_low, args.band_high))
    return args, recipe


def main(argv: Sequence[str] | None = None) -> int:
    args, recipe = parse_args(argv)
    torch.manual_seed(recipe.seed)
    out: Path = args.out
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_char_tokenizer(CHARS, Path(tmp) / "tokenizer", add_bos_token=True)
        tokenizer = Tokenizer.from_path(tok_dir)
        data_dir = Path(tmp) / DATA_DIR if args.moe else out / DATA_DIR
        paths, val_rows = write_data(data_dir, args.rl, args.sft, args.val, args.test, recipe.seed)
        for name, path in paths.items():
            print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
        sft, test = load_problems(tokenizer, paths["sft"]), load_problems(tokenizer, paths["test"])
        val = problems_from_rows(tokenizer, val_rows)
        model = build_model(recipe.seed, args.moe)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params:,} parameters; SFT on {len(sft)} problems, band {recipe.band}")
        sel = train_until_band(model, sft, val, recipe)
        test_acc = accuracy(model, test)
        where = "inside" if sel.in_band else "NOT inside (closest kept)"
        print(f"chose step {sel.step} after {sel.seconds:.1f}s: val acc {sel.val_accuracy:.1%} {where} "
              f"the band; held-out test acc {test_acc:.1%} on {len(test)} prompts")
        command = " ".join(["python tools/make_demo_model.py", *(argv if argv is not None else sys.argv[1:])])
        readme = Path(tmp) / "README.md"
        sizes = {"train": args.rl, "sft": len(sft), "val": len(val), "test": len(test)}
        readme.write_text(model_readme(command.strip(), recipe, sel, test_acc, sizes, n_params, args.moe))
        extra = (*sorted(tok_dir.iterdir()), readme)
        model_dir = save_decoder(model, out / (MOE_MODEL_DIR if args.moe else MODEL_DIR), extra_files=extra)
    print(f"wrote {model_dir}")
    if not args.skip_hf_check:
        check_with_transformers(model_dir, model, test)
    print(json.dumps({"step": sel.step, "seconds": round(sel.seconds, 1), "val_accuracy": sel.val_accuracy,
                      "test_accuracy": test_acc, "in_band": sel.in_band}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
