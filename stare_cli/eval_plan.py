"""What ``stare eval`` will evaluate, decided before any model is loaded: the model and output folder, and whether
the harness, benchmark, tools and ``--resume`` fit together. Each check raises ``ValueError`` with one line that
names the bad value; the CLI prints it and exits with code 2.
"""
from __future__ import annotations

from pathlib import Path

from .rundir import final_model

HARNESSES = ("stare", "lm-eval")


def looks_like_hub_id(model: str) -> bool:
    """A hub id has the form owner/name (one slash, not a path: no leading /, ./, ../ or ~); anything else must be a
    folder that exists."""
    return model.count("/") == 1 and not model.startswith(("/", "./", "../", "~")) and all(model.split("/"))


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
        return str(final), out / f"eval-{bench}"
    if not Path(model).exists() and not looks_like_hub_id(model):
        raise ValueError(f"--model {model!r}: no such folder ({Path(model).absolute()}), and not a hub id "
                         "(owner/name); check the path")
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
