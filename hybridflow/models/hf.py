"""Local Hugging Face checkpoints as DataFlow node models: `load_hf_model(path)`.

    actor = load_hf_model("path/to/actor", device_map="auto")       # *ForCausalLM
    actor.generate(["042+917="])               # -> [("042+917=", "0959")]
    rm = load_hf_model("path/to/reward-model")                        # *ForSequenceClassification
    rm("042+917=", "0959").item(); rm.score(pairs); rm.check(prompt, response)

The architecture named in `config.json` picks the wrapper. A causal LM runs on
hybridflow's own plain `Decoder` and built-in KV-cache `Generator` (the
Llama/Qwen2/Mistral families); a sequence classifier (reward model or guard)
runs on `transformers`, which is imported only when one is loaded.

Simplified on purpose: `device_map="auto"` puts the whole model on one device
(the first CUDA device when there is one, else the CPU). Splitting a large
model across the devices a node is given is the controller's job (placement),
not this loader's. `engine="vllm"` uses vLLM's offline `LLM` when the package
imports and otherwise warns and falls back to the built-in engine.
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

__all__ = ["CausalLM", "HFModel", "RewardModel", "load_hf_model", "prompt_ids", "resolve_device"]

logger = logging.getLogger("hybridflow.models.hf")

ENGINES = ("builtin", "vllm")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VLLM_MISSING = ("engine='vllm' requested but vLLM is not installed "
                 "(pip install 'hybridflow[vllm]'); falling back to the built-in engine")


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


def _as_chat(tokenizer: Any, prompts: Sequence[str]) -> list[str]:
    """Each prompt as one user turn of the chat template, generation prompt appended."""
    return [tokenizer.render_prompt([{"role": "user", "content": p}]) for p in prompts]


def prompt_ids(tokenizer: Any, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt as `CausalLM.generate` feeds it to the model (so a caller can check the
    lengths before loading weights). With `chat`, one user turn of the chat template, whose text already
    holds its special tokens; else the text with the tokenizer's BOS/EOS rule."""
    if chat:
        return tokenizer.encode_batch(_as_chat(tokenizer, prompts), add_special_tokens=False)
    return tokenizer.encode_batch(list(prompts))


def _resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


