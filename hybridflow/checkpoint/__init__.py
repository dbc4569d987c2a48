"""hybridflow checkpoints, below every package that writes or reads them (the engine, the trainer, the reshard
tool; docs/design.md section 2):

- format.py: the format itself: shard file names, trainer.json (`trainer_state`, `read_trainer_state`), the
  model table (`model_table`), the checks a resume makes (`check_models`, `check_layouts`), CheckpointError
- base.py: the base model a LoRA actor's adapters were trained on (path and a content fingerprint), recorded in
  trainer.json and checked on resume (`check_base`: a ConfigError on model.path)
- manager.py: CheckpointManager (step directories that are complete or absent, manifests, the `latest`
  marker, keep_last pruning, full-disk refusals)

The atomic file and directory writes they use are `hybridflow.common`'s (a leaf, so HF saves below use them too).
"""
from hybridflow.checkpoint.format import (LATEST, MANIFEST, ROLES, TRAINER_STATE, VALUE_HEAD, CheckpointError,
                                          check_layouts, check_models, model_table, read_trainer_state, shard_file,
                                          step_dirname, trainer_state)
from hybridflow.checkpoint.manager import CheckpointManager

__all__ = ["LATEST", "MANIFEST", "ROLES", "TRAINER_STATE", "VALUE_HEAD", "CheckpointError", "CheckpointManager",
           "check_layouts", "check_models", "model_table", "read_trainer_state", "shard_file", "step_dirname",
           "trainer_state"]
