"""Bad input on the command line: one line on stderr, exit 2, naming the flag and the value.

``main.py`` calls these helpers; they hold the checks that are about the command line rather than about a
preset, an algorithm or a benchmark:

- ``StareGroup``: the ``typer`` group class of ``stare``. It turns the parser's own usage errors (a value out
  of a ``min=`` range, not a number, an unknown option) into one line naming the flag and the value, instead of
  typer's boxed five-line panel, and hides the ``<bool>`` type that typer's help shows after on/off flags.
- ``fail``: the one-line error, with the message escaped so that rich does not eat ``[...]`` in user values
  and hints (``pip install 'stare[openrlhf]'``, ``--set w=[big]``, ``runs/[tiny]/final``).
- ``CliError``: the same one line from the modules a command calls (the local runner, the OpenRLHF launch, the
  eval plan): they raise it, ``StareGroup`` prints it as ``fail`` would and exits with its code.
- ``check_out_dir``: ``--out`` must be a folder or creatable as one, checked before anything is loaded or
  written.
- ``check_model_source``: a ``--model`` that is not a folder here and looks like a hub id (``owner/name``), as
  a mistyped local path does: when the hub cannot be reached (``HF_HUB_OFFLINE=1`` or no network) and has no
  cached copy, one line naming the path, in seconds, rather than transformers' retries and traceback.
"""
from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.24 carries its own copy of click
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover - older typer runs on click itself
    from click import exceptions as _click_exceptions

err_console = Console(stderr=True)
# typer's own Abort, and click's where typer still uses click's (older typer)
_ABORTS = tuple({typer.Abort, getattr(_click_exceptions, "Abort", typer.Abort)})


class CliError(Exception):
    """A failure the user fixes, raised where a command's work is done: one line on stderr and exit ``code`` (2: bad
    usage; 1: something missing from this machine, such as an optional package), printed by ``StareGroup``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _print_error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit (code 2: bad usage). ``message`` is plain text, never markup."""
    _print_error(message)
    raise typer.Exit(code)


def warning(line: str) -> None:
    """One ``warning:`` line on stderr (plain text, never markup)."""
    err_console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)


def plain(console: Console):
    """``console.print`` for text that is not markup (paths, commands, user values), e.g. as a ``log=``."""
    def _print(text: Any = "") -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    return _print


# --- the parser's own errors -------------------------------------------------------------------------------

def _given_value(param, args: Sequence[str]) -> str | None:
    """The text the user gave for ``param`` on the command line (its last occurrence), or None."""
    opts = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
    found = None
    for i, tok in enumerate(args):
        for opt in opts:
            if tok == opt and i + 1 < len(args):
                found = args[i + 1]
            elif opt.startswith("--") and tok.startswith(opt + "="):
                found = tok[len(opt) + 1:]
            elif not opt.startswith("--") and len(opt) == 2 and tok.startswith(opt) and len(tok) > 2:
                found = tok[2:]
    return found


def usage_line(exc: Exception, args: Sequence[str]) -> str:
    """One line for a usage error of the parser: the flag, the value given, what is wrong."""
    message = getattr(exc, "message", None) or str(exc)
    message = " ".join(message.split())
    param = getattr(exc, "param", None)
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, _click_exceptions.MissingParameter):
        message = " ".join(exc.format_message().split())
    elif isinstance(exc, _click_exceptions.BadParameter) and param is not None:
        opts = getattr(param, "opts", None) or [getattr(param, "name", "?")]
        flag = max(opts, key=len) if getattr(param, "param_type_name", "") == "option" else \
            (getattr(param, "human_readable_name", None) or opts[0])
        value = _given_value(param, args)
        reason = message[:1].lower() + message[1:]
        if value is None:
            return f"invalid value for {flag}: {reason}"
        return f"{flag} {value}: {reason}"
    line = (message[:1].lower() + message[1:]).rstrip(".")
    if ctx is not None:
        line = line.rstrip(".") + f" (see '{ctx.command_path} --help')"
    return line


def _hide_flag_types(params) -> None:
    """On/off flags take no value: typer's help shows ``<bool>`` after them unless the metavar is empty."""
    for p in params:
        if getattr(p, "is_flag", False) and not getattr(p, "count", False) and p.metavar is None:
            p.metavar = ""


