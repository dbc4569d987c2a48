"""The plain decoder reproduces transformers' own logits for each family."""
import json

import pytest
import torch

from hybridflow.models import DecoderConfig, ModelConfigError, load_decoder, save_decoder
from hybridflow.models.decoder import position_ids_from_mask


def _batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding of different lengths in one batch
    mask[1, :1] = 0
    return ids, mask


def test_logits_match_transformers(hf_checkpoint):
    hf_model, path = hf_checkpoint
    ids, mask = _batch(hf_model.config.vocab_size)
    pos = position_ids_from_mask(mask)
    dec = load_decoder(path).eval()
    with torch.no_grad():
        ref = hf_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = dec(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    assert ref[real].abs().mean() > 0.1  # the comparison is not between near-zero logits


def test_sliding_window_changes_the_result():
    """Guards the Mistral case above: the window really is applied."""
    from tests.models.conftest import build_hf_model

    hf_model = build_hf_model("mistral-window")
    cfg = DecoderConfig.from_hf_dict(hf_model.config.to_dict())
    assert cfg.layer_windows == [5, 5]
    ids, mask = _batch(hf_model.config.vocab_size)
    with torch.no_grad():
        windowed = hf_model(input_ids=ids).logits
        hf_model.config.sliding_window = None
        for layer in hf_model.model.layers:
            layer.self_attn.sliding_window = None
        full = hf_model(input_ids=ids).logits
    assert not torch.allclose(windowed[:, 6:], full[:, 6:], atol=1e-4)


def test_bfloat16_load_matches_transformers_bf16(tmp_path):
    from tests.models.conftest import build_hf_model

    hf_model = build_hf_model("llama-gqa")
    hf_model.save_pretrained(tmp_path)
    ids, mask = _batch(hf_model.config.vocab_size)
    dec = load_decoder(tmp_path, dtype="bfloat16").eval()
    assert dec.embed.weight.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf_model.to(torch.bfloat16)(input_ids=ids).logits.float()
        out = dec(ids).float()
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)


def test_save_decoder_loads_in_transformers(hf_checkpoint, tmp_path):
    import transformers

    hf_model, path = hf_checkpoint
    dec = load_decoder(path).eval()
    out_dir = save_decoder(dec, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    ids, _ = _batch(hf_model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits)


@pytest.mark.parametrize("patch, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "only SwiGLU"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
])
def test_unsupported_configs_are_rejected(patch, message):
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(ModelConfigError, match=message):
        DecoderConfig.from_hf_dict({**hf, **patch})


def test_missing_checkpoint_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_decoder(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_decoder(tmp_path / "m")
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_decoder(tmp_path / "m")


def test_decoder_has_no_distributed_imports():
    """rule 1, docs/conventions.md: parallelism is applied to plain models from outside."""
    import pathlib
    import re

    import hybridflow.models as models

    uses = re.compile(r"^\s*(import|from)\s+torch\.distributed|\bdist\.", re.M)
    files = list(pathlib.Path(models.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    for file in files:
        assert not uses.search(file.read_text()), file
