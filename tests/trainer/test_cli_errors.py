"""Bad input to `hybridflow train` ends in one line naming the problem, never a traceback (a table:
one row per case, each a case that printed a traceback before its fix)."""
import json
import shutil
from pathlib import Path

import pytest

from hybridflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "hybridflow/assets/demo_model"


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


def _write(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


CASES = {  # name -> (overrides from a tmp dir, exit code, the line's text)
    "config.json not JSON": (lambda t: [f"model.path={_model(t, 'm', lambda d: (d / 'config.json').write_text('{no'))}"],
                             2, "model.path: {t}/m/config.json is not valid JSON"),
    "config.json without hidden_size": (lambda t: [f"model.path={_model(t, 'm', _config_json(hidden_size=None))}"],
                                        2, "model.path: {t}/m/config.json lacks the key 'hidden_size'"),
    "model_type gpt2": (lambda t: [f"model.path={_model(t, 'm', _config_json(model_type='gpt2'))}"],
                        2, "model.path: model_type 'gpt2' is not supported"),
    "tokenizer.json not JSON": (
        lambda t: [f"model.path={_model(t, 'm', lambda d: (d / 'tokenizer.json').write_text('{no'))}"],
        2, "model.tokenizer_path: {t}/m/tokenizer.json: not a valid tokenizer.json"),
    "jsonl not UTF-8": (lambda t: [f"data.train_files=[{_write(t, 'bad.jsonl', bytes([0xFF, 0xFE]) + b' x')}]"],
                        2, "{t}/bad.jsonl:1: not UTF-8 text (byte 0xff at column 1)"),
    "reward file with a syntax error": (lambda t: [f"reward.function={_write(t, 'r.py', b'def f(:')}:f"],
                                        2, "reward.function: '{t}/r.py:f': SyntaxError: invalid syntax"),
    "unknown reward name": (lambda t: ["reward.function=gsm9k"], 2, "reward.function: 'gsm9k': ValueError: "
                                                                    "unknown reward 'gsm9k'"),
    "malformed list override": (lambda t: ["data.train_files=[a,b"], 2,
                                "data.train_files: cannot read the value '[a,b'"),
    "output_dir is a file": (lambda t: [f"trainer.output_dir={_write(t, 'afile', b'x')}"], 2,
                             "trainer.output_dir: {t}/afile is a file, so {t}/afile/tiny-grpo cannot be created"),
    "reward failing inside a library call": (
        lambda t: [f"reward.function={_write(t, 'r3.py', b'import json' + chr(10).encode() + b'def f(*a):' + chr(10).encode() + b'    return json.loads(chr(123))')}:f"],
        1, "raised JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
           "(at {t}/r3.py:3)"),
    "lr NaN": (lambda t: ["actor.optim.lr=.nan"], 2, "actor.optim.lr: must be a finite number >= 0, got nan"),
    "lr negative": (lambda t: ["actor.optim.lr=-0.001"], 2, "actor.optim.lr: must be a finite number >= 0"),
    "log-prob micro-batch 0": (lambda t: ["rollout.log_prob_micro_batch_size=0"], 2,
                               "rollout.log_prob_micro_batch_size: must be >= 1, got 0"),
    "critic micro-batch negative": (lambda t: ["critic.ppo_micro_batch_size=-4"], 2,
                                    "critic.ppo_micro_batch_size: must be >= 1, got -4"),
    "responses beyond the model's positions": (
        lambda t: ["data.max_response_length=60"], 2,
        "data.max_response_length: data.max_prompt_length + data.max_response_length = 76 exceeds the model's "
        "max_position_embeddings (64)"),
    "reward raising mid-run": (
        lambda t: [f"reward.function={_write(t, 'r2.py', b'def f(*args):' + chr(10).encode() + b'    1 / 0')}:f"],
        1, "reward.function '{t}/r2.py:f' raised ZeroDivisionError: division by zero (at {t}/r2.py:2)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_line(case, tmp_path, capsys, monkeypatch):
    overrides, code, text = CASES[case]
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("HYBRIDFLOW_TRACEBACK", raising=False)
    argv = ["train", "configs/tiny-grpo.yaml", f"trainer.output_dir={tmp_path / 'out'}", "trainer.total_steps=1",
            "trainer.val_every=0", "trainer.save_every=0", "data.val_files=[]", *overrides(tmp_path)]
    assert main(argv) == code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hybridflow: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert text.format(t=tmp_path) in errors[0], errors[0]
