"""Narrow forwards' prices from saved packages, with the code of the checkout it runs from (issue 61's key-window
A/B): `cd CHECKOUT && PYTHONPATH=CHECKOUT python price_ab.py FOLDER` (FOLDER: that code's saved packages)."""

import json
import sys
import time

import torch

import compiling_refusion
import executor_refusion
import prices_refusion
from recipe.decoding import compile_mode, compiled_refusion
from recipe.model import decoding_dtype, load_base, prepare_for_decoding, with_adapter

folder = sys.argv[1]
base, tokenizer = load_base()
model, _ = with_adapter(base.eval(), tokenizer)
model = model.to(decoding_dtype(None))
prepare_for_decoding(model)
config = compiled_refusion("cpu", compile_mode("cpu"), True, folder)["compile_config"]
cache = executor_refusion.slot_cache(model, 1, 256, keep=False)
compiled = compiling_refusion.compiled_backbone(model, config, folder)
buckets = executor_refusion.width_buckets("price")
rows = []
for _ in range(3):
    with torch.no_grad():
        prices = prices_refusion.measure_forward_prices(
            model, cache, compiled, widths=(1, 2, 4, 8), repeats=8, buckets=buckets, seconds=30.0
        )
    rows.append({width: round(1000 * seconds, 2) for width, seconds in prices.items()})
    print(time.strftime("%H:%M:%S"), rows[-1], flush=True)
print("RESULT", json.dumps(rows))
