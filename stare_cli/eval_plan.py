"""What ``stare eval`` will evaluate, decided before any model is loaded, and the evaluation itself.

``plan_eval`` checks everything that can be checked first (the benchmark, the output folder, the backend, the
harness, benchmark, tools and ``--resume`` together, the protocol, the data, a folder's earlier samples, the model,
the tool sandbox's isolation) and returns an ``EvalPlan``; ``run_eval_plan`` loads the model and runs the chosen
harness (stare's, with the tool loop for ``--tools``, or lm-eval's). Both raise ``stare.cli.errors.CliError``
(one line naming the bad value, exit code 2); the checks below raise ``ValueError`` with that line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import errors, stopping
from .errors import CliError, looks_like_hub_id
from .folder_lock import check_free, hold
from .rundir import eval_dir, final_model

HARNESSES = ("stare", "lm-eval")


def model_folder_problem(model: str) -> str | None:
    """Why an existing ``--model`` path cannot be a model (a file, a folder without a readable config.json), or
    None. A path that does not exist is not judged here."""
    import json

    path = Path(model)
    if not path.exists():
        return None
    if not path.is_dir():
        return "is a file; expected a model folder (with config.json) or a hub id (owner/name)"
    config = path / "config.json"
    if not config.is_file():
        return "is a folder without config.json; expected a model folder (save_pretrained's) or a hub id (owner/name)"
    try:
        json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"has a config.json that is not valid JSON ({str(exc).splitlines()[0]}); expected a model folder"
    return None


def eval_target(model: str | None, out: Path | None, bench: str) -> tuple[str, Path]:
    """(model, output folder). Without ``model``, ``out`` must be a training run with a ``final/`` model: that model
    is evaluated and the outputs go to ``out/eval-<bench>`` (where ``stare compare`` finds them). Default output
    folder: ``evals/<bench>``."""
    out_dir = out or Path("evals") / bench
    if model is None:
        final = final_model(out) if out is not None else None
        if final is None:
            raise ValueError("--model is required (or give --out a training run folder that has final/)")
        return str(final), eval_dir(out, bench)
    if not Path(model).exists() and not looks_like_hub_id(model):
        raise ValueError(f"--model {model!r}: no such folder ({Path(model).absolute()}), and not a hub id "
                         "(name or owner/name); check the path")
    return model, out_dir


def check_model_folder(model: str) -> None:
    """``ValueError`` (one line) when ``--model`` names a path that is there but is not a model folder."""
    problem = model_folder_problem(model)
    if problem:
        raise ValueError(f"--model {model} {problem}")


def check_harness(harness: str, bench: str, *, resume: bool, tools: str | None) -> None:
    """The harness exists, can run ``bench``, and supports ``--resume`` and ``--tools`` when they are asked for."""
    if harness not in HARNESSES:
        raise ValueError(f"unknown harness {harness!r}; valid harnesses: {', '.join(HARNESSES)}")
    if tools is not None:
        from .agent.multiturn import TOOLS

        if tools not in TOOLS:
            raise ValueError(f"unknown tool {tools!r}; valid tools: {', '.join(TOOLS)}")
        if harness != "stare":
            raise ValueError("--tools works with --harness stare only")
    if harness == "lm-eval":
        from stare.eval.lm_eval_harness import require_lm_eval, task_name

        task_name(bench)
        require_lm_eval()
        if resume:
            raise ValueError("--resume works with --harness stare only; lm-eval runs a task from the start")


AUTO = "auto"  # --engines auto: as many engines as the GPUs hold (auto_layout)


def parse_engines(value) -> int | str:
    """``--engines``: a count >= 1, or ``auto``; ``ValueError`` (one line) otherwise."""
    if value == AUTO:
        return AUTO
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise ValueError(f"--engines {value}: expected a number of engines >= 1 (1: this process, no Ray) or auto "
                         "(as many as this machine's GPUs, or the --ray-address cluster's, hold at --tp)")
    return count


def check_engines(engines, ray_address: str | None, harness: str, *, require_ray: bool = True) -> None:
    """``--engines`` is a count >= 1 (or ``auto``) and ``--ray-address`` a non-empty address; both need the stare
    harness, and Ray when either asks for it (``require_ray``: checked here; ``auto`` needs Ray only where it finds
    several GPUs, which ``auto_layout`` decides when the run starts)."""
    engines = parse_engines(engines)
    if engines == AUTO:
        if harness != "stare":
            raise ValueError("--engines auto works with --harness stare only; lm-eval runs its own single model")
        engines = 1
    if ray_address is not None and not ray_address.strip():
        raise ValueError("--ray-address '': expected HOST:PORT, ray://HOST:PORT or auto (leave the flag out to start "
                         "a local Ray)")
    if engines == 1 and ray_address is None:
        return
    flag = f"--engines {engines}" if engines > 1 else f"--ray-address {ray_address}"
    if harness != "stare":
        raise ValueError(f"{flag} works with --harness stare only; lm-eval runs its own single model")
    if not require_ray:
        return
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise CliError(f"{flag} runs the engines as Ray actors, and Ray is not installed here "
                       "(pip install 'ray[default]==2.55.0')", code=1)


def build_engine(backend: str, model: str, tp: int, seed: int, tools: str | None = None, tool_config=None,
                 batching: str = "all"):
    """The backend ``stare eval`` samples with (wrapped for tool use with ``tools``); with several engines each Ray
    actor calls it in its own process."""
    from stare.eval.backends import make_backend

    engine = make_backend(backend, model, tp, seed, batching)
    if tools is not None:
        from .agent.multiturn import ToolUseBackend

        engine = ToolUseBackend(engine, tool_config, tools)
    return engine


@dataclass
class EvalPlan:
    bench: str
    model: str
    out: Path
    proto: object  # stare.eval.protocols.Protocol
    backend: str  # hf | vllm
    harness: str  # stare | lm-eval
    tp: int
    seed: int
    resume: bool
    limit: int | None
    local: str | None  # the local data file, None for the hub
    data: str  # what the eval record holds: the data file's full path, or "hub"
    problems: list | None  # the problems (None: lm-eval reads the hub itself)
    tools: str | None
    tool_config: object | None  # stare.cli.agent.loop.ToolConfig with --tools
    engines: int | str = 1  # --engines: Ray actors, each with its own backend (stare.eval.engines); or auto
    ray_address: str | None = None  # --ray-address: the cluster they run on (None: a local Ray, when engines > 1)
    batching: str = "all"  # --batching (stare.eval.batching): how problems reach the engine, and what that promises

    @property
    def how(self) -> str:
        return f"protocol {self.proto.name}" + (", lm-eval" if self.harness == "lm-eval" else "")


def plan_eval(*, bench: str, model: str | None, out: Path | None, protocol: str, k: int | None,
              temperature: float | None, top_p: float | None, max_tokens: int | None, backend: str | None,
              harness: str, tp: int, data_file, limit: int | None, seed: int, resume: bool,
              tools: str | None, engines: int | str = 1, ray_address: str | None = None,
              batching: str | None = None) -> EvalPlan:
    """Every check ``stare eval`` makes before a model is loaded or anything is written, in this order."""
    from stare.eval import BENCHES, load_bench
    from stare.eval.data import local_data_file
    from stare.eval.backends import check_backend, default_backend
    from stare.eval.batching import DEFAULT_BATCHING, check_batching
    from stare.eval.protocols import resolve_protocol
    from stare.eval.harness import available_memory, check_capacity
    from stare.eval.record import EvalRefused, check_resume, eval_record, holds_samples, recorded_batching

    if bench not in BENCHES:
        raise CliError(f"unknown bench {bench!r}; valid benches: {', '.join(BENCHES)}")
    errors.check_out_dir(out or Path("evals") / bench)
    tool_config = None
    try:
        if backend is not None:
            check_backend(backend)
        check_engines(engines, ray_address, harness)
        engines = parse_engines(engines)
        check_harness(harness, bench, resume=resume, tools=tools)
        if batching is not None:
            check_batching(batching, backend)
        if batching not in (None, DEFAULT_BATCHING) and harness != "stare":
            raise ValueError(f"--batching {batching} is for --harness stare; lm-eval batches its own requests")
        if tools is not None:
            from .agent.loop import ToolConfig

            tool_config = ToolConfig.from_env()
        model, out_dir = eval_target(model, out, bench)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    backend = backend or default_backend()
    if batching is None:  # --resume continues with the folder's mode; a new evaluation takes the default
        batching = (recorded_batching(out_dir) if resume and harness == "stare" else None) or DEFAULT_BATCHING
    try:
        check_batching(batching, backend)  # the default backend, now that it is known
    except ValueError as exc:
        raise CliError(str(exc)) from None
    errors.check_out_dir(out_dir)
    check_free(out_dir)  # another process writing there: refused before its samples are read
    problems = None
    try:
        proto = resolve_protocol(protocol, k=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        local = local_data_file(bench, data_file)
        if harness == "stare" or local is not None:  # lm-eval reads the hub itself
            problems = load_bench(bench, data_file=local if local is not None else "hub", limit=limit)
        if problems is not None and harness == "stare":  # a k no run can hold, before a model is loaded
            check_capacity(proto.k, len(problems), available_memory())
    except ValueError as exc:  # EvalRefused too
        raise CliError(str(exc)) from None
    data = str(Path(local).resolve()) if local is not None else "hub"
    if resume and harness == "stare":  # the folder's settings, before any model is loaded or anything written
        try:
            check_resume(out_dir, eval_record(proto, seed=seed, model=model, bench=bench, data=data, tools=tools,
                                              batching=batching))
        except EvalRefused as exc:
            raise CliError(str(exc)) from None
    if holds_samples(out_dir) and not resume:  # a record without samples (a failed start) is no evaluation
        raise CliError(f"{out_dir} already holds samples; " + ("pass --resume to continue or " if harness == "stare"
                                                               else "") + "use another --out (nothing was changed)")
    try:
        check_model_folder(model)  # a file (README.md), a folder without a readable config.json
    except ValueError as exc:
        raise CliError(str(exc)) from None
    errors.check_model_source(model)  # before loading: a mistyped path is not a hub id to retry for a minute
    if tool_config is not None:  # the sandbox's isolation here (namespaces unless asked otherwise), before loading
        from .agent.loop import check_tool_isolation

        check_tool_isolation(tool_config)
    return EvalPlan(bench, model, out_dir, proto, backend, harness, tp, seed, resume, limit, local, data, problems,
                    tools, tool_config, engines, ray_address, batching)


def evaluate(console, *, checkpoints: str | None, **flags) -> None:
    """``stare eval`` after its flags are parsed (``flags``: ``plan_eval``'s keywords): one evaluation, or with
    ``checkpoints`` (all, every:N) one per policy the training run in ``--out`` kept; a line per summary."""
    from rich.markup import escape

    from stare.eval.summary import scores_line

    bench = flags["bench"]
    if checkpoints is not None:
        from .eval_sweep import plan_sweep, run_sweep

        for p, summary in run_sweep(plan_sweep(spec=checkpoints, **flags), console):
            console.print(f"{bench} step {p.step}: {scores_line(summary)}  -> {escape(str(p.plan.out))}/summary.md")
        return
    plan = plan_eval(**flags)
    summary = run_eval_plan(plan, console)
    console.print(f"{bench} ({summary['n_problems']} problems, {plan.how}): {scores_line(summary)}  -> "
                  f"{escape(str(plan.out))}/summary.md")


def run_eval_plan(plan: EvalPlan, console) -> dict:
    """Load the model and evaluate (a progress bar for the stare harness); returns the summary (summary.json).
    The evaluation folder is locked meanwhile (``folder_lock``); a stop (``stopping``) keeps every problem whose
    samples were written."""
    with hold(plan.out):
        try:
            return _run_eval_plan(plan, console)
        except KeyboardInterrupt:
            done = plan.out / "samples.jsonl"
            stopping.report(f"the evaluation in {plan.out}" + (f" (the problems finished are in {done})"
                                                               if done.exists() else ""))
            raise


def _run_eval_plan(plan: EvalPlan, console) -> dict:
    from .quiet import quiet

    quiet()
    proto = plan.proto
    if plan.harness == "lm-eval":
        from stare.eval.lm_eval_harness import LmEvalError, run_lm_eval

        console.print(f"lm-eval task for {plan.bench}: {proto.k} samples per problem, {plan.backend} model")
        try:
            return run_lm_eval(plan.bench, plan.model, proto, plan.out, backend=plan.backend, tp=plan.tp,
                               data_file=plan.local, limit=plan.limit, seed=plan.seed)
        except LmEvalError as exc:
            raise CliError(str(exc)) from None
    if plan.engines == AUTO:
        plan.engines, plan.tp = auto_layout(plan, console)
    if plan.engines > 1 or plan.ray_address is not None:
        return run_on_engines(plan, console)
    try:
        engine = build_engine(plan.backend, plan.model, plan.tp, plan.seed, plan.tools, plan.tool_config,
                              plan.batching)
    except ValueError as exc:  # e.g. STARE_TOOL_FORMAT=chat with a tokenizer that has no chat template
        raise CliError(str(exc)) from None
    stopping.reclaim()  # an engine's library may have set handlers of its own
    return run_with_progress(plan, engine, console)


def run_with_progress(plan: EvalPlan, engine, console) -> dict:
    """The stare harness on ``engine`` (one backend, or several engines) under a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stare.eval.harness import check_start, run_eval
    from stare.eval.record import EvalRefused

    proto = plan.proto
    try:  # what the loaded model refuses (no problem fits its context, a k it cannot hold): before the bar shows
        check_start(plan.problems, engine, proto, plan.model)
    except EvalRefused as exc:
        raise CliError(str(exc)) from None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"{plan.bench} x {proto.k} samples", total=len(plan.problems) * proto.k)
        try:
            return run_eval(plan.problems, engine, proto, plan.out, bench=plan.bench, model=plan.model,
                            seed=plan.seed, resume=plan.resume, progress=lambda n: progress.advance(task, n),
                            data=plan.data, tools=plan.tools, batching=plan.batching)
        except EvalRefused as exc:
            progress.stop()
            errors.fail(str(exc))  # printed here, under the stopped bar, as the bar closes


