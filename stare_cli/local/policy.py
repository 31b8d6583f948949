"""Policies for the local engine: Hugging Face causal LMs, a character tokenizer, sampling and log-probs.

``tiny-cpu`` builds a small Llama from a config (about 0.1M parameters) with a character-level tokenizer made
with the ``tokenizers`` library; both are saved with ``save_pretrained`` so every run directory loads with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

Batches are left-padded prompts followed by sampled responses. A response's action tokens run up to and
including its end-of-sequence token; everything after is padding (mask 0).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# transformers imports DeepSpeed (through accelerate) when it is installed, and DeepSpeed's accelerator
# auto-detection warns "Setting accelerator to CPU" in every process on a machine without a GPU. Naming the
# accelerator it would pick anyway, before transformers is first imported (here: every local module that uses
# transformers goes through this one), keeps that one warning quiet; the local engine never uses DeepSpeed, and a
# GPU machine or a user's own DS_ACCELERATOR is left alone.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
SEPARATOR = ">"


def build_char_tokenizer(charset: str) -> PreTrainedTokenizerFast:
    """One token per character of ``charset`` plus the separator and the special tokens."""
    chars = sorted(set(charset + SEPARATOR))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_tiny_model(vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                     max_positions: int = 64, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_policy(path: str | Path, device: torch.device | str = "cpu"):
    """Model (on ``device``) and tokenizer saved in ``path`` (any run's checkpoint or final folder, saved on any
    device: ``from_pretrained`` reads the weights to CPU first)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return model, tokenizer


@dataclass
class Rollout:
    """A batch of prompts and sampled responses."""

    sequences: torch.Tensor  # [B, P + R] token ids
    attention_mask: torch.Tensor  # [B, P + R] 1 on real tokens (prompt left padding is 0)
    prompt_len: int  # P
    action_mask: torch.Tensor  # [B, R] 1 on the response's action tokens
    texts: list[str]  # decoded responses (without end-of-sequence)

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len:]

    def select(self, rows: torch.Tensor | list[int]) -> "Rollout":
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.sequences.device)
        return Rollout(self.sequences[idx], self.attention_mask[idx], self.prompt_len, self.action_mask[idx],
                       [self.texts[i] for i in idx.tolist()])


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts with possibly different prompt and response widths (re-padding both sides)."""
    P = max(r.prompt_len for r in parts)
    R = max(r.responses.shape[1] for r in parts)
    dev = parts[0].sequences.device
    seqs, attn, acts, texts = [], [], [], []
    for r in parts:
        lp, rr = P - r.prompt_len, R - r.responses.shape[1]
        B = r.sequences.shape[0]
        seqs.append(torch.cat([torch.full((B, lp), pad_id, device=dev), r.sequences,
                               torch.full((B, rr), pad_id, device=dev)], 1))
        attn.append(torch.cat([torch.zeros(B, lp, dtype=torch.long, device=dev), r.attention_mask,
                               torch.zeros(B, rr, dtype=torch.long, device=dev)], 1))
        acts.append(torch.cat([r.action_mask, torch.zeros(B, rr, dtype=r.action_mask.dtype, device=dev)], 1))
        texts += r.texts
    return Rollout(torch.cat(seqs), torch.cat(attn), P, torch.cat(acts), texts)


def encode_prompts(tokenizer, prompts: list[str], *, chat: bool = False,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask [B, P] (int64, on ``device``). Character tasks end the prompt
    with the separator."""
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    else:
        texts = [tokenizer.bos_token + p + SEPARATOR for p in prompts]
    enc = tokenizer(texts, padding=True, add_special_tokens=False)
    return (torch.tensor(enc["input_ids"], dtype=torch.long, device=device),
            torch.tensor(enc["attention_mask"], dtype=torch.long, device=device))


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def sample(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           temperature: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
           repeats: int = 1) -> Rollout:
    """Sample ``repeats`` responses per prompt row (rows ``i * repeats`` .. ``(i + 1) * repeats - 1`` of the rollout
    answer prompt ``i``), with a KV cache, on the prompts' device (``generator`` must be on that device too).

    The prompts are read once (the prefill runs on the distinct prompts, then its cache is repeated), and the prefill
    projects only its last position onto the vocabulary (``logits_to_keep=1``): the others predict prompt tokens,
    which nothing reads. Passing repeated rows with ``repeats=1`` samples the same way, with a longer prefill."""
    from transformers import DynamicCache

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    cache = DynamicCache()
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=_positions(prompt_mask),
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    if repeats != 1:
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(repeats, 0), prompt_mask.repeat_interleave(repeats, 0)
        cache.batch_repeat_interleave(repeats)
        out.logits = out.logits.repeat_interleave(repeats, 0)
    B, P = prompt_ids.shape
    attn = prompt_mask.clone()
    next_pos = attn.sum(-1, keepdim=True)
    tokens = []
    done = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if greedy:
            tok = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        tokens.append(tok)
        done = done | (tok == eos)
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=attn.device)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos, past_key_values=cache,
                    use_cache=True)
        next_pos = next_pos + 1
    responses = torch.stack(tokens, dim=1)
    # action tokens: up to and including the first end-of-sequence token
    is_eos = responses == eos
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    action_mask = (~after_eos).long()
    full_attn = torch.cat([prompt_mask, action_mask], dim=1)
    texts = []
    for row, m in zip(responses.tolist(), action_mask.tolist()):
        ids = [t for t, keep in zip(row, m) if keep and t != eos]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return Rollout(torch.cat([prompt_ids, responses], 1), full_attn, P, action_mask, texts)


def response_logits(model, rollout: Rollout, temperature: float = 1.0, *, response_only: bool = True) -> torch.Tensor:
    """Logits [B, R, V] that predicted each response token (divided by the sampling temperature).

    Only positions P-1 .. L-2 (L = P + R) predict response tokens. With ``response_only`` (the default) the LM head
    (576 x 49,152 for SmolLM2, a large share of a forward) runs on the last R + 1 positions only (``logits_to_keep``),
    the last of which is dropped; otherwise on every position, then sliced. The logits are the same either way (the
    LM head is applied position by position); under autograd the LM head's weight gradient is a sum over fewer
    positions, equal up to float rounding (the ``logits_to_keep`` setting picks the training pass's form)."""
    R = rollout.sequences.shape[1] - rollout.prompt_len
    keep = R + 1 if response_only else 0  # 0: every position
    out = model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                position_ids=_positions(rollout.attention_mask), logits_to_keep=keep)
    logits = (out.logits[:, :-1] if response_only else out.logits[:, rollout.prompt_len - 1:-1]).float()
    return logits / temperature if temperature != 1.0 else logits


def token_logprobs(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, actions[..., None]).squeeze(-1)
