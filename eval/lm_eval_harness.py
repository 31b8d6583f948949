"""``stare eval --harness lm-eval``: the shipped lm-eval tasks (``stare.eval.lm_eval_tasks``) through lm-eval's API.

The run writes a small task file of its own (``OUT/lm_eval_tasks/<task>.yaml``) that includes the shipped task
and sets what this run asks for: ``repeats`` = k, and the local data file when there is one
(``dataset_path: json`` or ``parquet`` with ``dataset_kwargs.data_files``). lm-eval then runs it with
``simple_evaluate(..., task_manager=TaskManager(include_path=that folder))`` and the protocol's temperature,
top_p and max tokens as ``gen_kwargs``. Outputs, in OUT: ``summary.json`` (the same core fields as the stare
harness's: bench, model, k, n_problems, avg_at_k, pass_at_k, maj_at_k, ci95, protocol, versions; plus
``harness: "lm-eval"``), ``summary.md``, ``samples.jsonl`` (problem_id, sample_idx, response, extracted, from
lm-eval's sample log), ``lm_eval_samples.jsonl`` (that log as lm-eval wrote it: doc, responses, per-problem
metrics) and ``lm_eval_results.json`` (lm-eval's own results and task configs).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import yaml

from .backends import package_version
from .backends import versions as harness_versions
from .extraction import extract_boxed
from .lm_eval_tasks import TASKS, TASKS_DIR
from .metrics import problem_metrics, sample_metrics, sample_values
from .protocols import Protocol
from .summary import core_summary, write_summary

LM_EVAL_MODELS = {"hf": "hf", "vllm": "vllm"}  # stare's --backend -> lm-eval's model type
FILTER = "all"  # the filter name in the shipped tasks (keeps all k samples)


class LmEvalError(ValueError):
    """Something the user can fix (unsupported bench, lm-eval missing, a bad data file)."""


def require_lm_eval() -> None:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise LmEvalError("--harness lm-eval needs lm-eval: pip install 'lm-eval==0.4.13' (or pip install -e '.[lm-eval]')")


def task_name(bench: str) -> str:
    if bench not in TASKS:
        raise LmEvalError(f"--harness lm-eval has tasks for {', '.join(TASKS)} only, not {bench!r}; "
                          "use --harness stare for the others")
    return TASKS[bench]


def write_task(bench: str, task_dir: Path, *, k: int, data_file: str | os.PathLike | None = None) -> str:
    """Write ``task_dir/<task>.yaml``: the shipped task with repeats = k and, when given, the local data file."""
    name = task_name(bench)
    cfg: dict = {"include": str(TASKS_DIR / f"{name}.yaml"), "task": name, "repeats": int(k)}
    if data_file is not None:
        path = Path(data_file).resolve()
        kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
        if path.suffix.lower() not in kinds:
            raise LmEvalError(f"{path}: unsupported data file type {path.suffix or '(none)'!r}; use .jsonl, .json or .parquet")
        cfg.update({"dataset_path": kinds[path.suffix.lower()], "dataset_kwargs": {"data_files": {"test": str(path)}},
                    "test_split": "test"})
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return name


def gen_kwargs(proto: Protocol, backend: str) -> dict:
    sampling = proto.temperature > 0
    out = {"do_sample": sampling, "temperature": proto.temperature, "top_p": proto.top_p if sampling else 1.0,
           "max_gen_toks": proto.max_tokens}
    if backend == "hf" and sampling:
        out["top_k"] = 0  # transformers would otherwise add its default top_k=50; vLLM has no such default
    return out


def make_lm(backend: str, model: str, *, k: int, tp: int, seed: int):
    """lm-eval's model object for ``backend`` (hf: CPU or one GPU, the k samples of a problem in one batch)."""
    from lm_eval.api.registry import get_model

    if backend not in LM_EVAL_MODELS:
        raise LmEvalError(f"unknown backend {backend!r}; valid backends: {', '.join(LM_EVAL_MODELS)}")
    if backend == "hf":
        import torch

        cuda = torch.cuda.is_available()
        return get_model("hf")(pretrained=model, device="cuda" if cuda else "cpu",
                               dtype="bfloat16" if cuda else "float32", batch_size=k)
    return get_model("vllm")(pretrained=model, tensor_parallel_size=tp, seed=seed, dtype="auto", batch_size="auto")


