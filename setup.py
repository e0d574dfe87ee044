"""ReFusion for the Hugging Face ecosystem: the Hub model files plus the `finetune` package."""

from pathlib import Path

from setuptools import find_packages, setup

TRL, PEFT, DATASETS = "trl>=1.16,<2", "peft>=0.21,<1", "datasets>=4"
TRAIN = [TRL, PEFT, DATASETS, "accelerate>=1.10", "bitsandbytes>=0.49"]
GGUF = ["gguf>=0.17", "accelerate>=1.10"]
EVAL = ["lm-eval>=0.4.10,<0.5"]
DEMO = [*GGUF, PEFT]  # the built-in default model with the recipe's LoRA adapter
# Every benchmark's imports: the shipped model (DEMO), the plots, and TRL's trainer for benchmarks.train_step.
BENCH = [*DEMO, "matplotlib>=3.7", TRL, DATASETS]
TEST = ["pytest>=8", "pytest-xdist>=3.6", "ruff>=0.15", *TRAIN, *GGUF, *EVAL, *BENCH]

setup(
    name="refusion",
    version="0.1.0",
    description="ReFusion: parallel autoregressive slot decoding for any Llama/Qwen/Mistral checkpoint",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    py_modules=[path.stem for path in Path(__file__).parent.glob("*_refusion.py")],  # the Hub files
    packages=find_packages(include=["finetune", "finetune.*", "refusion_eval", "recipe"]),
    # The default model's recipe configs, adapter, distilled data and training history, so that an installed
    # (not only editable) package runs the demo.
    package_data={"recipe": ["*.yaml", "artifacts/*/*.*", "artifacts/*/adapter/*"]},
    # The versions CI tests: saved packages, compiled graphs and the cache API are specific to them.
    install_requires=["torch>=2.13,<2.14", "transformers>=5.25,<5.26", "safetensors>=0.4"],
    extras_require={"train": TRAIN, "gguf": GGUF, "eval": EVAL, "demo": DEMO, "bench": BENCH, "test": TEST},
    entry_points={
        "console_scripts": [
            "refusion-convert=finetune.convert:main",
            "refusion-sft=finetune.sft:main",
            "refusion-lm-eval=refusion_eval.__main__:main",
        ]
    },
)
