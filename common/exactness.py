"""Where a greedy output leaves the target's plain greedy output, and whether that is a rounding tie.

In float32 DFlash output is token-identical to plain decoding. In bfloat16 or float16 a pass over several tokens
rounds differently from several one-token passes, so the two may part where the target's top two logits are within
rounding of each other. The test: one full forward of the target, in its own dtype, over the shared prefix; the two
tokens' logits there must differ by at most `TIE_ULPS` units in the last place at their magnitude. A real bug (a wrong
position, a stale cache) shows a large gap.

After the first divergence the two outputs follow different prefixes, so the rest of ours is checked on its own
(`worst_off_argmax`): one forward over our whole output, where every token must be the target's argmax at its
position or within `TIE_ULPS` ulps of it.
"""

import math
from dataclasses import dataclass

import torch

TIE_ULPS = 4  # bf16 rounding of a 30-layer pass moves a logit by a few units in the last place


@dataclass
class Divergence:
    index: int  # first new token that differs
    gap: float | None  # |logit(ours) - logit(plain)| there, under one full pass; None where one output just stopped
    ulp: float | None  # the dtype's spacing at that logit magnitude
    dtype: str

    @property
    def rounding_tie(self) -> bool:
        """Explained by rounding: reduced precision, and a gap within `TIE_ULPS` ulps. Never in float32."""
        return self.gap is not None and self.dtype != "float32" and self.gap <= TIE_ULPS * self.ulp

    def describe(self) -> str:
        if self.gap is None:
            return f"token {self.index}: one output ends where the other goes on"
        kind = "a rounding tie" if self.rounding_tie else "NOT a rounding tie"
        ulps = self.gap / self.ulp
        return f"token {self.index}: top-2 logit gap {self.gap:.3g} in {self.dtype} ({ulps:.1f} ulp), {kind}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end), or None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ulp(magnitude: float, dtype: torch.dtype) -> float:
    """Spacing of `dtype`'s numbers at `magnitude` (at least the spacing at 1)."""
    return torch.finfo(dtype).eps * 2.0 ** max(math.floor(math.log2(max(magnitude, 1e-30))), 0)


@torch.no_grad()
def divergence(target, prompt_ids: list[int], ours: list[int], plain: list[int]) -> Divergence | None:
    """Where `ours` first leaves `plain` (both new tokens after `prompt_ids`), with the target's logit gap there."""
    index = first_difference(ours, plain)
    if index is None:
        return None
    dtype = next(target.parameters()).dtype
    name = str(dtype).removeprefix("torch.")
    if index >= min(len(ours), len(plain)):
        return Divergence(index, None, None, name)
    prefix = torch.tensor([prompt_ids + ours[:index]], device=target.device)
    logits = target(input_ids=prefix, logits_to_keep=1).logits[0, -1].float()
    a, b = logits[ours[index]].item(), logits[plain[index]].item()
    return Divergence(index, abs(a - b), ulp(max(abs(a), abs(b)), dtype), name)


@torch.no_grad()
def worst_off_argmax(target, prompt_ids: list[int], ours: list[int]) -> Divergence | None:
    """The position of `ours` (new tokens after `prompt_ids`) furthest, in ulps, below the target's argmax there,
    teacher-forced in one pass over the whole output; None where every token is the argmax."""
    if not ours:
        return None
    dtype = next(target.parameters()).dtype
    ids = torch.tensor([prompt_ids + ours], device=target.device)
    logits = target(input_ids=ids, logits_to_keep=len(ours) + 1).logits[0, :-1].float()
    top = logits.max(dim=-1).values
    own = logits.gather(1, torch.tensor(ours, device=logits.device)[:, None])[:, 0]
    gaps = (top - own).tolist()
    ulps = [ulp(abs(t), dtype) for t in top.tolist()]
    index = max(range(len(ours)), key=lambda i: gaps[i] / ulps[i])
    if gaps[index] == 0:
        return None
    return Divergence(index, gaps[index], ulps[index], str(dtype).removeprefix("torch."))


def explained(target, prompt_ids: list[int], ours: list[int], plain: list[int]) -> tuple[Divergence | None, bool]:
    """Where `ours` first leaves `plain`, and whether every difference is a rounding tie: there and, teacher-forced,
    at every later token of ours."""
    found = divergence(target, prompt_ids, ours, plain)
    if found is None or not found.rounding_tie:
        return found, found is None
    worst = worst_off_argmax(target, prompt_ids, ours)  # only a tie at the first divergence needs the rest checked
    return found, worst is None or worst.rounding_tie
