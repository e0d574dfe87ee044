"""Make the drafter folder of a native checkpoint: the same files, linked, with the drafter architecture.

python -m refusion_vllm.drafter MODEL_DIR     # prints the drafter folder (MODEL_DIR-drafter)
"""

import json
import sys
from pathlib import Path

from refusion_vllm import DRAFTER_ARCHITECTURE


def drafter_folder(model_dir: str | Path) -> Path:
    """`MODEL_DIR-drafter`: links to every file of `model_dir` but `config.json`, whose architecture is the
    drafter's; rewritten each call so that it follows the model."""
    model_dir = Path(model_dir).resolve()
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("mask_token_id") is None:
        raise ValueError(f"{model_dir}/config.json has no mask_token_id: not a ReFusion native export.")
    target = model_dir.with_name(model_dir.name + "-drafter")
    target.mkdir(exist_ok=True)
    for source in model_dir.iterdir():
        link = target / source.name
        if source.name != "config.json" and not link.exists():
            link.symlink_to(source)
    config["architectures"] = [DRAFTER_ARCHITECTURE]
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return target


if __name__ == "__main__":
    print(drafter_folder(sys.argv[1]))
