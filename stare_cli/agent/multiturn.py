"""``stare eval --tools python``: the tool loop on top of an eval backend (HF or vLLM).

``ToolUseBackend(inner)`` has the harness's backend interface. ``generate_many(requests, proto)`` runs the episodes
of every sample of every problem in lockstep (``generate(prompt, n, proto, seed)``: one problem's): each round
generates one turn for every unfinished sample (on vLLM in one batch, every sample with its own seed; on HF one
batch per problem), runs the tool calls (in parallel threads, one sandbox each), appends the wrapped observations
and goes again; a problem is handed back when its last episode ends.

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
        """The n samples of one problem (``generate_many`` with one request); ``PromptTooLong`` when the prompt
        does not fit the context."""
        ((_, result),) = list(self.generate_many([(None, prompt, n, seed)], proto))
        if isinstance(result, PromptTooLong):
            raise result
        return result

    def generate_many(self, requests, proto):
        """Yield ``(key, samples)`` for every ``(key, prompt, n, seed)`` of ``requests``, as each problem's n
        episodes end: every round generates one turn for every unfinished sample of every problem (one vLLM call
        for all of them; on HF one batch per problem, each seeded as alone), runs their tool calls and goes again.
        A prompt that does not fit the context is yielded as ``PromptTooLong`` at once."""
        tok = self.tokenizer
        context = self.context_length
        live: list[_Problem] = []
        for key, prompt, n, seed in requests:
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            if context is not None and len(prompt_ids) >= context:
                yield key, PromptTooLong(len(prompt_ids), context)
                continue
            live.append(_Problem(key, n, seed, prompt_ids, self.config, self.fmt))
        rnd = 0  # every problem starts at round 0 together, so the round is each problem's own
        with ThreadPoolExecutor(max_workers=max(1, min(sum(q.n for q in live), 8))) as pool:
            while live:
                for q in live:
                    q.stop_out_of_room(proto.max_tokens, context)
                rows = [(q, i) for q in live for i in q.active()]
                if rows:
                    budgets = [q.room(i, proto.max_tokens, context) for q, i in rows]
                    turns = self._turns(rows, budgets, proto, rnd)
                    rnd += 1
                    for (q, i), budget, (ids, text, ended) in zip(rows, budgets, turns):
                        q.take_turn(i, ids, text, ended, budget, self.fmt.turn_end)

                    def step(row, text, ended):
                        q, i = row
                        return q.episodes[i].step(text, ended_turn=ended,
                                                  budget_left=proto.max_tokens - q.used[i],
                                                  context_left=None if context is None else context - len(q.ctx[i]))

                    feedbacks = list(pool.map(lambda a: step(*a), [(row, t, e) for row, (_, t, e) in zip(rows, turns)]))
                    for (q, i), fb in zip(rows, feedbacks):
                        if fb:
                            q.take_feedback(i, fb, tok, proto.max_tokens, context)
                for q in [q for q in live if not q.active()]:
                    live.remove(q)
                    yield q.key, q.samples(self.isolation)

    def _turns(self, rows, budgets, proto, rnd: int):
        """One turn for each ``(problem, sample)`` row: ``(token ids incl. a closing end token, text,
        ended_with_end_token)``. vLLM in one call, each row with its own seed; HF one batch per problem, seeded with
        the problem's round seed (as the problem alone)."""
        if self.inner.name != "hf":
            return self._vllm_turn([q.ctx[i] for q, i in rows], budgets, proto,
                                   [turn_seed(q.seed + i, rnd) for q, i in rows])
        out: list = [None] * len(rows)
        for q in dict.fromkeys(q for q, _ in rows):
            idx = [j for j, (p, _) in enumerate(rows) if p is q]
            got = self._hf_turn([q.ctx[rows[j][1]] for j in idx], [budgets[j] for j in idx], proto,
                                turn_seed(q.seed, rnd))
            for j, turn in zip(idx, got):
                out[j] = turn
        return out

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


class _Problem:
    """One problem's n episodes in ``ToolUseBackend.generate_many``: their contexts, transcripts and token counts."""

    def __init__(self, key, n: int, seed: int, prompt_ids: list[int], config: ToolConfig, fmt):
        self.key, self.n, self.seed = key, n, seed
        self.episodes = [ToolEpisode(config=config, fmt=fmt) for _ in range(n)]
        self.ctx = [list(prompt_ids) for _ in range(n)]
        self.transcript = [""] * n
        self.model_tokens = [0] * n
        self.used = [0] * n  # tokens after the prompt: model turns (with their end tokens) + tool output
        self.tool_tokens = [0] * n
        self.cut = [False] * n  # the sample's last turn used all the room it had

    def active(self) -> list[int]:
        return [i for i in range(self.n) if not self.episodes[i].done]

    def room(self, i: int, max_tokens: int, context) -> int:
        """Tokens sample i may still add: its budget, and the model's context."""
        left = max_tokens - self.used[i]
        return left if context is None else min(left, context - len(self.ctx[i]))

    def stop_out_of_room(self, max_tokens: int, context) -> None:
        for i in self.active():
            if max_tokens - self.used[i] <= 0:
                self.episodes[i].stop("token_budget")
            elif context is not None and len(self.ctx[i]) >= context:  # a tool output filled the context
                self.episodes[i].stop("context")

    def take_turn(self, i: int, ids, text: str, ended: bool, budget: int, turn_end: str) -> None:
        self.cut[i] = not ended and len(ids) >= budget
        self.ctx[i] += ids
        self.used[i] += len(ids)
        self.model_tokens[i] += len(ids) - (1 if ended else 0)
        self.transcript[i] += text + (turn_end if ended else "")

    def take_feedback(self, i: int, fb: str, tok, max_tokens: int, context) -> None:
        fb_ids = tok(fb, add_special_tokens=False)["input_ids"]
        # the budget (and the context) holds tool output too: an observation that does not fit is cut to the room
        # left and ends the sample as truncated (nothing would follow it)
        room_budget = max_tokens - self.used[i]
        room_context = None if context is None else context - len(self.ctx[i])
        fits = room_budget if room_context is None else min(room_budget, room_context)
        if len(fb_ids) > fits:
            fb_ids = fb_ids[:max(fits, 0)]
            fb = tok.decode(fb_ids)
            self.episodes[i].stop("context" if room_context is not None and room_context < room_budget
                                  else "token_budget")
        self.ctx[i] += fb_ids
        self.used[i] += len(fb_ids)
        self.tool_tokens[i] += len(fb_ids)
        self.transcript[i] += fb

    def samples(self, isolation: str) -> list[tuple[str, int, dict]]:
        out = []
        for i, ep in enumerate(self.episodes):
            truncated = self.cut[i] or ep.done_reason in ("token_budget", "context")
            extra = {"answer_text": ep.final_text, **ep.summary(), "tool_output_tokens": self.tool_tokens[i],
                     "truncated": truncated, "sandbox_isolation": ep.isolation or isolation}
            out.append((self.transcript[i], self.model_tokens[i], extra))
        return out
