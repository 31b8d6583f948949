"""Where a training turn stops: the OpenRLHF agent file (``--train.agent_func_path``) against an engine that
behaves like vLLM 0.29.0 behind the pinned OpenRLHF's rollout actor.

What the stand-ins copy from the real packages (read from their source):

- OpenRLHF builds the rollout ``SamplingParams`` in ``SamplesGenerator._dispatch_prompts_to_vllm`` with
  ``skip_special_tokens=False``; that real function is run here (with Ray's calls stubbed) to build the
  parameters the agent receives.
- ``SamplingParams`` is a msgspec struct: an unknown keyword is a TypeError; ``stop``/``stop_token_ids`` are
  normalised to lists and ``all_stop_token_ids`` is filled in ``__post_init__``. vLLM silently accepts an unknown
  attribute *assignment* (the struct has a ``__dict__``) and ignores it; the stand-in refuses it, so a misspelt
  field fails here instead of doing nothing on a GPU.
- The scheduler (``v1/core/sched/utils.check_stop``) stops at the tokenizer's EOS (``stop_reason`` None), at any
  ``stop_token_ids`` entry (``stop_reason`` the id; the checkpoint's generation_config EOS ids are added to them),
  or at ``max_tokens`` (``finish_reason`` "length"). The stop token stays in ``token_ids``; the detokenizer leaves
  it out of the text unless ``include_stop_str_in_output`` and writes special tokens into the text when
  ``skip_special_tokens`` is False. A stop string cuts the text (at its end when included, else at its start).
"""
import asyncio
import sys
import types
from types import SimpleNamespace

import pytest

from stare.cli.agent.loop import chat_format, plain_format
from tiny_models import build_tiny_model
from test_tool_agent import AGENT_FILE, CHATML, code

# vLLM 0.29.0's SamplingParams fields with their defaults: one list, the strict stand-in's (tests/vllm_standin.py)
from vllm_standin import SAMPLING_FIELDS as VLLM_FIELDS  # noqa: E402


class StrictSamplingParams:
    def __init__(self, **kw):
        unknown = sorted(set(kw) - set(VLLM_FIELDS))
        if unknown:
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        for name, default in VLLM_FIELDS.items():
            object.__setattr__(self, name, kw.get(name, default))
        object.__setattr__(self, "_all_stop_token_ids", set())
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self._all_stop_token_ids.update(self.stop_token_ids)

    def __setattr__(self, name, value):
        if name not in VLLM_FIELDS:
            raise AttributeError(f"SamplingParams has no field {name!r} (vLLM would ignore it)")
        object.__setattr__(self, name, value)

    @property
    def all_stop_token_ids(self):
        return self._all_stop_token_ids


class VLLMLikeEngine:
    """OpenRLHF's rollout actor ``generate`` over a scripted model: call i continues with ``streams[i]`` (the
    tokens the model would write if nothing stopped it) and stops as vLLM does."""

    def __init__(self, tok, streams, generation_eos=()):
        self.tok, self.streams, self.generation_eos = tok, [list(s) for s in streams], set(generation_eos)
        self.prompts, self.params, self.outputs = [], [], []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        sp = sampling_params
        assert isinstance(sp, StrictSamplingParams), type(sp)
        assert isinstance(sp.max_tokens, int) and sp.max_tokens >= 1
        self.prompts.append(list(prompt_token_ids))
        self.params.append(sp)
        eos = self.tok.eos_token_id
        stop_ids = set(sp.stop_token_ids) | (self.generation_eos - {eos})
        stream = self.streams.pop(0)
        out, finish, reason, text = [], None, None, ""
        for t in stream:
            out.append(t)
            terminated = False
            if t == eos and not sp.ignore_eos:
                finish, reason, terminated = "stop", None, True
            elif t in stop_ids and not sp.ignore_eos:
                finish, reason, terminated = "stop", t, True
            elif len(out) >= sp.max_tokens:
                finish = "length"
            shown = out[:-1] if terminated and not sp.include_stop_str_in_output else out
            text = self.tok.decode(shown, skip_special_tokens=sp.skip_special_tokens)
            # the detokenizer checks stop strings after the scheduler's check (a hit overrides it), once past
            # min_tokens; the earliest-ending stop string wins
            hits = [(text.find(s) + len(s), s) for s in sp.stop if s in text]
            if hits and len(out) > sp.min_tokens:
                end, s = min(hits)
                text = text[:end] if sp.include_stop_str_in_output else text[:end - len(s)]
                finish, reason = "stop", s
            if finish:
                break
        assert finish, "the scripted model ran out of tokens without stopping"
        o = SimpleNamespace(token_ids=out, text=text, finish_reason=finish, stop_reason=reason, logprobs=None)
        self.outputs.append(o)
        return SimpleNamespace(outputs=[o])


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """The tiny BPE tokenizer (EOS ``</s>``, no template) and a ChatML copy whose EOS stays ``</s>`` - the
    checkpoint of a base model after a cold-start SFT: its end-of-turn token is not its EOS."""
    from transformers import AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("tok"))
    plain = AutoTokenizer.from_pretrained(folder)
    chat = AutoTokenizer.from_pretrained(folder)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = CHATML
    assert chat.eos_token == "</s>"
    return plain, chat


