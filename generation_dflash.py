"""DFlash's public decoding entry points: `DFlashDecodingMixin`, which every DFlash draft inherits (`spec_generate`,
`int8_copy`, and the `target.generate(ids, assistant_model=draft)` route), and `DFlashCandidateGenerator`.

Where the rest lives: a call's checks and plan in `plan_dflash.py`, the round loop and its tree, accept and cost
rules in `tree_dflash.py` (framework-free), one row's layout for it in `decoding_dflash.py`, a batch's in
`batch_dflash.py`, the generate route in `routing_dflash.py`, the draft's head in `head_dflash.py`, and caches in
`cache_dflash.py`.
"""

import copy
from collections.abc import Mapping

import torch
from transformers.generation.streamers import BaseStreamer

try:
    from .batch_dflash import batched_spec_generate
    from .candidates_dflash import DFlashCandidateGenerator
    from .configuration_dflash import check_sampling
    from .decoding_dflash import SpecGenerateOutput, decode_row
    from .head_dflash import quantize_int8
    from .plan_dflash import (
        EOS_FROM_GENERATION_CONFIG,
        check_context,
        check_draft_fits_target,
        check_generation_inputs,
        check_schedule,
        prompt_tensor,
        tree_plan,
        warn_generation_config_not_applied,
    )
    from .routing_dflash import assisted_generate
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from batch_dflash import batched_spec_generate
    from candidates_dflash import DFlashCandidateGenerator
    from configuration_dflash import check_sampling
    from decoding_dflash import SpecGenerateOutput, decode_row
    from head_dflash import quantize_int8
    from plan_dflash import (
        EOS_FROM_GENERATION_CONFIG,
        check_context,
        check_draft_fits_target,
        check_generation_inputs,
        check_schedule,
        prompt_tensor,
        tree_plan,
        warn_generation_config_not_applied,
    )
    from routing_dflash import assisted_generate

__all__ = ["DFlashCandidateGenerator", "DFlashDecodingMixin", "SpecGenerateOutput"]


