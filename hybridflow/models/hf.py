"""Hugging Face checkpoints at the models layer: what loading one needs below the generator.

`resolve_device` and `resolve_dtype` read `load_hf_model`'s arguments,
`read_config` its config.json, `prompt_ids` turns prompts into the token ids a
causal LM is fed, and `RewardModel` wraps a sequence classifier (reward model
or guard) running on `transformers`, which is imported only when one is loaded.

`load_hf_model` and the generating `CausalLM` live one layer up, in
`hybridflow/rollout/hf.py`: a causal LM generates with the built-in
`Generator`, and models import nothing above them (docs/design.md, section 2).
Users import them from `hybridflow.utils`.

Simplified on purpose: `device_map="auto"` puts the whole model on one device
(the first CUDA device when there is one, else the CPU). Splitting a large
model across the devices a node is given is the controller's job (placement),
not this loader's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from hybridflow.data.prompts import adds_special_tokens, encode_prompts

__all__ = ["RewardModel", "as_chat", "load_classifier", "prompt_ids", "read_config", "resolve_device",
           "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device_map: Optional[str]) -> torch.device:
    """The one device a model is placed on: None/"cpu" -> cpu; "auto" -> cuda if available."""
    if device_map is None:
        return torch.device("cpu")
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, (str, torch.device)):
        return torch.device(device_map)
    raise ValueError(f"device_map must be None, 'auto', 'cpu' or a device name like 'cuda:0', "
                     f"got {device_map!r} (splitting a model across devices is done by the "
                     f"controller's placement, not here)")


def as_chat(tokenizer: Any, prompts: Sequence[str]) -> list[str]:
    """Each prompt as one user turn of the chat template, generation prompt appended."""
    return [tokenizer.render_prompt([{"role": "user", "content": p}]) for p in prompts]


def prompt_ids(tokenizer: Any, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt as `CausalLM.generate` feeds it to the model (so a caller can check the
    lengths before loading weights). With `chat`, one user turn of the chat template, whose text already
    holds its special tokens; else the text with the tokenizer's BOS/EOS rule (`data.prompts`)."""
    return encode_prompts(tokenizer, as_chat(tokenizer, prompts) if chat else list(prompts), chat)


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """`dtype` as a torch.dtype ("float32", "bfloat16", "float16" or a dtype); None keeps the stored one."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


class RewardModel:
    """A sequence classifier scoring (prompt, response) pairs: reward model or guard.

    The text scored is the tokenizer's chat template applied to
    [user: prompt, assistant: response] when it has one, else
    `prompt + response`. The score is the logit (num_labels == 1) or the
    logit of the last label (num_labels >= 2, e.g. "safe" of [unsafe, safe]).
    """

    def __init__(self, model: Any, tokenizer: Any, path: Path, device: torch.device):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.device = device
        if tokenizer.pad_token is None:  # batching needs one; the EOS is the usual stand-in
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an EOS token")
        tokenizer.padding_side = "right"
        if model.config.pad_token_id is None:  # HF pools at the last token that is not padding
            model.config.pad_token_id = tokenizer.pad_token_id
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def _text(self, prompt: str, response: str) -> str:
        if self.chat:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + response

    @torch.no_grad()
    def _logits(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor:
        """Scores [len(pairs)] float32 on the CPU, all pairs in one forward pass."""
        texts = [self._text(p, r) for p, r in pairs]
        enc = self.tokenizer(texts, padding=True, return_tensors="pt",
                             add_special_tokens=adds_special_tokens(self.chat)).to(self.device)
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        return logits[:, -1].float().cpu()

    def __call__(self, prompt: str, response: str) -> torch.Tensor:
        """The score of one pair as a 0-d float tensor."""
        return self._logits([(prompt, response)])[0]

    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 16) -> list[float]:
        """Scores of many pairs, `batch_size` pairs per forward pass."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pairs = list(pairs)
        out: list[float] = []
        for start in range(0, len(pairs), batch_size):
            out.extend(self._logits(pairs[start:start + batch_size]).tolist())
        return out

    def check(self, prompt: str, response: str, threshold: float = 0.0) -> bool:
        """True when the pair's score is above `threshold` (a guard's "passes")."""
        return bool(self(prompt, response).item() > threshold)

    def __repr__(self) -> str:
        return f"RewardModel({str(self.path)!r}, device={self.device})"


def read_config(path: Path) -> dict[str, Any]:
    """The config.json of the HF model directory `path`; FileNotFoundError naming what is missing."""
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
    with open(config_file) as f:
        return json.load(f)


def load_classifier(path: Path, device: torch.device, dtype: Optional[torch.dtype]) -> RewardModel:
    """The `*ForSequenceClassification` checkpoint at `path` as a `RewardModel` on `device`."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"{path} is a sequence classifier, which runs on transformers: "
                          f"pip install transformers") from exc
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return RewardModel(model.to(device).eval(), tokenizer, path, device)