def _has_chat_template(lm) -> bool:
    return bool(getattr(getattr(lm, "tokenizer", None), "chat_template", None))


def run_lm_eval(bench: str, model: str, proto: Protocol, out: Path, *, backend: str = "hf", tp: int = 1,
                data_file: str | os.PathLike | None = None, limit: int | None = None, seed: int = 0,
                lm=None) -> dict:
    """Run the bench's lm-eval task; write and return the summary. ``lm``: an lm-eval model object to use."""
    require_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out = Path(out)
    task_dir = out / "lm_eval_tasks"
    name = write_task(bench, task_dir, k=proto.k, data_file=data_file)
    lm = lm if lm is not None else make_lm(backend, model, k=proto.k, tp=tp, seed=seed)
    chat = _has_chat_template(lm)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[name], task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        gen_kwargs=gen_kwargs(proto, backend), limit=limit, log_samples=True, apply_chat_template=chat,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        bootstrap_iters=0)
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    return summarise(results, samples, proto, bench=bench, model=model, backend=backend, seed=seed, out=out,
                     task=name, chat_template=chat, tokenizer=getattr(lm, "tokenizer", None), data_file=data_file)


def _num_tokens(tokenizer, text: str) -> int | None:
    if tokenizer is None:
        return None
    try:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001 - a tokenizer without this call: leave the count out
        return None


def summarise(results: dict, samples: list[dict], proto: Protocol, *, bench, model, backend, seed, out: Path, task,
              chat_template, tokenizer, data_file) -> dict:
    metrics = results["results"][task]
    per_problem = problem_metrics()
    values: dict[str, list[float]] = {m.key: [] for m in per_problem}  # lm-eval's per-problem values
    rows, responses, tokens = [], [], []
    for s in samples:
        doc = s["doc"]
        resps = s["filtered_resps"]
        resps = resps[0] if len(resps) == 1 and isinstance(resps[0], list) else resps
        if len(resps) != proto.k:
            raise RuntimeError(f"lm-eval returned {len(resps)} responses for problem {doc['id']!r}, expected {proto.k}")
        for m in per_problem:
            values[m.key].append(float(s[m.key]))
        for j, text in enumerate(resps):
            n_tok = _num_tokens(tokenizer, text)
            rows.append({"problem_id": doc["id"], "sample_idx": j, "response": text, "extracted": extract_boxed(text),
                         "num_tokens": n_tok})
            responses.append(text)
            tokens.append(n_tok)
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    versions = harness_versions()
    versions["lm-eval"] = results.get("lm_eval_version") or package_version("lm-eval")
    counted = None not in tokens and tokens
    summary = core_summary(bench=bench, model=model, backend=backend, seed=seed, proto=proto, values=values,
                           ids=[s["doc"]["id"] for s in samples], answers=[s["doc"]["answer"] for s in samples],
                           scores={m.key: metrics[f"{m.key},{FILTER}"] for m in per_problem})
    # re-tokenised from the response text, so a count can differ from the generated tokens by a token or two;
    # summary.json keeps the note right after the first of them (the response length)
    measured = list((sample_values(responses, tokens) if counted else dict.fromkeys(m.key for m in sample_metrics()))
                    .items())
    measured.insert(1, ("token_counts", "re-tokenised from the response text" if counted else None))
    summary.update({
        "harness": "lm-eval", "task": task,
        **dict(measured),
        "chat_template": chat_template,
        "data": str(Path(data_file).resolve()) if data_file is not None else "hub",
        "versions": versions,
    })
    write_summary(out, summary, title=f"{bench}: {model} (lm-eval task {task})",
                  setup=f"protocol {proto.name}: k {proto.k}, temperature {proto.temperature}, top_p {proto.top_p}, "
                        f"max tokens {proto.max_tokens}; lm-eval {versions['lm-eval']} with the {backend} model; "
                        f"seed {seed}; {len(samples)} problems")
    slim = {key: value for key, value in results.items() if key not in ("samples", "config")}
    (out / "lm_eval_results.json").write_text(json.dumps(slim, indent=2, default=str))
    (out / "lm_eval_samples.jsonl").write_text("".join(json.dumps(s, default=str) + "\n" for s in samples))
    return summary
