"""The pinned OpenRLHF's agent: multi-turn math with a sandboxed Python tool.

Pass this file's path as ``--train.agent_func_path`` (``python -c "import stare.cli.agent.python_agent as m;
print(m.__file__)"``). OpenRLHF loads it with ``importlib`` as a loose module named ``agent_module`` and calls
``AgentExecutor()``; hence absolute imports only, and settings from the environment, since its argument parser
rejects unknown flags (set them in the Ray runtime env so the rollout actors see them): ``STARE_TOOL_MAX_TURNS``,
``STARE_TOOL_TIMEOUT_S``, ``STARE_TOOL_MEMORY_MB``, ``STARE_TOOL_MAX_OUTPUT_CHARS``, ``STARE_TOOL_FORMAT`` and
``STARE_SANDBOX_ISOLATION``, read by ``stare.cli.agent.loop.ToolConfig.from_env`` (meanings and defaults:
docs/tool-use.md). The isolation (``namespaces`` unless set otherwise) is checked when the rollout actor loads the
agent and fails there, in one line, where the machine has none; the isolation used is printed once per rollout
actor and logged per sample.

How OpenRLHF uses what ``step`` returns (``openrlhf/utils/agent.py``, ``MultiTurnAgentExecutor.execute``): each
generated turn's token span is appended to ``action_ranges``; ``environment_feedback`` is tokenized and appended
*after* that span, outside every range; ``SamplesGenerator._process_response_into_experience`` sets the action
mask to 1 on the ranges only, so the tool output is context, never an action. ``rewards`` are summed over the
steps (here 0 until the last step, then the final answer's math-verify score); ``scores`` of the last step feed
dynamic filtering; ``extra_logs`` of the last step are logged (turns, tool calls, tool errors, answered, and
``tool_sandbox_namespaces``: 1.0 when the sample's tool calls ran in the sandbox's namespaces, 0.0 for the
fallback). ``_process_response_into_experience`` turns each extra log into ``torch.tensor([value])`` in the
experience's ``info`` (numbers only), which the actor logs as ``train/<key>``, a mean over samples: a run logs
``train/tool_sandbox_namespaces`` 1.0 when every sample was isolated by namespaces.

Where a turn stops (the same rule as ``stare eval --tools python``, ``stare.cli.agent.multiturn``): at the
tokenizer's EOS and at the chat template's end-of-turn token (``<|im_end|>`` for ChatML), both passed to vLLM as
``stop_token_ids``; plain text also at ```` ```output ````. vLLM by itself stops only at the EOS of the tokenizer
and of the checkpoint's ``generation_config``, which after a cold-start SFT of a base model is often not the
end-of-turn token: without the stop id a turn would run past ``<|im_end|>`` into a made-up tool output and answer.
The stop token or string is kept in the text (``include_stop_str_in_output``; OpenRLHF decodes with
``skip_special_tokens=False``), so text and token ids agree; a turn that ended at a stop token is closed, one
cut by the token limit gets the end-of-turn token in front of the tool output.
"""
from __future__ import annotations

import asyncio
import contextvars
from copy import deepcopy

import torch

from stare.cli.agent.loop import ObservationFormat, ToolConfig, ToolEpisode, format_for
from stare.cli.openrlhf_backend.compat import AgentInstanceBase, MultiTurnAgentExecutor

# the current sample's turn recorder; execute() sets it, the agent instance it creates reads it (each sample runs in
# its own asyncio task, so concurrent samples see their own)
_TURNS: contextvars.ContextVar["_TurnRecorder | None"] = contextvars.ContextVar("stare_agent_turns", default=None)


