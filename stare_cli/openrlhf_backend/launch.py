"""The driver of an OpenRLHF run with STARE: Ray, plugin registration, then OpenRLHF's own CLI.

``stare train`` calls ``launch``; the ``command`` printed by ``stare train --dry-run`` runs this module
directly (``python -m stare.cli.openrlhf_backend.launch <openrlhf args>``) with the same environment, so a user
can paste it, edit a flag, or hand it to ``ray job submit``.

The STARE settings are read from ``STARE_SETTINGS`` here only to check them early; the workers read the same
variable from the Ray runtime environment.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from stare.algorithms.token_rules import MODULES_ENV as TOKEN_RULE_MODULES_ENV
from stare.eval.ray_attach import LOCAL_HEAD_CONFIG, host_port
from .argv import (DASHBOARD_ENV, PROMPT_FILE, REWARD_TIMEOUT_ENV, SEED_ENV, SEED_HOOK, SEEDED_ROLLOUTS_ENV,
                   SETTINGS_ENV, build_launch)

PACKAGE_DIR = Path(__file__).resolve().parent
REWARD_FILE = PACKAGE_DIR / "reward.py"
AGENT_FILE = PACKAGE_DIR.parent / "agent" / "python_agent.py"

WANDB_PLACEHOLDER = "${WANDB_API_KEY}"
# variables the workers need; passed in the Ray runtime environment
FORWARDED_ENV = (SETTINGS_ENV, REWARD_TIMEOUT_ENV, SEED_ENV, SEEDED_ROLLOUTS_ENV, TOKEN_RULE_MODULES_ENV,
                 "STARE_TOOL_MAX_TURNS", "STARE_TOOL_TIMEOUT_S", "STARE_TOOL_MEMORY_MB", "STARE_TOOL_MAX_OUTPUT_CHARS",
                 "STARE_TOOL_FORMAT", "STARE_SANDBOX_ISOLATION",
                 "TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "HF_HOME",
                 "HF_TOKEN", "HF_HUB_OFFLINE", "WANDB_API_KEY",
                 "VLLM_BATCH_INVARIANT")  # vLLM's batch-invariant mode, for seeded rollouts on GPUs (docs: Resume)


class LaunchError(RuntimeError):
    """Something the user can fix before anything starts (the CLI exits with code 2)."""


def check_ray_address(address: str, timeout: float = 3.0) -> None:
    """Fail early, in one line and within a bound, when this process cannot attach to the Ray cluster at
    ``address``: its port does not open, or a probe that attaches as ``launch`` will (in a child process,
    ``stare.eval.ray_attach.check_attach``) fails or runs out of time, e.g. a driver in another container than the
    node whose raylet socket it needs."""
    from stare.eval.ray_attach import RayAttachError, check_attach, check_reachable

    check_address_syntax(address)
    try:
        check_reachable(address, timeout=timeout)
        check_attach(address)
    except RayAttachError as exc:
        raise LaunchError(str(exc)) from None


def check_address_syntax(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address (None for ``auto``); ``LaunchError`` when it is not HOST:PORT."""
    if address == "auto":
        return None
    found = host_port(address)
    if found is None:
        raise LaunchError(f"--ray-address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379, ray://head:10001, auto)")
    return found


def plan(resolved: dict, out, ray_address: str | None = None) -> dict:
    """What ``stare train`` will run (and ``--dry-run`` prints): see ``argv.build_launch``."""
    if ray_address:
        check_address_syntax(ray_address)
    # absolute: Ray workers do not share the driver's working directory
    return build_launch(resolved, Path(out).absolute(), ray_address=ray_address, reward_file=str(REWARD_FILE),
                        agent_file=str(AGENT_FILE))


def start(resolved: dict, launch_plan: dict, *, log=print) -> None:
    """Prepare the prompt file, export the workers' environment, launch. The run folder already exists."""
    from .data import prepare_prompts

    out = Path(launch_plan["out"])
    s = resolved["settings"]
    log(f"training prompts: {s['data']} -> {out / PROMPT_FILE}")
    try:
        info = prepare_prompts(s["data"], s["prompt_template"], out / PROMPT_FILE, split=s["data_split"])
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    log(f"  {info['problems']} problems (from {info['rows']} rows)")
    if s["eval_every"]:  # OpenRLHF's in-training evaluation set, in the same template
        from .argv import eval_file
        from .data import prepare_eval_prompts

        try:
            info = prepare_eval_prompts(s["eval_bench"], s["prompt_template"], out / eval_file(s["eval_bench"]))
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        log(f"evaluation every {s['eval_every']} steps: {info['problems']} {info['bench']} problems")
    (out / "command.sh").write_text("#!/usr/bin/env bash\n" + launch_plan["command"] + "\n")
    os.environ.update(launch_plan["ray"]["runtime_env"]["env_vars"])
    launch(launch_plan["openrlhf_argv"], ray_address=launch_plan["ray"]["address"],
           dashboard=launch_plan["ray"]["dashboard"])


def runtime_env(environ=None) -> dict:
    """What every Ray worker of the run gets: the variables it needs, and ``seed_worker`` at its start."""
    environ = os.environ if environ is None else environ
    return {"env_vars": {k: environ[k] for k in FORWARDED_ENV if environ.get(k)},
            "worker_process_setup_hook": SEED_HOOK}


