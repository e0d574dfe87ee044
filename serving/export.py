"""Write a checkpoint in the native format (the backbone's own class) that vLLM and other engines serve.

    python -m serving.export --output_dir outputs/refusion-smollm2-native            # the shipped model
    python -m serving.export --output_dir DIR-native --model DIR                     # a ReFusion-format checkpoint

A folder that is already native (its `config.json` names the backbone, not `refusion`) needs no export.
`scripts/serve.sh` calls this before starting the server; it runs in this package's environment, the server in
vLLM's.
"""

import argparse
import sys
from pathlib import Path

from transformers import AutoTokenizer

from finetune.convert import save_refusion
from finetune.files import check_output_dir, read_json
from modeling_refusion import RefusionForCausalLM


def model_type(folder: str | Path) -> str | None:
    """The `model_type` of a saved checkpoint, or None when the folder holds no `config.json`."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    value = read_json(config)  # a file that is not JSON raises, naming it
    if not isinstance(value, dict):
        raise ValueError(f"{config} is not a checkpoint's config (a JSON object).")
    return value.get("model_type")


def load_refusion(source: str | Path | None = None) -> tuple[RefusionForCausalLM, object]:
    """The shipped model (SmolLM2 with the recipe's adapter merged) when `source` is None, else the ReFusion
    checkpoint saved in `source`, with its tokenizer."""
    if source is None:
        from recipe.model import load_base, with_adapter  # needs peft; only the shipped model does

        base, tokenizer = load_base()
        return with_adapter(base, tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)  # its config names our class
    return RefusionForCausalLM.from_pretrained(source), tokenizer


def export_native(output_dir: str | Path, source: str | Path | None = None, overwrite_output_dir: bool = False) -> Path:
    """Save `source` (default: the shipped model) as a native checkpoint in `output_dir`, a missing or empty folder
    (or any, with `overwrite_output_dir`: files of the same names replaced, others kept), moved in when complete."""
    check_output_dir(output_dir, overwrite_output_dir)  # before loading the model
    model, tokenizer = load_refusion(source)
    return save_refusion(model, tokenizer, output_dir, format="native", overwrite_output_dir=overwrite_output_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where to write the native checkpoint.")
    parser.add_argument("--model", default=None, help="A ReFusion-format checkpoint (default: the shipped model).")
    parser.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="Write into --output_dir even when it holds files: those of the model's names are replaced, others kept.",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.model is not None and model_type(args.model) != "refusion":
            raise ValueError(f"{args.model!r} holds no ReFusion-format checkpoint to export.")
        output_dir = export_native(args.output_dir, args.model, args.overwrite_output_dir)
    except (OSError, ValueError) as error:
        print(f"serving.export: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    print(f"Exported {args.model or 'the shipped model'} in the native format -> {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