def end_token_ids(hf_tokenizer, fmt: ObservationFormat) -> list[int]:
    """The token ids that end a model turn: the tokenizer's EOS and the chat format's end-of-turn token (the eval
    path adds the checkpoint's generation_config EOS too, which vLLM already stops at by itself)."""
    ids = set()
    eos = getattr(hf_tokenizer, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if fmt.turn_end:
        end = hf_tokenizer.convert_tokens_to_ids(fmt.turn_end)
        if isinstance(end, int) and end != getattr(hf_tokenizer, "unk_token_id", None):
            ids.add(end)
    return sorted(i for i in ids if isinstance(i, int))


class _TurnRecorder:
    """The rollout engine as one sample sees it: passes every call through and remembers whether the last turn
    ended at a stop token (finish_reason "stop" with a stop id as its last token, as the eval path decides)."""

    def __init__(self, engine, stop_ids):
        self._engine, self._stop_ids, self.ended_turn = engine, frozenset(stop_ids), True

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        out = await self._engine.generate(prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data)
        o = out.outputs[0]
        ids = list(o.token_ids)
        self.ended_turn = getattr(o, "finish_reason", None) == "stop" and bool(ids) and ids[-1] in self._stop_ids
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


class PythonToolAgent(AgentInstanceBase):
    """One sample's episode. OpenRLHF makes one instance per sample, with no arguments."""

    fmt: ObservationFormat | None = None  # set on the subclass the executor binds to its tokenizer
    config: ToolConfig | None = None
    isolation: str | None = None  # the sandbox isolation the executor resolved (namespaces | basic)

    def __init__(self, *args, **kwargs):
        config = self.config or ToolConfig.from_env()
        self.episode = ToolEpisode(config=config, fmt=self.fmt or ObservationFormat("plain"))
        self.isolation = self.isolation or config.resolve_isolation()
        self.label = None
        self._turns = _TURNS.get()

    async def reset(self, states: dict, **kwargs):
        self.label = states.get("label")
        return {"observation": states["observation"]}

    async def step(self, state_dict: dict, **kwargs):
        action_text = state_dict["action_text"]
        if self.label is None:
            self.label = state_dict.get("label")
        ended = self._turns.ended_turn if self._turns is not None else True
        feedback = await asyncio.to_thread(self.episode.step, action_text, ended_turn=ended)
        reward = 0.0
        if self.episode.done:
            reward = await asyncio.to_thread(self.episode.score, self.label)
        ep = self.episode
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": feedback,
            "done": ep.done,
            "extra_logs": {"tool_turns": float(ep.turns), "tool_calls": float(len(ep.tool_calls)),
                           "tool_errors": float(ep.tool_errors), "tool_answered": float(ep.done_reason == "answer"),
                           "tool_sandbox_namespaces": float((ep.isolation or self.isolation) == "namespaces")},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    """What ``--train.agent_func_path`` loads. Binds the agent to the tokenizer's observation format on first use,
    and stops every turn where the eval path does: ``stop_token_ids`` (EOS and end-of-turn token) and, for the
    plain format, the ```` ```output ```` stop string."""

    def __init__(self):
        super().__init__(PythonToolAgent)
        self.config = ToolConfig.from_env()  # a bad setting fails when the rollout actor starts, not mid-run
        self.isolation = self.config.resolve_isolation()  # so does a sandbox without its isolation (one line)
        print(f"stare tool agent: sandbox isolation {self.isolation} (STARE_SANDBOX_ISOLATION="
              f"{self.config.isolation})", flush=True)
        self._bound = None
        self._stop_ids: list[int] = []

    def _bind(self, hf_tokenizer):
        if self._bound is None:
            fmt = format_for(hf_tokenizer, self.config.format)
            self._bound = type("BoundPythonToolAgent", (PythonToolAgent,),
                               {"fmt": fmt, "config": self.config, "isolation": self.isolation})
            self.agent_instance_cls = self._bound
            self._stop_ids = end_token_ids(hf_tokenizer, fmt)
        return self._bound.fmt

    def turn_params(self, sampling_params, fmt: ObservationFormat):
        """A copy of OpenRLHF's sampling parameters that stops turns as the eval path does."""
        params = deepcopy(sampling_params)
        stops = fmt.stop_strings
        if stops:
            existing = getattr(params, "stop", None) or []
            params.stop = list(existing if isinstance(existing, (list, tuple)) else [existing]) + stops
        existing_ids = list(getattr(params, "stop_token_ids", None) or [])
        params.stop_token_ids = existing_ids + [i for i in self._stop_ids if i not in existing_ids]
        # vLLM builds this set (the ids masked until min_tokens) when the parameters are made, not on assignment
        all_ids = getattr(params, "all_stop_token_ids", None)
        if isinstance(all_ids, set):
            all_ids.update(self._stop_ids)
        # keep the stop token or string in the text, so the text and the token ids (which hold it) agree
        params.include_stop_str_in_output = True
        return params

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        fmt = self._bind(hf_tokenizer)
        sampling_params = self.turn_params(sampling_params, fmt)
        turns = _TurnRecorder(llm_engine, self._stop_ids)
        token = _TURNS.set(turns)
        try:
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, turns, images)
        finally:
            _TURNS.reset(token)
