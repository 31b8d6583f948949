"""``stare eval --tools python``: the tool loop on top of an eval backend (HF or vLLM).

``ToolUseBackend(inner)`` has the harness's backend interface. ``generate(prompt, n, proto, seed)`` runs the n
samples' episodes in lockstep: each round generates one turn for every unfinished sample in one batch, runs the
tool calls (in parallel threads, one sandbox each), appends the wrapped observations and goes again.

- HF backend: a turn ends at EOS (or the chat format's end-of-turn token), when a ```` ```python ```` block
  closes, or when the model opens an ```` ```output ```` block itself.
- vLLM backend: stop strings cannot express "a python block closed", so a turn ends as in training
  (``python_agent.py``): at EOS / end-of-turn in the chat format, at ```` ```output ```` in the plain one.

The token budget (``proto.max_tokens``) covers everything after the prompt, model turns and tool output alike,
as OpenRLHF's ``max_len`` does. The model's context (the inner backend's ``context_length``) bounds each turn
too: a sample whose context is full ends (``done_reason`` ``context``) while the others go on, since vLLM refuses a
whole batch when one prompt fills the context; a prompt that does not fit at all raises ``PromptTooLong``. Each
sample returns ``(transcript, model_tokens, extra)``: the transcript holds turns and observations; ``extra`` has
``answer_text`` (the final answer turn, the only text scored), ``turns``, ``tool_calls``, ``tool_errors``,
``tool_output_tokens``, ``done_reason``, ``truncated`` (the token budget or the context cut the sample) and
``sandbox_isolation`` (what its tool calls ran in: ``namespaces``, or ``basic`` if any call fell back; a sample
without a call gets the isolation the sandbox resolved to here).

The sandbox's isolation is resolved when the backend is made (``ToolConfig.isolation``, by default ``namespaces``:
``SandboxError``, one line, where this machine has none).

Seeds: turn 0 of sample j draws from the harness's sample seed ``seed + j``, later turns from
``stare.eval.protocols.turn_seed`` (never a sample seed); the HF backend seeds a round's batch with
``turn_seed(seed, round)``.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from stare.eval.backends import PromptTooLong
from stare.eval.protocols import is_greedy, turn_seed

from .loop import TOOL_INSTRUCTION, ToolConfig, ToolEpisode, format_for, turn_is_complete

__all__ = ["ToolUseBackend", "TOOLS"]

TOOLS = ("python",)


class ToolUseBackend:
    def __init__(self, inner, config: ToolConfig | None = None, tool: str = "python"):
        if tool not in TOOLS:
            raise ValueError(f"unknown tool {tool!r}; valid tools: {', '.join(TOOLS)}")
        if inner.name not in ("hf", "vllm"):
            raise ValueError(f"--tools works with the hf and vllm backends, not {inner.name!r}")
        self.inner = inner
        self.name = inner.name
        self.tokenizer = inner.tokenizer
        self.config = config or ToolConfig()
        self.isolation = self.config.resolve_isolation()  # namespaces, or fail (unless auto/basic was asked for)
        self.fmt = format_for(self.tokenizer, self.config.format)
        self.tools_info = {"tool": tool, "format": self.fmt.kind, "max_turns": self.config.max_turns,
                           "timeout_s": self.config.timeout_s, "memory_mb": self.config.memory_mb,
                           "max_output_chars": self.config.max_output_chars, "instruction": TOOL_INSTRUCTION}
        self._stop_ids = self._end_token_ids()
        self.context_length = getattr(inner, "context_length", None)

    def _end_token_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = set()
        gen_cfg = getattr(getattr(self.inner, "model", None), "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        ids.add(tok.eos_token_id)
        if self.fmt.turn_end:
            end = tok.convert_tokens_to_ids(self.fmt.turn_end)
            if isinstance(end, int) and end != getattr(tok, "unk_token_id", None):
                ids.add(end)
        return sorted(i for i in ids if isinstance(i, int))

    def prompt_text(self, problem: str, instruction: str) -> str:
        return self.inner.prompt_text(problem, f"{instruction} {TOOL_INSTRUCTION}")

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------------------------

    def generate(self, prompt: str, n: int, proto, seed: int) -> list[tuple[str, int, dict]]:
        tok = self.tokenizer
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        context = self.context_length
        if context is not None and len(prompt_ids) >= context:
            raise PromptTooLong(len(prompt_ids), context)

        def room(i):  # tokens sample i may still add: its budget, and the model's context
            left = proto.max_tokens - used[i]
            return left if context is None else min(left, context - len(ctx[i]))

        episodes = [ToolEpisode(config=self.config, fmt=self.fmt) for _ in range(n)]
        ctx = [list(prompt_ids) for _ in range(n)]
        transcript = [""] * n
        model_tokens = [0] * n
        used = [0] * n  # tokens after the prompt: model turns (with their end tokens) + tool output
        tool_tokens = [0] * n
        cut = [False] * n  # the sample's last turn used all the room it had
        rnd = 0
        with ThreadPoolExecutor(max_workers=max(1, min(n, 8))) as pool:
            while True:
                active = [i for i in range(n) if not episodes[i].done]
                for i in list(active):
                    if proto.max_tokens - used[i] <= 0:
                        episodes[i].stop("token_budget")
                        active.remove(i)
                    elif context is not None and len(ctx[i]) >= context:  # a tool output filled the context
                        episodes[i].stop("context")
                        active.remove(i)
                if not active:
                    break
                budgets = [room(i) for i in active]
                turns = self._turn([ctx[i] for i in active], budgets, proto,
                                   [turn_seed(seed + i, rnd) for i in active], turn_seed(seed, rnd))
                rnd += 1
                for i, budget, (ids, text, ended) in zip(active, budgets, turns):
                    cut[i] = not ended and len(ids) >= budget
                    ctx[i] += ids
                    used[i] += len(ids)
                    model_tokens[i] += len(ids) - (1 if ended else 0)
                    transcript[i] += text + (self.fmt.turn_end if ended else "")

                def step(i, text, ended):
                    return episodes[i].step(text, ended_turn=ended, budget_left=proto.max_tokens - used[i],
                                            context_left=None if context is None else context - len(ctx[i]))

                feedbacks = list(pool.map(lambda a: step(*a), [(i, t, e) for i, (_, t, e) in zip(active, turns)]))
                for i, fb in zip(active, feedbacks):
                    if fb:
                        fb_ids = tok(fb, add_special_tokens=False)["input_ids"]
                        # the budget (and the context) holds tool output too: an observation that does not fit
                        # is cut to the room left and ends the sample as truncated (nothing would follow it)
                        room_budget = proto.max_tokens - used[i]
                        room_context = None if context is None else context - len(ctx[i])
                        fits = room_budget if room_context is None else min(room_budget, room_context)
                        if len(fb_ids) > fits:
                            fb_ids = fb_ids[:max(fits, 0)]
                            fb = tok.decode(fb_ids)
                            episodes[i].stop("context" if room_context is not None and room_context < room_budget
                                             else "token_budget")
                        ctx[i] += fb_ids
                        used[i] += len(fb_ids)
                        tool_tokens[i] += len(fb_ids)
                        transcript[i] += fb
        out = []
        for i, ep in enumerate(episodes):
            truncated = cut[i] or ep.done_reason in ("token_budget", "context")
            extra = {"answer_text": ep.final_text, **ep.summary(), "tool_output_tokens": tool_tokens[i],
                     "truncated": truncated, "sandbox_isolation": ep.isolation or self.isolation}
            out.append((transcript[i], model_tokens[i], extra))
        return out

    def _turn(self, seqs, budgets, proto, row_seeds, batch_seed):
        """One generated turn per sequence: ``(token ids incl. a closing end token, text, ended_with_end_token)``.
        vLLM seeds each sequence (``row_seeds``), HF the batch (``batch_seed``)."""
        if self.inner.name == "hf":
            return self._hf_turn(seqs, budgets, proto, batch_seed)
        return self._vllm_turn(seqs, budgets, proto, row_seeds)

    def _finish_row(self, ids: list[int], budget: int, stopped_by_fence: bool):
        ended = False
        if not stopped_by_fence:
            cut = next((j for j, t in enumerate(ids) if t in self._stop_ids), None)
            if cut is not None:
                ids, ended = ids[:cut + 1], True
        if len(ids) > budget:
            ids, ended = ids[:budget], False
        body = ids[:-1] if ended else ids
        return ids, self.tokenizer.decode(body, skip_special_tokens=True), ended

    def _hf_turn(self, seqs, budgets, proto, seed):
        torch = self.inner.torch
        tok = self.tokenizer
        from transformers import StoppingCriteria, StoppingCriteriaList

        pad = tok.pad_token_id if tok.pad_token_id is not None else self._stop_ids[0]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[b, width - len(s):] = 1
        stopped_at: list[int | None] = [None] * len(seqs)

        class FenceStop(StoppingCriteria):
            """Per row: stop once the new text closes a python block (checked when a token with a backtick
            arrives, so decoding stays rare)."""

            def __call__(self, input_ids, scores, **kwargs):
                done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
                for b in range(input_ids.shape[0]):
                    if stopped_at[b] is not None:
                        done[b] = True
                        continue
                    if "`" in tok.decode(input_ids[b, -1:].tolist()):
                        new = input_ids[b, width:].tolist()
                        if turn_is_complete(tok.decode(new, skip_special_tokens=True)):
                            stopped_at[b] = len(new)
                            done[b] = True
                return done

        sampling = not is_greedy(proto)
        torch.manual_seed(seed)
        device = self.inner.device
        with torch.no_grad():
            out = self.inner.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=sampling,
                max_new_tokens=max(budgets), temperature=proto.temperature if sampling else None,
                top_p=proto.top_p if sampling else None, top_k=0 if sampling else None, pad_token_id=pad,
                eos_token_id=self._stop_ids, stopping_criteria=StoppingCriteriaList([FenceStop()]))
        rows = []
        for b, row in enumerate(out[:, width:].tolist()):
            fence = stopped_at[b] is not None
            rows.append(self._finish_row(row[:stopped_at[b]] if fence else row, budgets[b], fence))
        return rows

    def _vllm_turn(self, seqs, budgets, proto, seeds):
        sampling = not is_greedy(proto)
        make = self.inner._sampling_params
        params = [make(n=1, temperature=proto.temperature, top_p=proto.top_p if sampling else 1.0, max_tokens=budget,
                       seed=seed, stop=self.fmt.stop_strings or None, include_stop_str_in_output=True,
                       stop_token_ids=self._stop_ids)
                  for seed, budget in zip(seeds, budgets)]
        requests = self.inner.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        rows = []
        for budget, req in zip(budgets, requests):
            o = req.outputs[0]
            ids = list(o.token_ids)
            ended = bool(ids) and getattr(o, "finish_reason", None) == "stop" and ids[-1] in self._stop_ids
            if len(ids) > budget:
                ids, ended = ids[:budget], False
            rows.append((ids, o.text, ended))
        return rows
