"""Decode a native-format folder with ReFusion under transformers' tensor parallelism (`tp_plan="auto"`, CPU: gloo).

    torchrun --nproc_per_node 2 tests/tp_probe.py FOLDER OUTPUT.json

Every process loads its shard of the weights; rank 0 writes the answer tokens and how the weights were sharded.
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

folder, output = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(
    folder, distributed_config=DistributedConfig(tp_plan="auto"), trust_remote_code=True, dtype=torch.float32
)
prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
settings = dict(max_new_tokens=16, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3)
answer = model.generate(prompt, **settings)[0].tolist()
projection = model.model.layers[0].self_attn.q_proj.weight
local_rows = (projection.to_local() if hasattr(projection, "to_local") else projection).shape[0]
if dist.get_rank() == 0:
    report = {"answer": answer, "world_size": dist.get_world_size(), "local_q_rows": local_rows}
    with open(output, "w") as sink:
        json.dump(report, sink)
dist.destroy_process_group()
