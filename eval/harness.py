"""The run loop behind ``stare eval``: sample, score and stream every problem of a bench, resumable.

Every problem's k samples are drawn from its own seeds (``stare.eval.protocols.problem_seed``: ``seed``, its position
and k), so a redone problem draws from the same seeds. How problems reach the engine is ``--batching``
(``stare.eval.batching``): ``all`` hands every problem not yet done to the backend at once (``generate_many``, or an
``EnginePool`` of several engines, ``stare.eval.engines``) and gets each back as its k samples complete; ``problem``
asks for one problem at a time (``generate``). A scoring thread scores each finished problem with math-verify
(``stare.eval.scoring``) and appends it to ``samples.jsonl`` (fsync) while the engine goes on generating, so a kill
(even kill -9) loses only what was in flight. When every problem is done the file is rewritten in the bench's
problem order, so a finished run's ``samples.jsonl`` does not depend on the order problems completed in.
``--resume`` keeps every problem whose k samples are all on disk (``stare.eval.record``), drops a partly written
one, and continues.

A backend (``stare.eval.backends``) that raises ``PromptTooLong`` for a problem has it recorded as not attempted
(its samples score 0) and the run goes on; a model whose context fits no problem, and a k whose samples of one
problem cannot be held in memory (``check_capacity``, ``check_batch_memory``), are refused before anything is
written. The folder's record (``eval_settings.json``) and ``samples.jsonl`` are written with the first problem
done, so a start that fails earlier leaves nothing behind. The summary (``summary.json``, ``summary.md``) is
``stare.eval.summary.summarise``.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
from pathlib import Path

from .backends import PromptTooLong
from .batching import DEFAULT_BATCHING
from .data import Problem
from .extraction import extract_boxed
from .protocols import SEED_BLOCK, Protocol, problem_seed
from .record import EvalRefused, RECORD, check_resume, eval_record, holds_samples, read_done, write_record
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


SAMPLE_BYTES = 640  # the least memory one sample takes while its problem is scored and written (every backend): its
# (text, tokens, extras) tuple, its record and its JSON line; 695 B measured for an empty response (Python 3.11)
GIB = 2**30


def available_memory() -> int | None:
    """The memory this machine has available, in bytes (Linux's ``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_capacity(k: int, n_problems: int, available: int | None) -> None:
    """``EvalRefused`` (one line) for a k no run can do, before anything is loaded or written: more samples than
    one run's seeds (``problem_seed``: ``n_problems * k <= SEED_BLOCK``), or one problem's k samples, which are drawn,
    scored and written together, more than ``available`` bytes hold at ``SAMPLE_BYTES`` each (not checked where
    ``available`` is None)."""
    if n_problems * k > SEED_BLOCK:
        raise EvalRefused(f"--k {k}: {n_problems} problem(s) x {k} samples are more than one run's {SEED_BLOCK} "
                          f"sample seeds; use --k {SEED_BLOCK // max(n_problems, 1)} or less (nothing was written)")
    if available is not None and k * SAMPLE_BYTES > available:
        raise EvalRefused(f"--k {k}: a problem's {k} samples are drawn, scored and written together, which needs at "
                          f"least {k * SAMPLE_BYTES / GIB:.1f} GiB ({SAMPLE_BYTES} B a sample), and this machine "
                          f"has {available / GIB:.1f} GiB available; use --k {available // SAMPLE_BYTES} or less "
                          "(nothing was written)")


def check_batch_memory(problems: list[Problem], backend, proto: Protocol) -> None:
    """``EvalRefused`` (one line) when the backend cannot hold one problem's k samples in one generate call: the
    least it needs for the longest prompt (``backend.problem_bytes``) above what its device has available
    (``backend.available_bytes``). Backends without them (vLLM schedules a request's samples itself) are not
    checked."""
    need = getattr(backend, "problem_bytes", None)
    have = getattr(backend, "available_bytes", None)
    count = getattr(backend, "prompt_tokens", None)
    if need is None or have is None or count is None or not problems:
        return
    available = have()
    if available is None:
        return
    longest = max(count(backend.prompt_text(p.problem, proto.instruction)) for p in problems)
    one = need(longest, 1, proto)
    if proto.k * one > available:
        raise EvalRefused(f"--k {proto.k}: the {backend.name} backend generates a problem's {proto.k} samples as one "
                          f"batch, which needs at least {proto.k * one / GIB:.1f} GiB ({one} B a sample: its token "
                          f"ids and a step's scores), and {available / GIB:.1f} GiB is available on "
                          f"{getattr(backend, 'device', 'its device')}; use --k {available // one} or less (nothing "
                          "was written)")


def check_start(problems: list[Problem], backend, proto: Protocol, model: str = "the model") -> None:
    """Every refusal that needs the loaded backend, before anything is written: ``check_fits``,
    ``check_capacity``, ``check_batch_memory``. ``run_eval`` makes them; the CLI makes them first, before its
    progress bar appears."""
    check_fits(problems, backend, proto, model)
    check_capacity(proto.k, len(problems), available_memory())
    check_batch_memory(problems, backend, proto)


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


def sample_stream(backend, todo: list, proto: Protocol, seed: int, batching: str = DEFAULT_BATCHING):
    """Yield ``(index, samples)`` for every ``(index, problem)`` of ``todo``, in the order they complete:
    ``batching`` ``problem`` (or a backend without ``generate_many``) one problem at a time, else every problem in
    flight at once through the backend's ``generate_many``. The same seeds either way (``problem_seed``). A pool of
    engines deals the problems itself (``EnginePool.stream``); an engine in that pool runs this on its share."""
    if hasattr(backend, "stream"):
        return backend.stream(todo, proto, seed, batching)
    if batching == "problem" or not hasattr(backend, "generate_many"):
        return one_by_one(backend, todo, proto, seed)
    requests = ((i, backend.prompt_text(p.problem, proto.instruction), proto.k, problem_seed(seed, i, proto.k))
                for i, p in todo)
    return backend.generate_many(requests, proto)


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


class _ScoreWriter:
    """The thread that scores each finished problem and appends it to ``samples.jsonl`` (fsync), so scoring overlaps
    generation. ``put`` hands it a problem; ``close`` waits for what was handed over. An error in the thread
    (``ScoringError``, a full disk) stops it and is raised again by the next ``put`` or by ``close``. The file is
    opened for the first problem, after ``begin()`` (which writes the folder's record)."""

    _END = object()

    def __init__(self, path: Path, problems: list[Problem], proto: Protocol, results: dict, *, score_timeout: float,
                 warn, progress, begin, counted: dict | None = None):
        self.path, self.f, self.begin = path, None, begin
        self.counted = {} if counted is None else counted  # problem index -> samples the bar already counted
        self.problems, self.proto, self.results = problems, proto, results
        self.score_timeout, self.warn, self.progress = score_timeout, warn, progress
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="stare-eval-scoring", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is self._END or self.error is not None:
                if item is self._END:
                    return
                continue
            try:
                self._write(*item)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.error = exc

    def _write(self, i: int, generated) -> None:
        p = self.problems[i]
        if isinstance(generated, PromptTooLong):
            self.warn(f"problem {p.id}: {generated}, so it is not attempted (its {self.proto.k} samples score 0)")
            recs = not_attempted_records(p, self.proto.k, generated)
        else:
            recs = scored_records(p, generated, self.score_timeout)
        if self.f is None:
            self.begin()
            self.f = open(self.path, "a")
        self.f.write("".join(json.dumps(r) + "\n" for r in recs))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.results[p.id] = recs
        if self.progress:
            self.progress(self.proto.k - self.counted.get(i, 0))  # what the engine did not report as it went

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, i: int, generated) -> None:
        self._raise()
        self.queue.put((i, generated))

    def close(self) -> None:
        """Score and write everything handed over, then end the thread (also on the way out of an interruption:
        the problems already generated are kept)."""
        self.queue.put(self._END)
        self.thread.join()
        if self.f is not None:
            self.f.close()
        self._raise()