@pytest.fixture
def openrlhf(monkeypatch):
    """OpenRLHF's agent loader and its real rollout-parameter builder, importable here with vLLM stubbed (test
    process only)."""

    def stub(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)

    stub("vllm", SamplingParams=StrictSamplingParams, __version__="0.29.0")
    stub("vllm.inputs", TokensPrompt=dict)
    stub("vllm.utils", random_uuid=lambda: "0")
    for mod in [m for m in sys.modules if m.startswith("openrlhf.trainer")]:
        monkeypatch.delitem(sys.modules, mod)
    from openrlhf.trainer.ppo_utils import samples_generator
    from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

    def rollout_params(tok, **generate_kwargs):
        """The SamplingParams OpenRLHF sends to the rollout actors, built by its own code."""
        sent = []

        class Remote:
            def __init__(self, fn):
                self.remote = fn

        actor = SimpleNamespace(get_num_unfinished_requests=Remote(lambda: 0),
                                generate_responses=Remote(lambda **kw: sent.append(kw)))
        monkeypatch.setattr(samples_generator, "ray", SimpleNamespace(get=lambda refs: refs))
        fake_self = SimpleNamespace(
            vllm_engines=[actor], tokenizer=tok,
            args=SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")),
                                 rollout=SimpleNamespace(n_samples_per_prompt=1)))
        samples_generator.SamplesGenerator._dispatch_prompts_to_vllm(fake_self, ["p"], ["l"], **generate_kwargs)
        return sent[0]["sampling_params"]

    return _load_agent_executor, rollout_params, samples_generator.SamplesGenerator


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def run(executor, tok, engine, params, prompt, label, max_length=4096):
    return asyncio.run(executor.execute(prompt, label, params, max_length, tok, engine))


def test_the_stand_ins_refuse_what_vllm_refuses(openrlhf, toks):
    _, rollout_params, _ = openrlhf
    with pytest.raises(TypeError):
        StrictSamplingParams(stop_token_id=[1])
    p = rollout_params(toks[1], temperature=1.0, max_new_tokens=None)
    assert p.skip_special_tokens is False and p.stop == [] and p.stop_token_ids == [] and p.max_tokens is None
    with pytest.raises(AttributeError):
        p.stop_tokens_ids = [1]


def test_a_chat_turn_stops_at_the_end_of_turn_token(openrlhf, toks, monkeypatch):
    """The model closes its code turn with <|im_end|> and, if not stopped, goes on to write a tool output and an
    answer of its own. Today's agent (stop strings only) let that run into the action and scored the made-up
    answer; the turn must end at <|im_end|>, the real tool run, and the next turn answer from its output."""
    load, rollout_params, SamplesGenerator = openrlhf
    monkeypatch.setenv("STARE_TOOL_MAX_TURNS", "4")
    monkeypatch.setenv("STARE_TOOL_TIMEOUT_S", "5")
    tok = toks[1]
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert im_end != eos
    made_up = "\n<|im_start|>user\n```output\n7\n```<|im_end|>\n<|im_start|>assistant\nSo \\boxed{7}"
    turn1 = code("print(2 ** 10)") + "<|im_end|>"
    turn2 = "The answer is \\boxed{1024}.<|im_end|>"
    streams = [ids(tok, turn1 + made_up) + [eos], ids(tok, turn2 + "\n<|im_start|>user\nthanks") + [eos]]
    engine = VLLMLikeEngine(tok, streams, generation_eos=[eos])
    executor = load(AGENT_FILE)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2**10?"}], tokenize=False,
                                     add_generation_prompt=True)
    params = rollout_params(tok, temperature=1.0, max_new_tokens=None)
    out = run(executor, tok, engine, params, prompt, "1024")

    assert [o.finish_reason for o in engine.outputs] == ["stop", "stop"]
    assert [o.stop_reason for o in engine.outputs] == [im_end, im_end]
    assert [o.text for o in engine.outputs] == [turn1, turn2]  # special tokens in the text, as OpenRLHF decodes
    assert out["extra_logs"]["tool_calls"] == 1.0 and out["reward"] == 1.0
    # every turn's action span ends with the end-of-turn token, and the tool output is context
    seq = out["observation_tokens"]
    assert [seq[e - 1] for s, e in out["action_ranges"]] == [im_end, im_end]
    n_prompt = len(ids(tok, prompt))
    feedback = seq[out["action_ranges"][0][1]:out["action_ranges"][1][0]]
    assert tok.decode(feedback, skip_special_tokens=False) == "\n<|im_start|>user\n```output\n1024\n```<|im_end|>\n" \
                                                              "<|im_start|>assistant\n"
    assert engine.prompts[1] == seq[:out["action_ranges"][1][0]] and len(engine.prompts[0]) == n_prompt
    exp = SamplesGenerator._process_response_into_experience(None, out, max_len=4096)
    mask = [0] + exp.action_mask[0].tolist()
    actions = tok.decode([t for t, m in zip(exp.sequences[0].tolist(), mask) if m], skip_special_tokens=False)
    assert actions == turn1 + turn2


