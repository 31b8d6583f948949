"""The tool-use loop, independent of any trainer or inference engine.

One ``ToolEpisode`` per sampled answer. After each model turn the driver (OpenRLHF's multi-turn executor through
``python_agent.py``, or ``stare eval --tools python``) calls ``episode.step(turn_text)``:

- the turn holds a final ``\\boxed{}`` answer with no code block after it: the episode ends (``answer``);
- else the turn holds a closed fenced ```` ```python ```` block: the last one is run in the sandbox and the
  observation (stdout, stderr, a one-line tool error; each cut to a set size) comes back wrapped in the model's
  chat format, for the driver to append to the context;
- else (no code, no answer): the episode ends (``no_action``);
- a turn limit (``max_turns`` model turns), an exhausted token budget or a full model context (the driver says
  how much of each is left) also ends it (``max_turns``, ``token_budget``, ``context``).

The reward is the math-verify check (``stare.eval.is_correct``) of the final answer turn only, so a ``\\boxed{}``
printed by a tool never counts as the model's answer.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Callable

from .sandbox import ISOLATION_MODES, SandboxResult, resolve_isolation, run_python

__all__ = ["ToolConfig", "ToolCall", "Action", "ObservationFormat", "ToolEpisode", "parse_action",
           "observation_body", "plain_format", "chat_format", "format_for", "TOOL_INSTRUCTION", "turn_is_complete"]

TOOL_INSTRUCTION = ("You may write Python code in ```python blocks; each block is run and its output is shown to "
                    "you.")
# a closed ```python (or ```py) block; the code is group 1
_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\r?\n(.*?)```", re.DOTALL)
OUTPUT_FENCE = "```output"
_ISOLATION_CHOICES = f"{', '.join(ISOLATION_MODES[:-1])} or {ISOLATION_MODES[-1]}"


def _env_number(environ, name: str, default, kind=int):
    """``kind(environ[name])``, ``default`` when unset or empty; a clear error naming the variable."""
    raw = environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None


@dataclass(frozen=True)
class ToolConfig:
    """Settings of the tool loop. ``from_env()`` reads the ``STARE_TOOL_*`` variables (OpenRLHF's parser rejects
    unknown flags, so the trainer's agent takes its settings from the environment)."""

    max_turns: int = 4  # model turns per episode; at most max_turns - 1 tool results reach the model
    timeout_s: float = 10.0  # wall clock per tool call
    memory_mb: int = 1024  # address space per tool call
    max_output_chars: int = 1024  # stdout + stderr shown to the model per call (head and tail kept)
    format: str = "auto"  # auto (chat when the tokenizer has a template), chat, plain
    # the sandbox's isolation (stare.cli.agent.sandbox): namespaces, or fail; auto (namespaces when available, else
    # the audit-hook fallback) and basic only when asked for
    isolation: str = "namespaces"

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64, got {self.memory_mb}")
        if self.max_output_chars < 64:
            raise ValueError(f"max_output_chars must be >= 64, got {self.max_output_chars}")
        if self.format not in ("auto", "chat", "plain"):
            raise ValueError(f"format must be auto, chat or plain, got {self.format!r}")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be {_ISOLATION_CHOICES}, got {self.isolation!r}")

    @classmethod
    def from_env(cls, environ=None) -> "ToolConfig":
        """The settings from ``environ`` (default ``os.environ``): the ``STARE_TOOL_*`` variables and
        ``STARE_SANDBOX_ISOLATION``."""
        environ = os.environ if environ is None else environ
        d = cls()
        isolation = environ.get("STARE_SANDBOX_ISOLATION") or d.isolation
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"STARE_SANDBOX_ISOLATION must be {_ISOLATION_CHOICES}, got {isolation!r}")
        return cls(max_turns=_env_number(environ, "STARE_TOOL_MAX_TURNS", d.max_turns, int),
                   timeout_s=_env_number(environ, "STARE_TOOL_TIMEOUT_S", d.timeout_s, float),
                   memory_mb=_env_number(environ, "STARE_TOOL_MEMORY_MB", d.memory_mb, int),
                   max_output_chars=_env_number(environ, "STARE_TOOL_MAX_OUTPUT_CHARS", d.max_output_chars, int),
                   format=environ.get("STARE_TOOL_FORMAT") or d.format, isolation=isolation)

    def resolve_isolation(self) -> str:
        """The isolation the tool calls get on this machine (namespaces | basic); ``SandboxError`` (one line) when
        ``isolation`` is ``namespaces`` and there are none. Probed once per process."""
        return resolve_isolation(self.isolation)


