"""Typed configuration for hybridflow; this file imports nothing, so the leaf `config.schema` loads alone.

Import each name from the module that defines it:

- `config.schema`: the dataclasses (`Config`, `ActorConfig`, ...), a leaf every layer may import;
- `config.loader`: `load_config`, `from_dict`, `to_dict`, `apply_overrides`, `dump_config`;
- `config.plan`: `RunPlan` (what the config implies: layouts, worlds, placement), `devices_for`;
- `config.validate`: the checks of values (`validate`, `check_plan`, `check_model_split`);
- `config.preflight`: `check_runnable`, those checks and then the machine (paths, Ray, vLLM, CUDA);
- `config.inputs`: what the trainer reads, checked as it reads it (model config, tokenizer, reward function);
- `hybridflow.errors`: `ConfigError`.
"""
