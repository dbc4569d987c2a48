"""What the trainer reads at build time, each checked as it is read: a `ConfigError` naming the key.

The model's config.json (and its weights' headers), the tokenizer, the
number of usable prompts, the reward function. The trainer is their one
caller; they sit in config/ because each failure is a config error, and the
config package is where those are raised (docs/architecture.md, "Where a
change goes"). The workers read the same files again without checking: by
then the trainer has read them here.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from hybridflow.config.schema import DataConfig, ModelConfig, RewardConfig
from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.data.tokenizer import Tokenizer
    from hybridflow.models.config import DecoderConfig


def load_model_config(path: Optional[str], key: str, needs_decoder: Optional[str] = "") -> "DecoderConfig":
    """The HF config at `path`, its weights' headers checked against it; a ConfigError naming `key` otherwise.

    needs_decoder: the setting of the run that needs hybridflow's own model code for this model (e.g.
    "actor.engine=megatron"; `validate.needs_decoder`), named in the refusal of a model the decoder does not
    build; "" (a caller that does not say) refuses it as the decoder does; None (every role loading it runs
    under `transformers`) describes it instead (`DecoderConfig.foreign`)."""
    from hybridflow.models.checkpoint import check_hf_checkpoint
    from hybridflow.models.config import DecoderConfig, ModelConfigError, UnsupportedArchitecture

    if not path:
        raise ConfigError(key, "no model path given")
    if not Path(path).exists():
        raise ConfigError(key, f"model path does not exist: {path}")
    if not Path(path).is_dir():
        raise ConfigError(key, f"{path} is a file; give the model's directory (config.json and safetensors)")
    try:
        cfg = DecoderConfig.from_pretrained(path, any_architecture=needs_decoder is None)
        check_hf_checkpoint(path, cfg)  # the weights' headers: before any worker starts loading them
    except UnsupportedArchitecture as exc:
        raise ConfigError(key, f"{exc}: hybridflow's decoder and megatron-core do not build this model; it "
                               f"runs under transformers, with every role loading it on engine fsdp and "
                               f"fsdp.modeling transformers (an actor's model: with the built-in rollout "
                               f"engine); this run has {needs_decoder}" if needs_decoder else str(exc)) from None
    except (FileNotFoundError, ModelConfigError) as exc:
        raise ConfigError(key, str(exc)) from None
    return cfg


def load_tokenizer(model: ModelConfig, model_cfg: "DecoderConfig") -> "Tokenizer":
    """The run's tokenizer (model.tokenizer_path, else model.path); it must fit the model's vocabulary."""
    from hybridflow.data.tokenizer import Tokenizer

    path = model.tokenizer_path or model.path
    if not Path(path).exists():
        raise ConfigError("model.tokenizer_path", f"tokenizer path does not exist: {path}")
    try:
        tok = Tokenizer.from_path(path)
    except ValueError as exc:  # a malformed tokenizer.json or tokenizer_config.json
        raise ConfigError("model.tokenizer_path", str(exc)) from None
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError("model.tokenizer_path", f"tokenizer at {path} has {tok.vocab_size} tokens but "
                          f"the model at {model.path} has vocab_size {model_cfg.vocab_size}")
    return tok


def check_prompt_count(data: DataConfig, usable: int) -> None:
    """A training batch fits in the `usable` training prompts the dataset holds (known once it is read)."""
    from hybridflow.data.dataset import batches_per_epoch

    if batches_per_epoch(usable, data.train_batch_size) == 0:
        raise ConfigError("data.train_batch_size", f"{data.train_batch_size} is larger than the "
                          f"{usable} usable training prompts")


def load_reward_function(reward: RewardConfig, datasets: Iterable[Any]) -> Callable:
    """The rule-based reward function `reward.function` names; 'default' must know every data_source of
    `datasets` (the PromptDatasets the run reads)."""
    from hybridflow.rewards.registry import DATA_SOURCE_REWARDS, default_reward, get_reward_fn

    try:  # a "file.py:fn" spec imports user code, which may fail in any way
        fn = get_reward_fn(reward.function)
    except Exception as exc:
        raise ConfigError("reward.function", f"{reward.function!r}: {type(exc).__name__}: {exc}") from None
    if fn is default_reward and reward.kind == "function":  # it picks a verifier per row: each data_source needs one
        for dataset in datasets:
            unknown = sorted({r.data_source for r in dataset.records} - set(DATA_SOURCE_REWARDS))
            if unknown:
                raise ConfigError("reward.function", f"'default' has no reward for data_source {unknown[0]!r} "
                                  f"(in {', '.join(map(str, dataset.files))}); it knows "
                                  f"{sorted(DATA_SOURCE_REWARDS)}: set reward.function to a name or "
                                  "'file.py:function'")
    return fn