def check_tool_isolation(tool_config) -> str:
    """The isolation the tool sandbox gets on this machine (``ToolConfig.resolve_isolation``); ``CliError`` with its
    one line where the asked-for one (``namespaces`` by default) is unavailable. ``stare train`` of the tool-use
    preset checks it too."""
    from ..errors import CliError
    from .sandbox import SandboxError

    try:
        return tool_config.resolve_isolation()
    except SandboxError as exc:
        raise CliError(str(exc)) from None


@dataclass
class ToolCall:
    code: str
    stdout: str
    stderr: str
    error_kind: str | None
    error: str | None
    duration_s: float
    observation: str


@dataclass(frozen=True)
class Action:
    kind: str  # "code" | "answer" | "none"
    code: str | None = None
    answer: str | None = None


def parse_action(text: str) -> Action:
    """What a model turn asks for: run its last closed python block, or give its final boxed answer."""
    from stare.eval.extraction import BOX_COMMAND, extract_boxed

    blocks = list(_CODE_BLOCK.finditer(text))
    last_code = blocks[-1] if blocks else None
    answer = extract_boxed(text)
    last_box = None
    for m in BOX_COMMAND.finditer(text):
        last_box = m.start()
    if answer is not None and (last_code is None or (last_box is not None and last_box > last_code.end())):
        return Action("answer", answer=answer)
    if last_code is not None:
        return Action("code", code=last_code.group(1))
    return Action("none")