def test_stop_ids_are_the_eval_paths(openrlhf, toks):
    """The agent's stop ids equal the eval backend's rule (``ToolUseBackend._end_token_ids``) for a checkpoint
    whose generation_config EOS is the tokenizer's, and hold the end-of-turn token looked up independently."""
    from stare.cli.agent.multiturn import ToolUseBackend

    load, rollout_params, _ = openrlhf
    for tok, fmt in ((toks[1], chat_format(toks[1])), (toks[0], plain_format())):
        executor = load(AGENT_FILE)
        engine = VLLMLikeEngine(tok, [ids(tok, "\\boxed{1}") + [tok.eos_token_id]])
        params = rollout_params(tok, temperature=1.0, max_new_tokens=None)
        run(executor, tok, engine, params, "Q\n", "1")
        sent = engine.params[0]
        inner = SimpleNamespace(model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=tok.eos_token_id)))
        eval_ids = ToolUseBackend._end_token_ids(SimpleNamespace(tokenizer=tok, inner=inner, fmt=fmt))
        assert sorted(sent.stop_token_ids) == eval_ids
        expected = {tok.eos_token_id} | ({tok.convert_tokens_to_ids("<|im_end|>")} if fmt.kind == "chat" else set())
        assert set(sent.stop_token_ids) == expected and expected <= sent.all_stop_token_ids
        assert sent.include_stop_str_in_output is True and sent.skip_special_tokens is False
        assert sent.stop == ([] if fmt.kind == "chat" else ["```output"])
        assert params.stop_token_ids == []  # OpenRLHF's own object is left as it was


def test_a_plain_turn_stops_where_the_output_block_opens(openrlhf, toks, monkeypatch):
    load, rollout_params, _ = openrlhf
    monkeypatch.setenv("STARE_TOOL_TIMEOUT_S", "5")
    tok = toks[0]
    turn1 = code("print(6 * 7)") + "\n```output"
    streams = [ids(tok, turn1 + "\n5\n```\n\\boxed{5}") + [tok.eos_token_id],
               ids(tok, "So \\boxed{42}") + [tok.eos_token_id]]
    engine = VLLMLikeEngine(tok, streams)
    out = run(load(AGENT_FILE), tok, engine, rollout_params(tok, max_new_tokens=None), "Q\n", "42")
    assert engine.outputs[0].text == turn1 and engine.outputs[0].stop_reason == "```output"
    assert engine.outputs[1].text == "So \\boxed{42}</s>" and engine.outputs[1].stop_reason is None
    assert out["reward"] == 1.0 and out["extra_logs"]["tool_calls"] == 1.0


def test_a_turn_cut_by_the_token_limit_is_closed_before_the_tool_output(openrlhf, toks, monkeypatch):
    """A chat turn that closes its code block but is cut by max_tokens (no end-of-turn token) gets <|im_end|> in
    front of the tool output's user turn, so the context stays a well-formed conversation."""
    load, rollout_params, _ = openrlhf
    monkeypatch.setenv("STARE_TOOL_TIMEOUT_S", "5")
    tok = toks[1]
    turn = code("print(3)")
    prompt = "Q\n"
    n_prompt, n_turn = len(ids(tok, prompt)), len(ids(tok, turn))
    engine = VLLMLikeEngine(tok, [ids(tok, turn + " and more words") + [tok.eos_token_id]])
    out = run(load(AGENT_FILE), tok, engine, rollout_params(tok, max_new_tokens=None), prompt, "3",
              max_length=n_prompt + n_turn)
    assert engine.outputs[0].finish_reason == "length" and engine.outputs[0].text == turn
    end = out["action_ranges"][0][1]
    feedback = tok.decode(out["observation_tokens"][end:], skip_special_tokens=False)
    assert feedback.startswith("<|im_end|>\n<|im_start|>user\n```output\n3\n```")
