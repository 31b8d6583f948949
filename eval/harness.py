"""The run loop behind ``stare eval``: sample, score and stream every problem of a bench, resumable.

One problem at a time: its k samples are generated in one call (seeded from ``seed``, the problem's position
and k, ``stare.eval.protocols.problem_seed``, so a redone problem gives the same samples), scored with math-verify
(``stare.eval.scoring``), and appended to ``samples.jsonl`` before the next problem starts; several engines
(``stare.eval.engines``) draw several at once, with the same seeds, each appended as it completes. ``--resume``
keeps every problem whose k samples are all on disk (``stare.eval.record``), drops a partly written one, and
continues: an interrupted run (even kill -9) loses at most the problems in flight and ends with the same numbers.

A backend (``stare.eval.backends``) that raises ``PromptTooLong`` for a problem has it recorded as not attempted
(its samples score 0) and the run goes on; a model whose context fits no problem is refused before anything is
written. The summary (``summary.json``, ``summary.md``) is ``stare.eval.summary.summarise``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .backends import PromptTooLong
from .data import Problem
from .extraction import extract_boxed
from .protocols import Protocol, problem_seed
from .record import EvalRefused, RECORD, check_resume, eval_record, read_done
from .scoring import score_many, warn_if_all_empty
from .summary import summarise

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



def stderr_warning(message: str) -> None:
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
    warn = warn or stderr_warning
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