def turn_is_complete(text: str) -> bool:
    """Should generation stop here (eval backends): a python block has closed, or the model opened an output
    block itself."""
    return _CODE_BLOCK.search(text) is not None or OUTPUT_FENCE in text


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = f"\n... [{len(text) - limit} characters cut] ...\n"
    head = max(0, (limit - len(marker)) // 2)
    tail = max(0, limit - len(marker) - head)
    return text[:head] + marker + (text[-tail:] if tail else "")


def observation_body(result: SandboxResult, max_chars: int) -> str:
    """What the model sees of one tool call: stdout, then stderr, cut to ``max_chars`` in all, then one line
    naming the failure when the run did not end normally."""
    out, err = result.stdout.rstrip("\n"), result.stderr.rstrip("\n")
    tag = ""
    if result.error_kind and result.error_kind not in ("exception", "syntax"):
        tag = f"[tool error: {result.error_kind}: {result.error}]"
    room = max_chars - len(tag) - (1 if tag else 0) - (1 if out and err else 0)  # parts are joined by newlines
    if out and err:
        out_room = max(room // 2, room - len(err))
        out = _clip(out, out_room)
        err = _clip(err, max(0, room - len(out)))
    else:
        out, err = _clip(out, room), _clip(err, room)
    parts = [p for p in (out, err, tag) if p]
    return "\n".join(parts) if parts else "(no output)"


@dataclass(frozen=True)
class ObservationFormat:
    """How a tool result is put back into the model's context.

    ``plain``: a fenced block in the same text, ```` ```output\\n...\\n``` ````. ``chat``: a user turn of the model's
    chat template (for ChatML ``\\n<|im_start|>user\\n```output ...```<|im_end|>\\n<|im_start|>assistant\\n``), the
    model's own end-of-turn token (``turn_end``) being part of its turn when it ended with it."""

    kind: str
    prefix: str = ""
    suffix: str = ""
    turn_end: str = ""

    def wrap(self, body: str, *, action_text: str = "", ended_turn: bool = True) -> str:
        if self.kind == "plain":
            stripped = action_text.rstrip(" \t")
            lead = "" if stripped.endswith("\n") or not stripped else "\n"
            if stripped.rstrip("\n").endswith(OUTPUT_FENCE):  # the model opened the output block itself
                lead = "" if stripped.endswith("\n") else "\n"
                return f"{lead}{body}\n```\n"
            return f"{lead}{OUTPUT_FENCE}\n{body}\n```\n"
        end = "" if ended_turn else self.turn_end
        return f"{end}{self.prefix}{OUTPUT_FENCE}\n{body}\n```{self.suffix}"

    @property
    def stop_strings(self) -> list[str]:
        """Stop strings for engines that cannot stop on a closing fence (vLLM): plain text stops where the model
        starts to write the output itself; a chat turn ends with the model's end-of-turn token."""
        return [OUTPUT_FENCE] if self.kind == "plain" else []


def plain_format() -> ObservationFormat:
    return ObservationFormat("plain")


_ACTION_SENTINEL = "STAREACTIONSENTINEL7f3a"
_OBS_SENTINEL = "STAREOBSERVATIONSENTINEL9c1e"


def chat_format(tokenizer) -> ObservationFormat | None:
    """The chat wrapper read off the tokenizer's template (a user turn after an assistant turn), or None when
    there is no template or it cannot render that conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _ACTION_SENTINEL},
            {"role": "user", "content": _OBS_SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that does not take this conversation
        return None
    if not isinstance(text, str) or _ACTION_SENTINEL not in text or _OBS_SENTINEL not in text:
        return None
    a = text.index(_ACTION_SENTINEL) + len(_ACTION_SENTINEL)
    o = text.index(_OBS_SENTINEL)
    if o < a:
        return None
    between, suffix = text[a:o], text[o + len(_OBS_SENTINEL):]
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            specials.add(str(added))
    turn_end = next((t for t in sorted(specials, key=len, reverse=True) if t and between.startswith(t)), "")
    return ObservationFormat("chat", prefix=between[len(turn_end):], suffix=suffix, turn_end=turn_end)


def format_for(tokenizer, kind: str = "auto") -> ObservationFormat:
    """``auto``: the chat wrapper when the tokenizer has a usable template, else plain."""
    if kind == "plain":
        return plain_format()
    fmt = chat_format(tokenizer) if tokenizer is not None else None
    if fmt is None:
        if kind == "chat":
            raise ValueError("the tokenizer has no usable chat template; use the plain tool-output format")
        return plain_format()
    return fmt


@dataclass
class ToolEpisode:
    """One sampled answer's tool loop. ``step`` after every model turn; ``score`` at the end."""

    config: ToolConfig = field(default_factory=ToolConfig)
    fmt: ObservationFormat = field(default_factory=plain_format)
    runner: Callable[..., SandboxResult] = run_python
    turns: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)
    done: bool = False
    done_reason: str | None = None  # answer | no_action | max_turns | token_budget | context
    final_text: str | None = None  # the turn that gave the final answer
    answer: str | None = None
    isolation: str | None = None  # the sandbox isolation the tool calls ran with (basic if any did), None: no call

    def step(self, action_text: str, *, ended_turn: bool = True, budget_left: int | None = None,
             context_left: int | None = None) -> str:
        """Take one model turn; return the text to append to the context ('' once the episode is done).

        ``ended_turn``: the turn ended with the model's end-of-turn token (chat format; a turn cut by a stop
        string or a closing fence did not). ``budget_left``: tokens the episode may still add after this turn
        (None: the driver enforces the budget itself). ``context_left``: room left in the model's context after
        this turn (None: unknown); at 0 no tool is run and the episode ends as ``context``."""
        if self.done:
            raise RuntimeError("step() on a finished episode")
        self.turns += 1
        action = parse_action(action_text)
        if action.kind == "answer":
            return self._finish("answer", action_text, action.answer)
        if action.kind == "none":
            return self._finish("no_action")
        if self.turns >= self.config.max_turns:
            return self._finish("max_turns")
        if budget_left is not None and budget_left <= 0:
            return self._finish("token_budget")
        if context_left is not None and context_left <= 0:
            return self._finish("context")
        result = self.runner(action.code, timeout_s=self.config.timeout_s, memory_mb=self.config.memory_mb,
                             max_output_chars=max(self.config.max_output_chars, 1024), isolation=self.config.isolation)
        if result.isolation_used and self.isolation != "basic":
            self.isolation = result.isolation_used
        body = observation_body(result, self.config.max_output_chars)
        feedback = self.fmt.wrap(body, action_text=action_text, ended_turn=ended_turn)
        self.tool_calls.append(ToolCall(action.code, result.stdout, result.stderr, result.error_kind, result.error,
                                        result.duration_s, feedback))
        return feedback

    def stop(self, reason: str = "token_budget") -> None:
        """The driver ended the episode (e.g. no budget left for another turn)."""
        if not self.done:
            self._finish(reason)

    def _finish(self, reason: str, final_text: str | None = None, answer: str | None = None) -> str:
        self.done, self.done_reason, self.final_text, self.answer = True, reason, final_text, answer
        return ""

    def score(self, gold, *, timeout: float = 5.0) -> float:
        """1.0 when the final answer turn's boxed answer equals ``gold`` (math-verify), else 0.0."""
        if self.final_text is None:
            return 0.0
        from stare.eval.scoring import is_correct

        return 1.0 if is_correct(self.final_text, gold, timeout=timeout) else 0.0

    @property
    def tool_errors(self) -> int:
        return sum(1 for c in self.tool_calls if c.error_kind)

    def summary(self) -> dict:
        return {"turns": self.turns, "tool_calls": len(self.tool_calls), "tool_errors": self.tool_errors,
                "done_reason": self.done_reason}

    def transcript(self) -> list[dict]:
        return [asdict(c) for c in self.tool_calls]