def write_in_order(samples_path: Path, problems: list[Problem], results: dict) -> None:
    """Rewrite ``samples.jsonl`` with every problem's samples in the bench's problem order (atomically)."""
    tmp = samples_path.with_name(samples_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for p in problems for r in results.get(p.id, [])))
    os.replace(tmp, samples_path)


def run_eval(problems: list[Problem], backend, proto: Protocol, out: Path, *, bench: str, model: str, seed: int,
             resume: bool, progress=None, score_timeout: float = 5.0, warn=None, data: str | None = None,
             tools: str | None = None, batching: str = DEFAULT_BATCHING) -> dict:
    """Sample, score and stream every problem (see the module docstring); ``warn(message)`` gets the one-line
    warnings (a protocol longer than the context, a problem not attempted; default: stderr). ``EvalRefused``
    before anything is written: ``resume`` with other settings than the folder's (``check_resume``), a model whose
    context fits no problem (``check_fits``), a k that cannot be held (``check_capacity``, ``check_batch_memory``).
    A folder that holds no sample (``holds_samples``) starts afresh, ``resume`` or not; its record and samples
    are written with the first problem done."""
    warn = warn or stderr_warning
    record = eval_record(proto, seed=seed, model=model, bench=bench, data=data, tools=tools, batching=batching)
    samples_path = out / "samples.jsonl"
    if resume:
        check_resume(out, record)
    check_start(problems, backend, proto, model)
    out.mkdir(parents=True, exist_ok=True)
    recorded = []

    def begin() -> None:
        if not recorded:
            write_record(out, record)
            recorded.append(True)

    if resume and holds_samples(out):
        begin()  # the same settings (check_resume); the record as this version writes it
        done = read_done(samples_path, proto.k, warn)
    else:  # a fresh start: what an earlier start left (a record, an empty or cut samples file) goes
        for stale in (out / RECORD, samples_path):
            stale.unlink(missing_ok=True)
        done = {}
    results: dict[str, list[dict]] = dict(done)
    check_context([p for p in problems if p.id not in results], backend, proto, warn)
    if progress:
        for p in problems:
            if p.id in results:
                progress(proto.k)
    todo = [(i, p) for i, p in enumerate(problems) if p.id not in results]
    counted: dict[int, int] = {}
    if progress and hasattr(backend, "on_samples"):  # the bar counts samples as the engine finishes them

        def finished(i: int, n: int) -> None:
            counted[i] = counted.get(i, 0) + n
            progress(n)

        backend.on_samples = finished
    writer = _ScoreWriter(samples_path, problems, proto, results, score_timeout=score_timeout, warn=warn,
                          progress=progress, begin=begin, counted=counted)
    stream = sample_stream(backend, todo, proto, seed, batching)
    try:
        for i, generated in stream:
            writer.put(i, generated)
    finally:
        if hasattr(stream, "close"):  # a generator stopped early aborts the requests still in its engine
            stream.close()
        writer.close()
        if hasattr(backend, "on_samples"):
            backend.on_samples = None
    begin()
    write_in_order(samples_path, problems, results)
    # of the samples generated: a problem not attempted (its prompt longer than the context) has no response to judge
    warn_if_all_empty([r["response"] for p in problems for r in results.get(p.id, []) if not r.get("not_attempted")])
    return summarise(problems, results, proto, bench=bench, model=model, backend=backend.name, seed=seed, out=out,
                     tools=getattr(backend, "tools_info", None), engines=getattr(backend, "engines", 1),
                     batching=batching)