class CausalLM:
    """A causal LM that turns prompts into (prompt, response) pairs.

    Runs on the built-in engine (plain `Decoder` + `Generator`), or on vLLM
    when `use_engine("vllm")` finds it installed.
    """

    def __init__(self, decoder: Any, tokenizer: Any, path: Path, device: torch.device,
                 engine: str = "builtin"):
        from hybridflow.rollout import Generator

        self.model = decoder
        self.tokenizer = tokenizer
        self.path = path
        self.device = device
        pad = tokenizer.pad_token_id
        if pad is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an EOS token")
        self.generator = Generator(decoder, pad_token_id=pad, tokenizer=tokenizer)
        self.engine = "builtin"
        self._vllm: Any = None
        self.use_engine(engine)

    def use_engine(self, engine: str) -> "CausalLM":
        """Switch to "builtin" or "vllm"; vLLM missing -> a warning and the built-in engine."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if engine == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                logger.warning(_VLLM_MISSING)
                warnings.warn(_VLLM_MISSING, RuntimeWarning, stacklevel=2)
                engine = "builtin"
        self.engine = engine
        return self

    def _wants_chat(self, chat: Optional[bool]) -> bool:
        if chat is None:
            return self.tokenizer.has_chat_template
        if chat and not self.tokenizer.has_chat_template:
            raise ValueError(f"chat=True but the tokenizer at {self.path} has no chat template")
        return chat

    def _encode(self, prompts: Sequence[str], chat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input_ids and attention_mask [B, T] on the model's device (`prompt_ids`)."""
        ids = prompt_ids(self.tokenizer, prompts, chat)
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), self.generator.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            if row:
                input_ids[i, width - len(row):] = torch.tensor(row)
                mask[i, width - len(row):] = 1
        return input_ids.to(self.device), mask.to(self.device)

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
        if self.engine == "vllm":
            texts = _as_chat(self.tokenizer, prompts) if chat else prompts
            pairs = self._generate_vllm(texts, max_new_tokens, temperature, n, seed, **sampling)
            return [(prompts[i // n], response) for i, (_, response) in enumerate(pairs)]
        params = self.sampling_params(max_new_tokens, temperature, n, **sampling)
        input_ids, mask = self._encode(prompts, chat)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        texts = self.complete(input_ids, mask, params, rng)
        return [(prompts[i // n], text) for i, text in enumerate(texts)]

    def sampling_params(self, max_new_tokens: int, temperature: float = 0.0, n: int = 1, **sampling: Any):
        """`SamplingParams` with this model's defaults: EOS stops, greedy when temperature is 0."""
        from hybridflow.rollout import SamplingParams

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
        out = self.generator.generate(input_ids, attention_mask, params, generator=generator)
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
        logits = self.model.logits(self.model.hidden_states(input_ids, mask)[:, -1])[:, digits].float()
        values = torch.arange(1, scale + 1, dtype=torch.float32, device=logits.device)
        return (logits.softmax(-1) * values).sum(-1).cpu().tolist()

    def _generate_vllm(self, prompts: list[str], max_new_tokens: int, temperature: float,
                       n: int, seed: int, **sampling: Any) -> list[tuple[str, str]]:
        # Not exercised by the test suite (vLLM is an optional GPU extra).
        import vllm

        if self._vllm is None:
            self._vllm = vllm.LLM(model=str(self.path), seed=seed)
        params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=temperature, n=n,
                                     seed=seed, **sampling)
        outs = self._vllm.generate(prompts, params)
        return [(prompt, c.text) for prompt, o in zip(prompts, outs) for c in o.outputs]

    def __repr__(self) -> str:
        return f"CausalLM({str(self.path)!r}, device={self.device}, engine={self.engine!r})"


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
        # A rendered chat template already holds its special tokens.
        enc = self.tokenizer(texts, padding=True, return_tensors="pt",
                             add_special_tokens=not self.chat).to(self.device)
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


HFModel = Union[CausalLM, RewardModel]


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
    with open(config_file) as f:
        return json.load(f)


def _load_causal_lm(path: Path, device: torch.device, dtype: Optional[torch.dtype],
                    engine: str) -> CausalLM:
    from hybridflow.data.tokenizer import Tokenizer
    from hybridflow.models.checkpoint import load_decoder

    decoder = load_decoder(path, dtype).to(device).eval()
    return CausalLM(decoder, Tokenizer.from_path(path), path, device, engine)


def _load_classifier(path: Path, device: torch.device, dtype: Optional[torch.dtype]) -> RewardModel:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"{path} is a sequence classifier, which runs on transformers: "
                          f"pip install transformers") from exc
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return RewardModel(model.to(device).eval(), tokenizer, path, device)


def load_hf_model(path: Union[str, Path], device_map: Optional[str] = None,
                  dtype: Union[str, torch.dtype, None] = None, engine: str = "builtin") -> HFModel:
    """The local HF checkpoint at `path`, wrapped by what its config.json names.

    `*ForCausalLM` -> `CausalLM` (generation; `engine` "builtin" or "vllm"),
    `*ForSequenceClassification` -> `RewardModel` (scoring; `engine` ignored).
    `device_map`: None or "cpu" -> CPU; "auto" -> the first CUDA device if
    any, else CPU; or a device name. `dtype`: None keeps the stored dtype.
    """
    path = Path(path)
    config = _read_config(path)
    device, torch_dtype = resolve_device(device_map), _resolve_dtype(dtype)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    architectures = config.get("architectures") or []
    if any(a.endswith("ForCausalLM") for a in architectures):
        return _load_causal_lm(path, device, torch_dtype, engine)
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return _load_classifier(path, device, torch_dtype)
    raise ValueError(f"{path / 'config.json'}: architectures {architectures} name neither a "
                     f"*ForCausalLM (generation) nor a *ForSequenceClassification (reward model)")
