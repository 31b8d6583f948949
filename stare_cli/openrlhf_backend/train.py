"""``stare train`` on a GPU preset: the OpenRLHF launch (``stare.cli.openrlhf_backend.launch``) driven from the CLI.

``plan`` is what ``--dry-run`` prints; ``train`` checks everything that can be checked here (the run folder, the
Ray address, the tool sandbox's isolation when the rollout actors run on this node, the GPU training stack),
makes the run folder and starts. Both raise ``stare.cli.errors.CliError`` (one line) for what the user fixes.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .. import errors
from ..errors import CliError
from ..rundir import CKPT


def plan(resolved: dict, out: Path, ray_address: str | None) -> dict:
    """The launch plan (``launch.plan``): the exact OpenRLHF command, the STARE settings, the Ray setup."""
    from . import launch as orl
    from ..gpu_schema import SettingsError

    try:
        launch_plan = orl.plan(resolved, out, ray_address)
    except (SettingsError, orl.LaunchError) as exc:
        raise CliError(str(exc)) from None
    from .. import gpu_memory

    memory = gpu_memory.plan_memory(resolved["settings"], resolved["algo"])
    launch_plan["memory"] = memory.to_json()
    launch_plan["notes"] += memory_notes(launch_plan["memory"], resolved["settings"]["memory_check"])
    return launch_plan


def memory_refusal(launch_plan: dict, settings: dict) -> str | None:
    """The one line refusing this training when its memory plan does not fit and ``memory_check`` is refuse."""
    from ..gpu_memory import refusal

    return refusal(launch_plan["memory"], settings["memory_check"])


def check_memory(launch_plan: dict, settings: dict) -> None:
    """``CliError`` (one line, exit 2) when the plan's memory does not fit and ``memory_check`` is refuse."""
    why = memory_refusal(launch_plan, settings)
    if why:
        raise CliError(why)


def memory_notes(memory: dict, mode: str) -> list[str]:
    """The plan's warnings, and under ``memory_check=warn`` its problems, as notes (printed before a launch)."""
    if mode == "off":
        return []
    problems = [f"memory: {p} (memory_check={mode}: launching anyway)" for p in memory.get("problems", [])
                if mode == "warn"]
    return problems + [f"memory: {w}" for w in memory.get("warnings", [])]


def train(resolved: dict, launch_plan: dict, out: Path, *, resume: bool, ray_address: str | None,
          console: Console) -> None:
    """Check, make the run folder, start OpenRLHF (returns when training ends)."""
    from .. import stopping
    from ..folder_lock import check_free, hold
    from . import launch as orl
    from ..rundir import RunDirError, check_run_dir, prepare_run_dir

    check_free(out)  # another process writing there: refused before anything of it is read
    try:
        check_run_dir(out, resolved, resume)
        if ray_address:
            orl.check_ray_address(ray_address)
    except (RunDirError, orl.LaunchError) as exc:
        raise CliError(str(exc)) from None
    if resolved["settings"].get("agent") and not ray_address:  # the rollout actors run here: so does the sandbox
        _check_tool_sandbox(launch_plan["ray"]["runtime_env"]["env_vars"])
    check_training_stack()
    with hold(out):
        prepare_run_dir(out, resolved, resume)
        console.print(f"[bold]stare train[/] {resolved['preset']} with {resolved['algo']['name']} on OpenRLHF -> "
                      f"{escape(str(out))}")
        for note in launch_plan["notes"]:
            if note.startswith("memory:"):  # the memory plan's warnings, before hours of setup
                errors.plain(console)(f"warning: {note}")
        if resume:
            from .checkpoint import describe_resume

            errors.plain(console)(describe_resume(out / CKPT, resolved["settings"].get("seeded_rollouts", True)))
        try:
            orl.start(resolved, launch_plan, log=errors.plain(console))
        except orl.LaunchError as exc:
            raise CliError(str(exc)) from None
        except KeyboardInterrupt:  # stopping.Stopped, or Ray's KeyboardInterrupt of a wait it cut
            stopping.report(f"the OpenRLHF training in {out}, with its Ray workers and engines (it resumes from its "
                            "last checkpoint in ckpt/)")
            raise


def check_training_stack() -> None:
    """OpenRLHF (at its pinned version) and what it needs import here; ``CliError`` (exit 2) otherwise, with the
    install command for where this stare came from (``install_hint``)."""
    from . import OpenRLHFMissing, OpenRLHFVersionError

    try:
        from . import plugin  # noqa: F401 - imports OpenRLHF and checks its version
    except ImportError as exc:
        raise CliError(f"the GPU training stack is not installed ({exc}); {install_hint()}") from None
    except OpenRLHFMissing as exc:
        raise CliError(f"{exc}; {install_hint()}") from None
    except OpenRLHFVersionError as exc:
        raise CliError(str(exc)) from None


def install_hint(environ=None, root: Path | None = None) -> str:
    """How to get the GPU training stack, for where this stare was installed from: the Docker image (which has it),
    an editable clone, a folder, or a package index; and what works without it."""
    import json
    import os
    from importlib.metadata import distributions
    from urllib.parse import unquote, urlparse

    environ = os.environ if environ is None else environ
    cpu = ("; on a machine without a GPU only `stare train --dry-run` and `stare run --dry-run` work on GPU presets "
           "(OpenRLHF's training needs CUDA)")
    if environ.get("STARE_IMAGE"):
        return ("this Docker image should hold it: rebuild it from the repository's Dockerfile "
                "(docker build -t stare .)" + cpu)
    root = Path(__file__).resolve().parent.parent if root is None else root  # a clone holds stare_cli/ at its top
    if (root / "pyproject.toml").is_file() and (root / "stare_cli").is_dir():  # an editable install (or the source)
        return f"pip install -e '{root}[openrlhf]', or use the Docker image (see the README){cpu}"
    for dist in distributions(name="stare"):  # installed from a folder: its direct_url.json names it
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        url = direct.get("url", "")
        if url.startswith("file://") and "dir_info" in direct:
            folder = unquote(urlparse(url).path)
            return f"pip install '{folder}[openrlhf]', or use the Docker image (see the README){cpu}"
    return f"pip install 'stare[openrlhf]', or use the Docker image (see the README){cpu}"


def _check_tool_sandbox(worker_env: dict[str, str]) -> None:
    """The tool agent's settings and its sandbox's isolation on this node, as the agent checks them when a rollout
    actor loads it (from the variables the plan gives the workers: ``STARE_TOOL_*`` and ``STARE_SANDBOX_ISOLATION``,
    the preset's ``sandbox_isolation``), but before Ray and the GPUs start."""
    import os

    from ..agent.loop import ToolConfig, check_tool_isolation

    try:
        config = ToolConfig.from_env({**os.environ, **worker_env})  # Ray's runtime_env overrides the shell's
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        check_tool_isolation(config)
    except CliError as exc:
        raise CliError(f"{exc} (for this run: --set sandbox_isolation=auto)", exc.code) from None