def seed_worker(environ=None) -> None:
    """Ray's ``worker_process_setup_hook``: seed torch's generator from the run's seed (``STARE_SEED``) before the
    worker builds anything. OpenRLHF's trainer shuffles the prompts with a generator seeded from torch's (its
    ``StatefulDataLoader``'s ``RandomSampler``), and torch seeds its own at random in every new process, so without
    this the prompt order of a run was not a function of ``--set seed`` (docs/openrlhf-backend.md, "Resume")."""
    environ = os.environ if environ is None else environ
    seed = environ.get(SEED_ENV)
    if seed:
        import torch

        torch.manual_seed(int(seed))


def substitute_secrets(argv: list[str], environ=None) -> list[str]:
    environ = os.environ if environ is None else environ
    if WANDB_PLACEHOLDER not in argv:
        return list(argv)
    key = environ.get("WANDB_API_KEY")
    if not key:
        raise LaunchError("wandb_project is set but WANDB_API_KEY is not in the environment")
    return [key if a == WANDB_PLACEHOLDER else a for a in argv]


def dashboard_from_env(environ=None) -> bool:
    """The ``ray_dashboard`` setting as the printed command carries it (``STARE_RAY_DASHBOARD=0|1``; unset: off)."""
    environ = os.environ if environ is None else environ
    value = environ.get(DASHBOARD_ENV, "0").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise LaunchError(f"{DASHBOARD_ENV}={environ[DASHBOARD_ENV]!r}: expected 0 or 1")
    return value in ("1", "true")


def ray_init_kwargs(ray_address: str | None, dashboard: bool, environ=None) -> dict:
    """The arguments of ``ray.init``: the dashboard is ours to choose only for a head started here.

    Joining a cluster (``ray_address``, or ``RAY_ADDRESS``, which Ray reads itself) passes no
    ``include_dashboard``: Ray ignores it for HOST:PORT, and for ray://HOST:PORT forwards it to a ``ray.init``
    on the cluster; the cluster's head already decided (``ray start --head --include-dashboard``). A head started
    here gets ``LOCAL_HEAD_CONFIG`` (``stare.eval.ray_attach``): its raylet does not hold ``ray.init`` until the
    workers it prestarts register, which on a loaded machine can be never."""
    kwargs = {"address": ray_address or None, "runtime_env": runtime_env(environ)}
    if not (ray_address or os.environ.get("RAY_ADDRESS")):
        kwargs["include_dashboard"] = bool(dashboard)  # None would start it whenever ray[default] is installed
        kwargs["_system_config"] = LOCAL_HEAD_CONFIG  # ray.init does not wait for workers (check_first_worker does)
    return kwargs


def launch(argv: list[str], *, ray_address: str | None = None, dashboard: bool | None = None,
           environ=None) -> None:
    """Start Ray (or join ``ray_address``), register the STARE actor, run OpenRLHF's train_ppo_ray.

    A Ray head started here has no dashboard unless ``dashboard`` (the ``ray_dashboard`` setting; None: read
    ``STARE_RAY_DASHBOARD`` from the environment, as the printed command sets it): on a small machine starting
    it can stall Ray's start and log "Failed to start the dashboard" (docs/openrlhf-backend.md).
    The address is not probed here: ``stare train`` and ``main`` check it before anything starts
    (``check_ray_address``). Right after ``ray.init`` one empty task must run within the bound
    (``check_first_worker``): a Ray whose workers never register ends in one line, not a wait without end."""
    from . import plugin  # checks the OpenRLHF version on import
    from .compat import TRAIN_MODULE

    plugin.load_settings(environ)  # fail here, not in a worker, on bad settings
    argv = substitute_secrets(argv, environ)
    if dashboard is None:
        dashboard = dashboard_from_env(environ)
    import ray

    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(ray_address, dashboard, environ))
        from ..stopping import reclaim

        reclaim()  # ray.init's SIGTERM handler exits 15 without a word: a stare command's stop is ours
        check_first_worker(ray, ray_address or os.environ.get("RAY_ADDRESS"))
    plugin.register()
    saved = sys.argv
    sys.argv = [TRAIN_MODULE, *argv]
    try:
        runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:  # a stop (SIGINT, SIGTERM: stare.cli.stopping): the actors, engines and a head go now
        ray.shutdown()
        raise
    finally:
        sys.argv = saved


def check_first_worker(ray, address: str | None) -> None:
    """One empty task within the bound (``stare.eval.ray_attach.check_workers``): a Ray whose workers never
    register is one ``LaunchError`` line, not a run that waits for ever; this process then leaves that Ray (a head
    it started ends)."""
    from stare.eval.ray_attach import RayAttachError, check_workers, session_logs

    where = f"the Ray cluster at {address}" if address else "the Ray head started here"
    try:
        check_workers(ray, where, logs=session_logs(ray))
    except RayAttachError as exc:
        ray.shutdown()
        raise LaunchError(str(exc)) from None


def main() -> None:
    address = os.environ.get("RAY_ADDRESS") or None
    try:
        if address:
            check_ray_address(address)
        launch(sys.argv[1:], ray_address=address)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
