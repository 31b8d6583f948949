"""``stare train`` on a GPU preset: the OpenRLHF launch (``stare.cli.openrlhf_backend.launch``) driven from the CLI.

``plan`` is what ``--dry-run`` prints; ``train`` checks everything that can be checked here (the run folder, the
Ray address, the tool sandbox's isolation when the rollout actors run on this node, the GPU training stack),
makes the run folder and starts. Both raise ``stare.cli.errors.CliError`` (one line) for what the user fixes.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from . import errors
from .errors import CliError


def plan(resolved: dict, out: Path, ray_address: str | None) -> dict:
    """The launch plan (``launch.plan``): the exact OpenRLHF command, the STARE settings, the Ray setup."""
    from .openrlhf_backend import launch as orl
    from .openrlhf_backend.argv import SettingsError

    try:
        return orl.plan(resolved, out, ray_address)
    except (SettingsError, orl.LaunchError) as exc:
        raise CliError(str(exc)) from None


def train(resolved: dict, launch_plan: dict, out: Path, *, resume: bool, ray_address: str | None,
          console: Console) -> None:
    """Check, make the run folder, start OpenRLHF (returns when training ends)."""
    from .openrlhf_backend import launch as orl
    from .rundir import RunDirError, check_run_dir, prepare_run_dir

    try:
        check_run_dir(out, resolved, resume)
        if ray_address:
            orl.check_ray_address(ray_address)
    except (RunDirError, orl.LaunchError) as exc:
        raise CliError(str(exc)) from None
    if resolved["settings"].get("agent") and not ray_address:  # the rollout actors run here: so does the sandbox
        _check_tool_sandbox(launch_plan["ray"]["runtime_env"]["env_vars"])
    check_training_stack()
    prepare_run_dir(out, resolved, resume)
    console.print(f"[bold]stare train[/] {resolved['preset']} with {resolved['algo']['name']} on OpenRLHF -> "
                  f"{escape(str(out))}")
    if resume:
        from .openrlhf_backend.checkpoint import describe_resume

        errors.plain(console)(describe_resume(out / "ckpt"))
    try:
        orl.start(resolved, launch_plan, log=errors.plain(console))
    except orl.LaunchError as exc:
        raise CliError(str(exc)) from None


def check_training_stack() -> None:
    """OpenRLHF (at its pinned version) and what it needs import here; ``CliError`` (exit 1) otherwise."""
    from .openrlhf_backend import OpenRLHFVersionError

    try:
        from .openrlhf_backend import plugin  # noqa: F401 - imports OpenRLHF and checks its version
    except ImportError as exc:
        raise CliError(f"the GPU training stack is not installed ({exc}); pip install 'stare[openrlhf]' or use the "
                       "Docker image (see the README)", code=1) from None
    except OpenRLHFVersionError as exc:
        raise CliError(str(exc), code=1) from None


def _check_tool_sandbox(worker_env: dict[str, str]) -> None:
    """The tool agent's settings and its sandbox's isolation on this node, as the agent checks them when a rollout
    actor loads it (from the variables the plan gives the workers: ``STARE_TOOL_*`` and ``STARE_SANDBOX_ISOLATION``,
    the preset's ``sandbox_isolation``), but before Ray and the GPUs start."""
    import os

    from .agent.loop import ToolConfig
    from .eval_plan import check_tool_isolation

    try:
        config = ToolConfig.from_env({**os.environ, **worker_env})  # Ray's runtime_env overrides the shell's
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        check_tool_isolation(config)
    except CliError as exc:
        raise CliError(f"{exc} (for this run: --set sandbox_isolation=auto)", exc.code) from None
