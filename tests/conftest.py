"""Put the repository root on sys.path so tests can import the model modules and `finetune`."""

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Decodes with draft_schedule="price" keep measured forward prices in no file unless a test names one.
os.environ.setdefault("REFUSION_PRICE_CACHE", "")
