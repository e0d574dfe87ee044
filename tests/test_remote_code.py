"""Loading a converted folder as a Hub user: only torch + transformers, remote code, offline, any directory."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hub_user import run_as_hub_user
from tiny import tiny_backbone, tiny_tokenizer

from finetune.convert import convert_to_refusion, save_refusion

ROOT = Path(__file__).resolve().parents[1]
DECODING_FILES = (
    "generation_refusion.py",
    "settings_refusion.py",
    "adapter_refusion.py",
    "decisions_refusion.py",
    "acceptance_refusion.py",
    "decoder_refusion.py",
    "executor_refusion.py",
    "compiling_refusion.py",
    "prices_refusion.py",
    "packages_refusion.py",
)
HUB_FILES = ("configuration_refusion.py", "modeling_refusion.py", "kernels_refusion.py", *DECODING_FILES)

HUB_USER = """
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

folder = {folder!r}
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
encoder = AutoModel.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
inputs = torch.load({inputs!r})
with torch.no_grad():
    logits = model(inputs).logits
extras = ("trl", "peft", "datasets", "gguf", "bitsandbytes", "finetune")
print(json.dumps({{
    "classes": [type(model).__module__ + "." + type(model).__name__, type(encoder).__name__],
    "mask_token": tokenizer.mask_token,
    "mask_token_id": model.config.mask_token_id,
    "max_difference": (logits - torch.load({expected!r})).abs().max().item(),
    "optional_imports": sorted(name for name in extras if name in sys.modules),
}}))
"""


def test_converted_folder_loads_with_only_torch_and_transformers(tmp_path):
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("qwen3", vocab_size=len(tokenizer)), tokenizer)
    folder = save_refusion(model, tokenizer, tmp_path / "hub-model")
    inputs = torch.randint(3, len(tokenizer) - 1, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save(model(inputs).logits, tmp_path / "expected.pt")
    torch.save(inputs, tmp_path / "inputs.pt")
    code = HUB_USER.format(
        folder=str(folder), inputs=str(tmp_path / "inputs.pt"), expected=str(tmp_path / "expected.pt")
    )
    report = run_as_hub_user(code, tmp_path)
    module, encoder = report["classes"]
    assert module.startswith("transformers_modules.") and module.endswith("modeling_refusion.RefusionForCausalLM")
    assert encoder == "RefusionForCausalLM"
    assert (report["mask_token"], report["mask_token_id"]) == ("<|mask|>", model.config.mask_token_id)
    assert report["max_difference"] <= 1e-6
    assert report["optional_imports"] == []


PACKING_HUB_USER = """
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True, dtype=torch.float32)
prompt = torch.tensor([[5, 6, 7, 8, 9]])
settings = dict(max_new_tokens=12, slot_size=4, slot_threshold=0.5, token_threshold=0.4, eos_token_id=[],
                pad_token_id=0)
plain = model.generate(prompt, **settings)
names = list(model.state_dict())
packed_layers = model.prepack_linears([torch.float32])  # from one row on, whatever this CPU's own plan says
packed = model.generate(prompt, **settings)
names_unchanged = list(model.state_dict()) == names
model.use_grouped_attention()  # eager attention over the shared key/value heads, registered by the remote code
grouped = model.generate(prompt, **settings)
print(json.dumps({{
    "files": sorted(name for name in os.listdir({folder!r}) if name.endswith(".py")),
    "linear_layers": sum(isinstance(module, torch.nn.Linear) for module in model.modules()),
    "packed_layers": packed_layers,
    "same_tokens": torch.equal(plain, packed),
    "names_unchanged": names_unchanged,
    "grouped_attention": model.config.get_text_config(decoder=True)._attn_implementation,
    "grouped_same_tokens": torch.equal(plain, grouped),
    "unpacked_layers": model.unpack_linears(),
}}))
"""


def test_a_hub_user_prepacks_the_linear_layers_groups_attention_and_decodes_the_same_tokens(tmp_path):
    from kernels_refusion import onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    folder = save_refusion(model, tokenizer, tmp_path / "hub-model")
    report = run_as_hub_user("import os\n" + PACKING_HUB_USER.format(folder=str(folder)), tmp_path)
    assert report["files"] == sorted(HUB_FILES)
    assert report["packed_layers"] == report["linear_layers"] == report["unpacked_layers"] > 0
    assert report["same_tokens"] and report["names_unchanged"]
    assert report["grouped_attention"] == "refusion_grouped" and report["grouped_same_tokens"]


def test_hub_files_import_only_torch_transformers_and_each_other():
    import ast

    allowed = {"torch", "transformers", "dataclasses", "math", "typing", "collections", "__future__", "time", "copy"}
    allowed |= {"shutil", "pathlib", "textwrap"}  # the standard library: custom_generate/, docstrings
    allowed |= {"hashlib", "json", "os", "platform"}  # and the forward price table's key and file
    allowed |= {"functools"}  # and the compiled step functions, made once (`compiled_steps`)
    allowed |= {"inspect"}  # and the saved forwards' key: the file of a registered attention function
    allowed |= {"array"}  # and host lists read into tensors through a buffer (`upload`)
    allowed |= {"re"}  # and the names of packages' partial files (`remove_stale_partials`)
    allowed |= {"contextlib", "threading"}  # and a kept static cache held by one decode at a time (`SlotCache.claimed`)
    for name in HUB_FILES:
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            project = {Path(file).stem for file in HUB_FILES}
            assert roots <= allowed | project, f"{name} imports {roots - allowed - project}"


def test_wheel_installs_the_hub_files_as_top_level_modules(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), ROOT],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("refusion-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "installed")
    assert set(HUB_FILES) <= names
    assert "finetune/convert.py" in names
    result = subprocess.run(
        [sys.executable, "-c", "import modeling_refusion, configuration_refusion; print(modeling_refusion.__file__)"],
        cwd=tmp_path / "installed",
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "installed") in result.stdout


SAVED_PACKAGES_LOADED = """
import sys
import torch
from tiny import tiny_backbone, tiny_tokenizer
from finetune.convert import convert_to_refusion

tokenizer = tiny_tokenizer()
model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
prompt = torch.tensor([[5, 6, 7, 8, 9]])
for cache in ("dynamic", "static"):
    model.generate(prompt, max_new_tokens=8, slot_size=4, eos_token_id=[], cache_implementation=cache)
print("packages_refusion" in sys.modules)
"""


def test_the_saved_package_machinery_is_imported_only_by_decodes_that_keep_packages():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run(
        [sys.executable, "-c", SAVED_PACKAGES_LOADED], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "False"
