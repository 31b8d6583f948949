"""OpenRLHF 0.11.2 agent: multi-turn math with a sandboxed Python tool.

Pass this file's path as ``--train.agent_func_path`` (``python -c "import stare.cli.agent.python_agent as m;
print(m.__file__)"``). OpenRLHF loads it with ``importlib`` as a loose module named ``agent_module`` and calls
``AgentExecutor()``; hence absolute imports only, and settings from the environment, since its argument parser
rejects unknown flags (set them in the Ray runtime env so the rollout actors see them):

- ``STARE_TOOL_MAX_TURNS`` (default 4): model turns per sample (tool calls <= turns - 1)
- ``STARE_TOOL_TIMEOUT_S`` (10): wall clock per tool call; ``STARE_TOOL_MEMORY_MB`` (1024): memory per call
- ``STARE_TOOL_MAX_OUTPUT_CHARS`` (1024): tool output shown to the model per call
- ``STARE_TOOL_FORMAT`` (auto): ``chat`` (tool output as a user turn of the tokenizer's chat template; the model
  ends its turn with its end-of-turn token), ``plain`` (a ```` ```output ```` block in the same text; generation
  stops at ```` ```output ````), ``auto`` (chat when the tokenizer has a template)
- ``STARE_SANDBOX_ISOLATION`` (auto): see ``stare.cli.agent.sandbox``

How OpenRLHF uses what ``step`` returns (``openrlhf/utils/agent.py``, ``MultiTurnAgentExecutor.execute``): each
generated turn's token span is appended to ``action_ranges``; ``environment_feedback`` is tokenized and appended
*after* that span, outside every range; ``SamplesGenerator._process_response_into_experience`` sets the action
mask to 1 on the ranges only, so the tool output is context, never an action. ``rewards`` are summed over the
steps (here 0 until the last step, then the final answer's math-verify score); ``scores`` of the last step feed
dynamic filtering; ``extra_logs`` of the last step are logged (turns, tool calls, tool errors, answered).
"""
from __future__ import annotations

import asyncio
from copy import deepcopy

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from stare.cli.agent.loop import ObservationFormat, ToolConfig, ToolEpisode, format_for


class PythonToolAgent(AgentInstanceBase):
    """One sample's episode. OpenRLHF makes one instance per sample, with no arguments."""

    fmt: ObservationFormat | None = None  # set on the subclass the executor binds to its tokenizer
    config: ToolConfig | None = None

    def __init__(self, *args, **kwargs):
        self.episode = ToolEpisode(config=self.config or ToolConfig.from_env(),
                                   fmt=self.fmt or ObservationFormat("plain"))
        self.label = None

    async def reset(self, states: dict, **kwargs):
        self.label = states.get("label")
        return {"observation": states["observation"]}

    async def step(self, state_dict: dict, **kwargs):
        action_text = state_dict["action_text"]
        if self.label is None:
            self.label = state_dict.get("label")
        feedback = await asyncio.to_thread(self.episode.step, action_text)
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
                           "tool_errors": float(ep.tool_errors), "tool_answered": float(ep.done_reason == "answer")},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    """What ``--train.agent_func_path`` loads. Binds the agent to the tokenizer's observation format on first use
    and, for the plain format, adds the ```` ```output ```` stop string to the sampling parameters."""

    def __init__(self):
        super().__init__(PythonToolAgent)
        self.config = ToolConfig.from_env()  # a bad setting fails when the rollout actor starts, not mid-run
        self._bound = None

    def _bind(self, hf_tokenizer):
        if self._bound is None:
            fmt = format_for(hf_tokenizer, self.config.format)
            self._bound = type("BoundPythonToolAgent", (PythonToolAgent,), {"fmt": fmt, "config": self.config})
            self.agent_instance_cls = self._bound
        return self._bound.fmt

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        fmt = self._bind(hf_tokenizer)
        stops = fmt.stop_strings
        if stops:
            sampling_params = deepcopy(sampling_params)
            existing = getattr(sampling_params, "stop", None) or []
            sampling_params.stop = list(existing if isinstance(existing, (list, tuple)) else [existing]) + stops
            # keep the stop string in the text, so the text and the token ids (which hold it) agree
            sampling_params.include_stop_str_in_output = True
        return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
