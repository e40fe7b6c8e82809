"""Tiny random targets and drafts, built in code (no Hub), shared by every test."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configuration_dflash import DFlashConfig  # noqa: E402
from modeling_dflash import DFlashDraftModel  # noqa: E402

VOCAB, HIDDEN, TARGET_LAYERS = 64, 64, 4
MASK_ID = VOCAB - 1
TARGET_CONFIGS = {
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
}


# sliding-window targets (window 8): every layer slides, or the last two of four
ALL_WINDOW = {"arch": "mistral", "sliding_window": 8}
MIXED_WINDOW = {"arch": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}

# draft config changes that do not fit the tiny target, with the error each must raise
MISMATCHES = [
    ({"hidden_size": 32, "head_dim": 8}, "hidden_size 32 does not match the target's 64"),
    ({"vocab_size": 99}, "vocab_size 99 does not match the target's 64"),
    ({"num_target_layers": 6}, "num_target_layers 6 does not match the target's 4"),
    ({"target_layer_ids": [0, 3]}, r"target_layer_ids \[0, 3\] must be sorted, unique and in \[0, 3\)"),
    ({"target_layer_ids": [2, 0]}, r"target_layer_ids \[2, 0\] must be sorted"),
    ({"mask_token_id": 64}, "mask_token_id 64 is outside the target's vocab of 64"),
]


def make_target(arch: str = "llama", seed: int = 0, initializer_range: float = 0.02, **overrides):
    """A 4-layer fp32 target. A larger `initializer_range` makes its next-token distributions peakier."""
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = TARGET_CONFIGS[arch](**kwargs)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # plain decoding runs to max_new_tokens unless a test sets a stop
    return model


def watched_target(arch: str = "llama", attn: str | None = None, **overrides):
    """A target whose config names `attn` as its attention (only read: a call must fail first), and the list its
    forward passes append to."""
    target, calls = make_target(arch, **overrides), []
    if attn:
        target.config._attn_implementation_internal = attn
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    return target, calls


def make_draft_config(**overrides) -> DFlashConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_target_layers=TARGET_LAYERS,
        target_layer_ids=[0, 2],
        mask_token_id=MASK_ID,
        block_size=8,
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


def make_draft(seed: int = 1, **overrides) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(make_draft_config(**overrides)).eval()


def float_linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers of `module` that still hold float weights (an `int8_copy()` has none)."""
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


def greedy_reference(target, input_ids, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding of the target (which has no EOS set, so it runs to `max_new_tokens`)."""
    return target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


class OracleDraft(DFlashDraftModel):
    """A draft that proposes the reference continuation for exactly `k` tokens per block, then wrong tokens.

    It runs the real draft layers (so the context cache is exercised) and then replaces the output with hidden
    states that the target's lm_head maps to the chosen tokens (exact, since the tiny lm_head is square).
    """

    def setup(self, target, reference: torch.Tensor, k: int):
        self.lm_head_pinv = torch.linalg.pinv(target.get_output_embeddings().weight.detach().double()).float()
        self.reference, self.k, self.calls, self.blocks = reference[0].tolist(), k, [], []
        return self

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, **kwargs):
        out = super().forward(noise_embeds, context_hidden_states, position_ids=position_ids, **kwargs)
        block = noise_embeds.shape[1]
        start = int(position_ids[0, -block])
        self.calls.append((context_hidden_states.shape[1], start))
        self.blocks.append(block)
        logits = torch.stack([self.logits_at(start + i, i) for i in range(block)])
        out.last_hidden_state = (logits @ self.lm_head_pinv.T)[None].to(noise_embeds.dtype)
        return out

    def right_token(self, position: int) -> int:
        return self.reference[position] if position < len(self.reference) else 3

    def logits_at(self, position: int, offset: int) -> torch.Tensor:
        right = self.right_token(position)
        return (
            torch.nn.functional.one_hot(
                torch.tensor(right if offset <= self.k else (right + 1) % (VOCAB - 1)), VOCAB
            ).float()
            * 50.0
        )


class SecondChoiceDraft(OracleDraft):
    """Sure and right for `k` tokens per block; at offset `k + 1` its first choice is wrong and its second right;
    after that both are wrong. A chain accepts `k` drafted tokens per round; a best-first tree takes the whole
    first-choice chain (B - 1 nodes), then that second choice, so a budget of B accepts `k + 1`."""

    def logits_at(self, position: int, offset: int) -> torch.Tensor:
        right, logits = self.right_token(position), torch.zeros(VOCAB)
        if offset <= self.k:
            logits[right] = 50.0
            return logits
        logits[right] = -1e4  # ranked last unless chosen, so no larger tree finds it by a tie
        second = right if offset == self.k + 1 else (right + 2) % (VOCAB - 1)
        logits[(right + 1) % (VOCAB - 1)], logits[second] = 50.0, 45.0
        return logits


def exact_joint_distribution(target, ids, processors, length: int) -> torch.Tensor:
    """p(t1 .. t_length | prompt) of the target after `processors` (a LogitsProcessorList), shape `[V] * length`."""
    seqs, joint = ids, torch.ones(())
    with torch.no_grad():
        for _ in range(length):
            p = torch.softmax(processors(seqs, target(seqs).logits[:, -1].float()), -1)
            joint = joint[..., None] * p.view(*joint.shape, VOCAB)
            seqs = torch.cat([seqs.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(seqs))[:, None]], 1)
    return joint


def exact_two_token_distribution(target, ids, processors) -> torch.Tensor:
    """p(t1, t2 | prompt) of the target after `processors`, flattened to [V * V]."""
    return exact_joint_distribution(target, ids, processors, 2).flatten()


def sample_two_tokens(
    draft, target, ids, n: int, temperature: float, block_size: int = 4, new_tokens: int = 2, **kwargs
) -> tuple[torch.Tensor, int]:
    """Counts of the last two of `new_tokens` tokens `spec_generate` samples in `n` runs, as a flat `[V * V]` table,
    and how many runs kept drafted tokens at every position counted in their first round (the first new token
    comes from the prefill, so 2 new tokens count one drafted position and 3 count two)."""
    g, counts, accepted = torch.Generator().manual_seed(0), torch.zeros(VOCAB * VOCAB), 0
    for _ in range(n):
        stats = draft.spec_generate(
            target=target,
            input_ids=ids,
            max_new_tokens=new_tokens,
            temperature=temperature,
            block_size=block_size,
            return_stats=True,
            generator=g,
            **kwargs,
        )
        t1, t2 = stats.output_ids[0, -2:].tolist()
        counts[t1 * VOCAB + t2] += 1
        accepted += stats.acceptance_lengths[0] >= new_tokens
    return counts, accepted


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Goodness of fit of `counts` to `probs`; cells expecting fewer than 5 are pooled. Returns (p, chi2, dof)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected[-1] < 1e-9:  # the pooled cell holds only impossible outcomes
        assert observed[-1] == 0, f"{int(observed[-1])} samples of zero-probability outcomes"
        observed, expected = observed[:-1], expected[:-1]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0))), chi2, dof


def make_tokenizer():
    """A word-level tokenizer over the tiny vocab: token i is the word `t{i}`, except the pad token 0, `abcdef`
    (the probe string that transformers' stop-string matching tokenizes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"abcdef": 0} | {f"t{i}": i for i in range(1, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="abcdef"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t2", pad_token="abcdef")


@pytest.fixture
def target():
    return make_target("llama")


@pytest.fixture
def draft():
    return make_draft()