class StareGroup(TyperGroup):
    """``stare``'s command group: one-line usage errors (exit 2) and flags shown as flags in every help."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _hide_flag_types(params)
        return params

    def get_command(self, ctx, cmd_name):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            _hide_flag_types(cmd.get_params(ctx))
        return cmd

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                              **extra)
        except _click_exceptions.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `stare` alone: the help (typer printed it already)
                text = exc.format_message()
                if text.strip():
                    typer.echo(text, err=False)
                sys.exit(exc.exit_code)
            _print_error(usage_line(exc, argv))
            sys.exit(exc.exit_code)
        except CliError as exc:
            _print_error(str(exc))
            sys.exit(exc.code)
        except _ABORTS:
            err_console.print("Aborted.", highlight=False)
            sys.exit(1)
        except OSError as exc:  # e.g. --out on a read-only file system, found only at the write
            if exc.errno not in WRITE_ERRNOS:
                raise
            _print_error(write_error_line(exc))
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


# --- --out -----------------------------------------------------------------------------------------------

def _writable(folder: Path) -> bool:
    """Whether files can be made in ``folder``: ``access(2)`` says no on a read-only file system (EROFS) even to
    root, and for a folder without write permission to anyone else."""
    return os.access(folder, os.W_OK | os.X_OK)


def out_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a folder that can be written, or None when it can."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            return "is a file, not a folder"
        return None if _writable(path) else "is not writable (read-only file system or no permission)"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"cannot be made: {parent} is a file, not a folder"
            return None if _writable(parent) else (f"cannot be made: {parent} is not writable (read-only file "
                                                   "system or no permission)")
    return None


# errors of the file system that the user fixes by choosing another place (or freeing space), not bugs
WRITE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def write_error_line(exc: OSError) -> str:
    """One line for a write that the file system refused (``WRITE_ERRNOS``), naming the file."""
    where = exc.filename if exc.filename is not None else "a file"
    return f"cannot write {where}: {exc.strerror or exc} (errno {exc.errno}); use another --out or free the space"


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """Fail (one line, exit 2) when ``path`` cannot be the output folder; nothing is written either way."""
    problem = out_dir_problem(path)
    if problem:
        fail(f"{flag} {path} {problem}; use another {flag} (nothing was written)")


# --- --model that looks like a hub id -------------------------------------------------------------------

def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_lookup(model: str, timeout: float) -> tuple[bool | None, str]:
    """(True: on the hub / False: not on the hub / None: could not ask, why)."""
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return None, "offline: HF_HUB_OFFLINE=1" if _env_true("HF_HUB_OFFLINE") else "offline: TRANSFORMERS_OFFLINE=1"
    try:
        from huggingface_hub import model_info
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return None, "huggingface_hub is not installed"
    try:
        model_info(model, timeout=timeout)
        return True, ""
    except GatedRepoError:  # a gated model exists; loading it says what access it needs
        return True, ""
    except RepositoryNotFoundError:
        return False, "no such model on the hub (or it is private and no HF_TOKEN is set)"
    except HfHubHTTPError:  # the hub answered with another error (rate limit, outage): let loading decide
        return True, ""
    except Exception as exc:  # no network, DNS, proxy, timeout: the hub cannot be asked
        return None, f"the hub cannot be reached ({type(exc).__name__})"


def _hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return "the hub cache"
    return str(constants.HF_HUB_CACHE)


def _in_hub_cache(model: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    try:
        hit = try_to_load_from_cache(model, "config.json")
    except Exception:  # e.g. an id the hub would refuse
        return False
    return isinstance(hit, str)


HUB_ID_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def looks_like_hub_id(model: str) -> bool:
    """A hub id is ``name`` or ``owner/name`` (``gpt2``, ``Qwen/Qwen2.5-Math-7B``): one or two parts of letters, digits,
    '.', '_' and '-'. Anything else (``./x``, ``/abs``, ``a/b/c``, ``~/m``) can only be a folder here."""
    parts = model.split("/")
    return len(parts) <= 2 and all(HUB_ID_PART.fullmatch(p) and ".." not in p for p in parts)


def check_model_source(model: str, flag: str = "--model", timeout: float = 5.0) -> None:
    """A ``--model`` that is not a folder here must be a hub model that can be loaded: on the hub, or in the
    local hub cache when the hub cannot be reached. Otherwise fail with one line naming the path."""
    if Path(model).exists():
        return
    on_hub, why = _hub_lookup(model, timeout)
    if on_hub or _in_hub_cache(model):
        return
    where = f"no folder {Path(model).absolute()}"
    if on_hub is None:
        fail(f"{flag} {model}: {where}, and no hub model {model!r} in the local hub cache ({_hub_cache_dir()}; "
             f"{why}); check the path, or download the model first")
    fail(f"{flag} {model}: {where}, and {why}; check the path")


class PlainUsage(TyperCommand):
    """A usage line that names a required argument as ``DIR...`` (the newer typer writes ``{DIR}...``, which reads as
    a template left unfilled)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"^\{([^{}]*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]