class DFlashDecodingMixin:
    """What a DFlash draft can do besides its forward pass: decode with a target, hand `target.generate` its route, and
    make an int8 copy of itself for CPU drafting."""

    _batched_spec_generate = batched_spec_generate  # `spec_generate` with a batch of prompts runs this
    _dflash_assisted_generate = staticmethod(assisted_generate)  # `target.generate(assistant_model=draft)` runs this

    @torch.inference_mode()
    def spec_generate(
        self,
        target,
        input_ids: torch.LongTensor,
        max_new_tokens: int = 2048,
        attention_mask: torch.Tensor | None = None,
        stop_token_ids: list[int] | int | None = EOS_FROM_GENERATION_CONFIG,
        temperature: float = 0.0,
        *,
        block_size: int | None = None,
        return_stats: bool = False,
        generator: torch.Generator | None = None,
        streamer: BaseStreamer | None = None,
        block_size_schedule: str = "constant",
        tree_budget: int | None = None,
        tree_min_prob: float = 0.0,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int = 2,
        tree_sizing: str | None = None,
        verify_costs=None,
        top_p: float = 1.0,
        top_k: int = 0,
        cache_implementation: str | None = None,
        past_key_values=None,
        compile_verify: bool = False,
        pad_token_id: int | None = None,
    ):
        """Generates with `target`, drafting blocks with this DFlash draft. Output equals the target's own decoding with
        this call's settings: identical tokens at `temperature=0` (in float32), the same distribution above it.

        Exactness by dtype: in float32, greedy output is token-identical to plain greedy decoding. In bfloat16 or
        float16 a verify pass over several tokens rounds differently from several one-token passes, so greedy output may
        leave plain greedy decoding of the same target, only where the target's top two logits are within a few units in
        the last place of each other (a rounding tie; `common.exactness` measures it, tested on the real target), as in
        vLLM and SGLang. Sampling keeps the target's distribution in every dtype (logits are sampled in float32).

        Args:
            target: a transformers causal LM whose hidden states this draft was trained on.
            input_ids: `[1, prompt_len]` prompt ids (or `[b, prompt_len]`, left-padded), or a tokenizer's output holding
                them and their attention mask (`apply_chat_template(..., return_dict=True, return_tensors="pt")`).
            max_new_tokens: at most this many new tokens.
            attention_mask: with a batch, its `[b, prompt_len]` 0/1 mask; the prompts must be left-padded
                (`tokenizer.padding_side = "left"`). A batch (more than one row, or padding) decodes together, every row
                accepting its own prefix, and returns `[b, prompt_len + new]` ids padded after each row's end
                (`batch_dflash.py`; each row verifies its own tree).
            stop_token_ids: generation ends after the first of these tokens (it is kept); one id or a list. Omitted: the
                target's `generation_config.eos_token_id`, where `generate` stops too; None: no stop token (z-lab's
                meaning). That is all `spec_generate` reads from the generation config: its own arguments decide the
                decoding, and a config that sets other decoding options (`repetition_penalty`, `do_sample`, ...) gets a
                warning naming them.
            temperature: 0 for greedy decoding.
            cache_implementation: the target's cache, `"dynamic"` (default) or `"static"` (preallocated for the prompt,
                `max_new_tokens` and one verify; needs transformers 5 or newer, whose static layers can be cropped).
            pad_token_id: what pads a batch's rows after their end (default: the generation config's pad token, else the
                stop token, as `generate`).
            past_key_values: an empty cache object to use instead (any whose layers can be cropped).
            compile_verify: run the verify passes through `torch.compile(target.forward)` (compiled on the first call
                and kept for the target); needs a static cache, which it then uses by default (a power of two of at
                least 1024 slots, so other lengths reuse the graph), the constant schedule and one tree size (no
                `prompt_lookup_num_tokens` or `tree_min_prob`, which change the verify's length by round).
            top_p, top_k: nucleus and top-k filtering of the target's distribution when sampling (1.0 and 0: off), as
                transformers' warpers apply them; output is sampled from exactly that filtered distribution.
            block_size: tokens per draft block, including the last committed token; defaults to `config.block_size`.
            return_stats: return a `SpecGenerateOutput` with acceptance lengths instead of the ids alone.
            generator: optional `torch.Generator` for sampling.
            streamer: optional transformers streamer; it gets the prompt, then each committed token once, in order.
            block_size_schedule: `"constant"`, or `"heuristic"` to adapt the block to acceptance (at most `block_size`),
                as transformers' `num_assistant_tokens_schedule` does.
            tree_budget: verify a draft tree of this many nodes (depth at most `block_size - 1`, built best-first from
                the one draft pass) instead of the argmax chain; 0 for the chain; defaults to `config.tree_budget`
                (absent, with the heuristic schedule, for a DFlash 2 draft or a hybrid target: the chain).
            tree_min_prob: leave out of the tree every node whose path has a draft probability below this, so a round
                whose draft is unsure verifies fewer tokens (none: a plain decode step plus any lookup branch). Pays
                where a verify's cost grows with its length (float32 here), not where it is flat (bfloat16 here); 0:
                off.
            prompt_lookup_num_tokens: also verify, as one more branch of the round's tree, up to this many tokens that
                followed an earlier occurrence of the last `max_matching_ngram_size` (down to 1) committed tokens in the
                prompt and output (transformers' prompt-lookup rule); 0: none; defaults to
                `config.prompt_lookup_num_tokens` (stepping aside where a tree does, and for `compile_verify`, whose
                graph wants one tree size). Exact like any tree: every kept token is the target's own choice given its
                prefix, whichever proposer put it there.
            tree_sizing: `"cost"` cuts each round's best-first tree (at most `tree_budget` nodes) to the width that
                maximises expected committed tokens per second on this machine: expected acceptance from the draft's
                path probabilities, calibrated online by the acceptance the call has seen, against the target's measured
                verify time t(n) (`cost_dflash.py`); `"fixed"` verifies `tree_budget` nodes; defaults to
                `config.tree_sizing`, else fixed. A batch cuts every row to one width, since its packed verify costs the
                widest row's.
            verify_costs: t(n) for cost sizing, a `tree_dflash.VerifyCosts` or a mapping of verified tokens to seconds;
                None: measured once per target, dtype, device, thread count and row count (a batch in its own shape) at
                the first call and kept for the process (`python -m bench.step_costs` prints it).

        Returns `[b, prompt_len + new]` token ids, or a `SpecGenerateOutput`.
        """
        if isinstance(input_ids, Mapping) and attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        check_draft_fits_target(self, target)  # before the prompt: a draft for another target would blame its ids
        input_ids = prompt_tensor(target, input_ids)
        block_size = block_size or self.config.block_size
        check_generation_inputs(input_ids, max_new_tokens, block_size)
        check_context(target, input_ids, max_new_tokens)
        check_sampling(temperature, top_p, top_k)
        check_schedule(block_size_schedule)
        warn_generation_config_not_applied(target)
        plan = tree_plan(
            self,
            target,
            input_ids.shape[1],
            max_new_tokens,
            block_size,
            block_size_schedule,
            tree_budget,
            tree_min_prob,
            prompt_lookup_num_tokens,
            max_matching_ngram_size,
            compile_verify,
            tree_sizing,
            verify_costs,
        )
        common = dict(
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            block_size=block_size,
            return_stats=return_stats,
            generator=generator,
            streamer=streamer,
            cache_implementation=cache_implementation,
            past_key_values=past_key_values,
            compile_verify=compile_verify,
        )
        if input_ids.shape[0] > 1 or (attention_mask is not None and not bool(torch.as_tensor(attention_mask).all())):
            schedule = None if block_size_schedule == "constant" else block_size_schedule  # refused by name
            return self._batched_spec_generate(
                target,
                input_ids,
                attention_mask,
                plan=plan,
                pad_token_id=pad_token_id,
                block_size_schedule=schedule,
                **common,
            )
        return decode_row(self, target, input_ids, plan, block_size_schedule=block_size_schedule, **common)

    def int8_copy(self):
        """A copy whose linear layers hold int8 weights and run float32 activations (PyTorch's dynamic quantization),
        for CPUs, where the draft's pass is bound by reading its weights: it reads half the bfloat16 bytes. It drafts
        for a target of any dtype, with the head's rows in int8 too (`DraftHead`); the target still verifies every
        token, so output stays exact."""
        if self.device.type != "cpu":
            raise ValueError(f"int8_copy() quantizes for CPUs (fbgemm); the draft is on {self.device}")
        quantized = quantize_int8(copy.deepcopy(self).float())
        quantized._int8_weights = True
        return quantized

    def generate(self, *args, **kwargs):
        """Reached only when transformers bypassed DFlash routing and treated the draft as an ordinary assistant."""
        raise RuntimeError(
            "A DFlash draft is not a language model and cannot run `generate` itself. transformers did not route it "
            "to DFlashCandidateGenerator; use `draft.spec_generate(target=...)` or `speculation_type='dflash'`."
        )