WEIGHT_SHARE = 0.75  # --engines auto: a model's weights may take this share of a GPU (the rest: KV cache, activations)


def weight_bytes(model: str) -> int | None:
    """The bytes of a local model folder's weight files (``*.safetensors``, else ``*.bin``), None for a hub id or a
    folder without them."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files) or None


def needed_tp(weights: int | None, gpu_bytes: int | None, tp: int, gpus: int) -> int:
    """The smallest power of two >= ``tp`` (and <= ``gpus``) at which a share of ``weights`` fits ``WEIGHT_SHARE`` of
    one GPU; ``tp`` when either size is unknown. A rough floor: the KV cache a response needs is not counted."""
    if not weights or not gpu_bytes:
        return tp
    while weights / tp > WEIGHT_SHARE * gpu_bytes and tp * 2 <= max(gpus, 1):
        tp *= 2
    return tp


def auto_layout(plan: EvalPlan, console) -> tuple[int, int]:
    """``--engines auto``: (engines, tp) for the GPUs here (``torch.cuda``) or, with ``--ray-address``, the cluster's
    (Ray's ``cluster_resources``): tp at least ``--tp`` and at least what the model's weights need
    (``needed_tp``), engines as many as the GPUs hold at that tp (the HF backend: one GPU each); one engine, and no
    Ray, where there is no GPU. One line says what was chosen."""
    import torch

    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    if plan.ray_address is not None:
        from stare.eval.engines import EngineError, start_ray

        try:
            ray, own = start_ray(plan.ray_address, 1)
        except EngineError as exc:  # the cluster cannot be attached: its one line, as --engines N gives it
            raise CliError(str(exc), code=1) from None
        try:
            gpus = int(ray.cluster_resources().get("GPU", 0))
        finally:
            if own:
                ray.shutdown()
    else:
        gpus = torch.cuda.device_count()
    if gpus == 0:
        console.print("--engines auto: no GPU here, so one engine in this process", markup=False, highlight=False)
        return 1, plan.tp
    per_engine = 1
    tp = plan.tp
    if plan.backend == "vllm":
        from .gpu_memory import eval_tp, load_shapes

        shapes = load_shapes(plan.model)  # the memory plan: weights and one sequence of the model's context
        tp = (eval_tp(shapes, gpu_bytes, plan.tp, gpus) if shapes is not None and gpu_bytes
              else needed_tp(weight_bytes(plan.model), gpu_bytes, plan.tp, gpus))
        per_engine = tp
    engines = max(1, gpus // per_engine)
    where = f"the Ray cluster at {plan.ray_address}" if plan.ray_address else "this machine"
    console.print(f"--engines auto: {engines} engine(s) x {per_engine} GPU(s) on the {gpus} GPU(s) of {where}"
                  + (f" (tp {tp}: the model's weights need it)" if tp > plan.tp else ""), markup=False,
                  highlight=False)
    return engines, tp


def run_on_engines(plan: EvalPlan, console) -> dict:
    """``--engines N`` / ``--ray-address``: the stare harness on N Ray actors (stare.eval.engines); a lost engine's
    problems go to the others (one warning line), and when none is left the run stops with one line (exit 1), the
    problems done kept in samples.jsonl for ``--resume``."""
    from functools import partial

    from stare.eval.engines import EngineError, EnginePool

    factory = partial(build_engine, plan.backend, plan.model, plan.tp, plan.seed, plan.tools, plan.tool_config,
                      plan.batching)
    gpus = plan.tp if plan.backend == "vllm" else 1  # per engine, where the cluster has GPUs
    try:
        with EnginePool(factory, plan.engines, gpus=gpus, ray_address=plan.ray_address) as pool:
            stopping.reclaim()  # ray.init's SIGTERM handler would exit 15 without a word
            return run_with_progress(plan, pool, console)
    except EngineError as exc:
        done = plan.out / "samples.jsonl"
        tail = f"; the problems finished are in {done}: continue with --resume" if done.exists() else ""
        raise CliError(f"{exc}{tail}", code=1) from None
