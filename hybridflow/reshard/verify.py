"""`--verify` and `--verify-logits`: read the output back and compare it with the source.

Both sides are opened as sources (`formats.open_source`), so the comparison
runs through the same readers a later conversion would: every HF tensor of
DST equals SRC's bit for bit (after the `--dtype` cast, if one was asked),
read one pair at a time. `--verify-logits` then builds the plain decoder from
each side (the whole model, twice, in memory: the one step that does not
stream) and compares their logits on a fixed batch of token ids.
"""
from __future__ import annotations

import torch

from hybridflow.models.bridge import get_bridge
from hybridflow.models.decoder import Decoder, rope_inv_freq
from hybridflow.reshard.base import Source, hf_names
from hybridflow.reshard.formats import open_source

BATCH_SEED, BATCH_SHAPE = 0, (2, 16)


class VerifyError(ValueError):
    """DST does not hold what SRC holds."""


def compare_tensors(src_reader, dst_reader, names: list[str], dtype: torch.dtype) -> int:
    """VerifyError at the first tensor that differs; else the number compared."""
    for name in names:
        want, got = src_reader(name).to(dtype), dst_reader(name)
        if want.shape != got.shape or want.dtype != got.dtype or not torch.equal(want, got):
            diff = (want.float() - got.float()).abs().max().item() if want.shape == got.shape else "shape"
            raise VerifyError(f"--verify: {name} differs between SRC and DST ({list(want.shape)} {want.dtype} vs "
                              f"{list(got.shape)} {got.dtype}; max |diff| {diff})")
    return len(names)


def decoder_of(source: Source, reader, dtype: torch.dtype) -> Decoder:
    """The plain decoder holding a source's weights (read whole)."""
    cfg = source.cfg
    sd = get_bridge(cfg).hf_to_generation({n: reader(n).to(dtype) for n in reader.keys()
                                           if n != "lm_head.weight" or not cfg.tie_word_embeddings})
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    return model.eval()


@torch.no_grad()
def logits_of(source: Source, reader, dtype: torch.dtype) -> torch.Tensor:
    """Logits [2, 16, vocab] on fixed token ids (seeded), so SRC and DST see the same batch."""
    ids = torch.randint(0, source.cfg.vocab_size, BATCH_SHAPE, generator=torch.Generator().manual_seed(BATCH_SEED))
    return decoder_of(source, reader, dtype)(ids).float()


def verify(source: Source, req, plan) -> str:
    """Compare DST with SRC; the summary's words on success, VerifyError otherwise."""
    out = open_source(req.dst, source.role, req.config)
    with source.open() as src_reader, out.open() as dst_reader:
        # A critic made from an LM has a value head SRC lacks (zeros, as the engine starts one).
        names = [n for n in hf_names(source.cfg, source.value_head) if n in src_reader.keys()]
        count = compare_tensors(src_reader, dst_reader, names, plan.dtype)
        text = f"verified: {count} tensors equal SRC bit for bit"
        if req.verify_logits:
            a, b = logits_of(source, src_reader, plan.dtype), logits_of(out, dst_reader, plan.dtype)
            worst = (a - b).abs().max().item()
            if worst != 0.0:
                raise VerifyError(f"--verify-logits: the logits of DST differ from SRC's by up to {worst:.3g}")
            text += f", logits on a fixed {BATCH_SHAPE[0]}x{BATCH_SHAPE[1]} batch equal (max |diff| 0)"
    return text
