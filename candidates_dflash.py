"""`DFlashCandidateGenerator`: the draft's proposal for transformers' assisted loop
(`target.generate(ids, assistant_model=draft)`, which `routing_dflash.py` routes to it).
"""

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

try:
    from .decoding_dflash import LayerFeatures, chain_proposal, choose_block, draft_step, next_block_size
    from .head_dflash import DraftHead, draft_embedding
    from .plan_dflash import check_draft_fits_target
except ImportError:  # imported as a top-level module from the repo root or an installed project
    from decoding_dflash import LayerFeatures, chain_proposal, choose_block, draft_step, next_block_size
    from head_dflash import DraftHead, draft_embedding
    from plan_dflash import check_draft_fits_target


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts one block per step from the target's hidden states at `target_layer_ids`.

    Forward hooks on the target's decoder layers capture the features of every target pass; only the tokens the
    target committed are fed to the draft's context cache. Call `close()` to remove the hooks.

    Args:
        target: the model running `generate`.
        draft: a DFlash draft that fits `target`.
        generation_config: the call's generation config (for `max_length`).
        logits_processor: the call's processors, applied to draft logits when `proposal="sample"`.
        proposal: `"argmax"` proposes the draft's argmax and returns no logits, so sampling is verified by the one-hot
            rule; `"sample"` samples each position from the draft and returns its logits for `_speculative_sampling`.
        block_size: defaults to `draft.config.block_size`.
        rollback: the target's `RollbackCache` when it is hybrid: each round's candidates are saved there before the
            target verifies them.
    """

    def __init__(
        self,
        target,
        draft,
        generation_config,
        logits_processor=None,
        *,
        proposal="argmax",
        block_size=None,
        rollback=None,
    ):
        if proposal not in ("argmax", "sample"):
            raise ValueError(f"proposal must be 'argmax' or 'sample', got {proposal!r}")
        check_draft_fits_target(draft, target)
        self.target, self.draft, self.proposal = target, draft, proposal
        self.block_size = self.max_block_size = block_size or draft.config.block_size
        self.schedule = generation_config.num_assistant_tokens_schedule
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.cache, self.context_len, self.proposed = DynamicCache(), 0, False
        self.embed, self.head = draft_embedding(draft, target), DraftHead(draft, target.get_output_embeddings())
        self.features = LayerFeatures(target, draft.config.target_layer_ids)
        self.rollback = rollback

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one verify pass takes (the last committed token and the drafted ones): transformers 5.25+
        has a hybrid target's cache record that many recurrent states, so that a crop can go back to any of them."""
        return self.max_block_size

    def close(self) -> None:
        self.features.close()

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # the last token is the target's bonus token: committed, but not yet run through the target
        committed = input_ids.shape[1] - 1
        max_new = min(self.block_size - 1, self.max_length - input_ids.shape[1] - 1)
        self.proposed = False
        if not self.features.outputs or max_new <= 0:  # the first call comes before the target's prefill
            return input_ids, None
        self.proposed = True
        new = committed - self.context_len  # the last target pass began at `context_len`; it kept `new` tokens
        context = self.features.pop(slice(0, new))
        logits, hidden = draft_step(
            self.draft, self.embed, self.head, input_ids[:, -1:], context, committed, self.cache, self.block_size
        )
        logits, hidden = logits[:, :max_new].float(), hidden[:, :max_new]
        self.context_len = committed
        if self.proposal == "argmax":
            candidates, scores = (
                torch.cat([input_ids, chain_proposal(self.draft, logits, hidden, input_ids[:, -1:], None)], dim=1),
                None,
            )
        else:
            candidates, scores = self._sample_candidates(input_ids, logits, hidden)
        if self.rollback is not None:  # the target verifies the last committed token and the drafted ones
            self.rollback.save(candidates[:, committed:])
        return candidates, scores

    def _sample_candidates(self, input_ids, logits, hidden) -> tuple[torch.LongTensor, torch.Tensor]:
        """Samples d_i ~ q_i one position at a time, so processors see the drafted prefix (and a DFlash 2 selector
        the token drawn before); returns the processed scores q_i came from, for `_speculative_sampling`."""
        candidates, scores = [input_ids], []

        def choose(position_scores):
            if self.logits_processor:
                position_scores = self.logits_processor(torch.cat(candidates, dim=1), position_scores)
            probs = torch.softmax(position_scores, dim=-1)
            token = torch.multinomial(probs, 1) if self.do_sample else probs.argmax(-1, keepdim=True)
            candidates.append(token)
            scores.append(position_scores)
            return token[:, 0]

        choose_block(self.draft, logits, hidden, input_ids[:, -1:], choose)
        return torch.cat(candidates, dim=1), torch.stack(scores, dim=1)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self.schedule == "heuristic" and self.proposed:
            self.block_size = next_block_size(self.block_size, int(num_matches), self.max_block_size)
        self.proposed = False  # the candidates are verified
