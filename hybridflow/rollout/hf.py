"""Local Hugging Face checkpoints as DataFlow node models: `load_hf_model(path)`.

    actor = load_hf_model("path/to/actor", device_map="auto")       # *ForCausalLM
    actor.generate(["042+917="])               # -> [("042+917=", "0959")]
    rm = load_hf_model("path/to/reward-model")                        # *ForSequenceClassification
    rm("042+917=", "0959").item(); rm.score(pairs); rm.check(prompt, response)

The architecture named in `config.json` picks the wrapper. A causal LM runs on
hybridflow's own plain `Decoder` and built-in KV-cache `Generator` (the
Llama/Qwen2/Mistral families), any other on its `transformers` class and
`hf_generate.HFGenerator` (a GPT-2 trained by the FSDP engine on transformers); a sequence classifier (reward model or guard)
is `models.hf.RewardModel`, on `transformers`. This module sits in the rollout
layer because a causal LM generates with the `Generator`; what loading needs
below it (devices, dtypes, config.json, prompt ids, the classifier) is in
`models/hf.py`. Users import `load_hf_model` from `hybridflow.utils`.

Both engines are built by the rollout factory (`rollout/factory.py`), as the
trainer's are. `engine="vllm"` generates with the vLLM backend
(`rollout/vllm_backend.py`, the trainer's own) when the package imports, its
weights pushed from the loaded decoder, never read again from disk; otherwise
the factory warns and falls back to the built-in engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from hybridflow.config.schema import ENGINES, RolloutConfig
from hybridflow.data.prompts import left_pad
from hybridflow.models.hf import (RewardModel, load_classifier, prompt_ids, read_config, resolve_device,
                                  resolve_dtype)
from hybridflow.models.decoder import Decoder
from hybridflow.rollout.backend import RolloutBackend
from hybridflow.rollout.factory import build_backend, build_with_fallback
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.rollout.weights import sync_weights

__all__ = ["CausalLM", "ENGINES", "HFModel", "RewardModel", "load_hf_model"]


class CausalLM:
    """A causal LM that turns prompts into (prompt, response) pairs.

    Runs on the built-in engine (plain `Decoder` + `Generator`), or on vLLM
    when `use_engine("vllm")` finds it installed; `backend` is the engine in use.
    """

    def __init__(self, decoder: Any, tokenizer: Any, path: Path, device: torch.device,
                 engine: str = "builtin"):
        self.model = decoder
        self.tokenizer = tokenizer
        self.path = path
        self.device = device
        pad = tokenizer.pad_token_id
        if pad is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an EOS token")
        self.generator = build_backend(RolloutConfig(engine="builtin"), decoder, tokenizer, str(path))
        self.backend: RolloutBackend = self.generator
        self.engine = "builtin"
        self._vllm: Any = None  # built on first use, then kept
        self.use_engine(engine)

    def use_engine(self, engine: str) -> "CausalLM":
        """Switch to "builtin" or "vllm"; vLLM missing -> a warning and the built-in engine.

        The vLLM engine is built once, from this model's config.json, and takes the decoder's weights
        by a push (the same path as the trainer's weight sync).
        """
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.backend, self.engine = self.generator, "builtin"
        if engine == "vllm" and self._vllm is None:
            # The factory warns (at this method's caller) and hands back a built-in engine when vLLM does not
            # import; that one is dropped for `self.generator`, on the same decoder, and vLLM is tried again
            # on the next call.
            backend, built = build_with_fallback(RolloutConfig(engine="vllm"), self.model, self.tokenizer,
                                                 str(self.path), device=self.device.type)
            if built == "vllm":
                sync_weights(backend, self.model)
                self._vllm = backend
        if engine == "vllm" and self._vllm is not None:
            self.backend, self.engine = self._vllm, "vllm"
        return self

    def _wants_chat(self, chat: Optional[bool]) -> bool:
        if chat is None:
            return self.tokenizer.has_chat_template
        if chat and not self.tokenizer.has_chat_template:
            raise ValueError(f"chat=True but the tokenizer at {self.path} has no chat template")
        return chat

    def _encode(self, prompts: Sequence[str], chat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input_ids and attention_mask [B, T] on the model's device (`prompt_ids`)."""
        return left_pad(prompt_ids(self.tokenizer, prompts, chat), self.generator.pad_token_id, device=self.device)

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 128, temperature: float = 0.0,
                 n: int = 1, seed: int = 0, chat: Optional[bool] = None,
                 **sampling: Any) -> list[tuple[str, str]]:
        """`n` responses per prompt as (prompt, response) pairs, prompt-major; greedy by default.

        `chat`: render each prompt as a user turn of the chat template (None:
        when the tokenizer has one, as an instruct model expects; the pairs
        still hold the prompts as given). Without a template the prompt's
        text goes in as it is.

        `sampling` takes the other `SamplingParams` fields (top_p, top_k,
        stop, stop_token_ids; EOS stops by default). Responses are decoded
        without special tokens. Sampling is reproducible for the same prompts
        in the same batch and `seed`; only greedy output is independent of
        how prompts are batched together.
        """
        if isinstance(prompts, str):
            raise TypeError("generate() takes a list of prompts, got a single string")
        prompts = list(prompts)
        if not prompts:
            return []
        chat = self._wants_chat(chat)
        params = self.sampling_params(max_new_tokens, temperature, n, **sampling)
        input_ids, mask = self._encode(prompts, chat)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        texts = self.complete(input_ids, mask, params, rng)
        return [(prompts[i // n], text) for i, text in enumerate(texts)]

    def sampling_params(self, max_new_tokens: int, temperature: float = 0.0, n: int = 1, **sampling: Any):
        """`SamplingParams` with this model's defaults: EOS stops, greedy when temperature is 0."""
        eos = self.tokenizer.eos_token_id
        sampling.setdefault("stop_token_ids", () if eos is None else (eos,))
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        sampling["stop"] = tuple(sampling.get("stop", ()))
        sampling.setdefault("do_sample", temperature > 0)
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n, **sampling)

    @torch.no_grad()
    def complete(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: Any,
                 generator: Optional[torch.Generator] = None) -> list[str]:
        """Responses to left-padded prompt ids [B, T], decoded without special tokens (B * params.n rows)."""
        out = self.backend.generate(input_ids, attention_mask, params, generator=generator)
        rows = [[t for t, m in zip(r, mk) if m] for r, mk in
                zip(out.responses.tolist(), out.response_mask.tolist())]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    @torch.no_grad()
    def rate(self, pairs: Sequence[tuple[str, str]], scale: int = 5,
             criterion: str = "helpful, correct and well written") -> list[float]:
        """The model as a judge: an expected rating in [1, scale] for each (prompt, response).

        The judge is asked, as a user turn of the chat template, to rate the
        response on 1..scale and to reply with one digit; the rating is the
        mean of 1..scale under its next-token probabilities restricted to
        those digits (no sampling, so the same pairs always score the same).
        """
        if not 2 <= scale <= 9:
            raise ValueError(f"scale must be within 2..9 (one digit), got {scale}")
        digits = []
        for k in range(1, scale + 1):
            ids = self.tokenizer.encode(str(k), add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"the digit {k} is not one token in {self.path}'s vocabulary")
            digits.append(ids[0])
        questions = [f"Rate how {criterion} the answer to the question is, on a scale of 1 to {scale}.\n\n"
                     f"Question: {p}\n\nAnswer: {r}\n\nReply with a single digit from 1 to {scale}."
                     for p, r in pairs]
        if not questions:
            return []
        input_ids, mask = self._encode(questions, self._wants_chat(None))
        if isinstance(self.model, Decoder):
            logits = self.model.logits(self.model.hidden_states(input_ids, mask)[:, -1])
        else:  # a transformers model (one hybridflow's decoder does not build)
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        logits = logits[:, digits].float()
        values = torch.arange(1, scale + 1, dtype=torch.float32, device=logits.device)
        return (logits.softmax(-1) * values).sum(-1).cpu().tolist()

    def __repr__(self) -> str:
        return f"CausalLM({str(self.path)!r}, device={self.device}, engine={self.engine!r})"


HFModel = Union[CausalLM, RewardModel]


def _load_causal_lm(path: Path, device: torch.device, dtype: Optional[torch.dtype],
                    engine: str) -> CausalLM:
    """On hybridflow's decoder; a model it does not build (GPT-2, ...) on `transformers`' own class, which
    generates with `hf_generate.HFGenerator` (the built-in engine only: vLLM is refused for it)."""
    from hybridflow.data.tokenizer import Tokenizer
    from hybridflow.models.checkpoint import load_decoder
    from hybridflow.models.config import DecoderConfig

    if DecoderConfig.from_pretrained(path, any_architecture=True).native:
        model = load_decoder(path, dtype).to(device).eval()
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto").to(device).eval()
        if engine != "builtin":
            raise ValueError(f"engine={engine!r}: {type(model).__name__} at {path} generates on its own code, "
                             f"with the built-in engine only")
    return CausalLM(model, Tokenizer.from_path(path), path, device, engine)


def load_hf_model(path: Union[str, Path], device_map: Optional[str] = None,
                  dtype: Union[str, torch.dtype, None] = None, engine: str = "builtin") -> HFModel:
    """The local HF checkpoint at `path`, wrapped by what its config.json names.

    `*ForCausalLM` -> `CausalLM` (generation; `engine` "builtin" or "vllm"),
    `*ForSequenceClassification` -> `RewardModel` (scoring; `engine` ignored).
    `device_map`: None or "cpu" -> CPU; "auto" -> the first CUDA device if
    any, else CPU; or a device name. `dtype`: None keeps the stored dtype.
    """
    path = Path(path)
    config = read_config(path)
    device, torch_dtype = resolve_device(device_map), resolve_dtype(dtype)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    architectures = config.get("architectures") or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):  # GPT-2's is GPT2LMHeadModel
        return _load_causal_lm(path, device, torch_dtype, engine)
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return load_classifier(path, device, torch_dtype)
    raise ValueError(f"{path / 'config.json'}: architectures {architectures} name neither a "
                     f"*ForCausalLM (generation) nor a *ForSequenceClassification (reward model)")
