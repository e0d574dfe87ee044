"""Put the repository root on sys.path so tests can import the model modules and `finetune`."""

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Decodes with draft_schedule="price" keep measured forward prices in no file unless a test names one.
os.environ.setdefault("REFUSION_PRICE_CACHE", "")

# Parallel test workers (`pytest -n N`, as scripts/test.sh runs them) share the cores: each takes its share of torch's
# threads rather than one per core.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
