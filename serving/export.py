"""Write a checkpoint in the native format (the backbone's own class) that vLLM and other engines serve.

    python -m serving.export --output_dir outputs/refusion-smollm2-native            # the shipped model
    python -m serving.export --output_dir DIR-native --model DIR                     # a ReFusion-format checkpoint

A folder that is already native (its `config.json` names the backbone, not `refusion`) needs no export.
`scripts/serve.sh` calls this before starting the server; it runs in this package's environment, the server in
vLLM's.
"""

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from finetune.convert import save_refusion
from modeling_refusion import RefusionForCausalLM


def model_type(folder: str | Path) -> str | None:
    """The `model_type` of a saved checkpoint, or None when the folder holds no `config.json`."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8")).get("model_type")


def load_refusion(source: str | Path | None = None) -> tuple[RefusionForCausalLM, object]:
    """The shipped model (SmolLM2 with the recipe's adapter merged) when `source` is None, else the ReFusion
    checkpoint saved in `source`, with its tokenizer."""
    if source is None:
        from recipe.model import load_base, with_adapter  # needs peft; only the shipped model does

        base, tokenizer = load_base()
        return with_adapter(base, tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)  # its config names our class
    return RefusionForCausalLM.from_pretrained(source), tokenizer


def export_native(output_dir: str | Path, source: str | Path | None = None) -> Path:
    """Save `source` (default: the shipped model) as a native checkpoint in `output_dir`, written atomically."""
    model, tokenizer = load_refusion(source)
    return save_refusion(model, tokenizer, output_dir, format="native")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where to write the native checkpoint.")
    parser.add_argument("--model", default=None, help="A ReFusion-format checkpoint (default: the shipped model).")
    args = parser.parse_args(argv)
    if args.model is not None and model_type(args.model) != "refusion":
        print(f"serving.export: {args.model!r} holds no ReFusion-format checkpoint to export.", file=sys.stderr)
        return 1
    output_dir = export_native(args.output_dir, args.model)
    print(f"Exported {args.model or 'the shipped model'} in the native format -> {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
