"""A hybrid target's two rollbacks side by side: transformers' own cache, which records the recurrent state after
each verified token and crops back to one (`recorded`, transformers 5.25+), and `cache_dflash.RollbackCache`, which
saves the states before each verify pass and, after a rejection, re-runs the accepted tokens (`saved`, what 5.24
needs). Both decode a tiny random Qwen3.5 target (gated-delta layers plus full attention) with a random draft, so
that nearly every round rejects: the rollback's worst case. Prints target passes, seconds and whether the output
equals plain greedy, per route; `--out` writes them as JSON.

    python -m bench.hybrid_rollback [--prompts 4] [--max-new-tokens 48] [--threads 1] [--out FILE.json]
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import cache_dflash
import routing_dflash
from bench.run import environment
from common.io import write_json_atomic
from configuration_dflash import DFlashConfig
from modeling_dflash import DFlashDraftModel

VOCAB = 512


def tiny_qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        max_position_embeddings=1024,
        pad_token_id=0,
    )
    target = Qwen3_5ForCausalLM(config).eval()
    target.generation_config.eos_token_id = None  # every route runs to max_new_tokens
    return target


def tiny_draft(target):
    torch.manual_seed(1)
    config = DFlashConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        block_size=8,
        num_target_layers=target.config.num_hidden_layers,
        target_layer_ids=[1, 6],
        mask_token_id=1,
    )
    return DFlashDraftModel(config).eval()


def counted_passes(target) -> list[int]:
    calls = []
    target.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def run(route: str, target, draft, ids, max_new_tokens: int):
    if route == "spec_generate":
        return draft.spec_generate(target=target, input_ids=ids, max_new_tokens=max_new_tokens)
    return target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


@contextlib.contextmanager
def rollback(name: str):
    """`saved` hides transformers' recording from both routes, as on 5.24; `recorded` is what the installed one does."""
    with contextlib.ExitStack() as stack:
        for module in (cache_dflash, routing_dflash) if name == "saved" else ():
            stack.enter_context(mock.patch.object(module, "records_recurrent_states", lambda: False))
        yield


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not cache_dflash.records_recurrent_states():
        parser.error("the installed transformers does not record recurrent states (5.25+ does): nothing to compare")
    torch.set_num_threads(args.threads)
    target = tiny_qwen3_5()
    draft = tiny_draft(target)
    seeds = [torch.Generator().manual_seed(i) for i in range(args.prompts)]
    prompts = [torch.randint(2, VOCAB, (1, 12), generator=seed) for seed in seeds]
    plain = [
        target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        for ids in prompts
    ]
    passes = counted_passes(target)
    rows = []
    for route in ("spec_generate", "generate"):
        for name in ("recorded", "saved"):
            with rollback(name):
                run(route, target, draft, prompts[0], 4)  # warm-up
                passes.clear()
                start = time.perf_counter()
                outs = [run(route, target, draft, ids, args.max_new_tokens) for ids in prompts]
                seconds = time.perf_counter() - start
            exact = all(torch.equal(out, ref) for out, ref in zip(outs, plain))
            rows.append(
                {"route": route, "rollback": name, "target_passes": len(passes), "seconds": seconds, "exact": exact}
            )
            print(
                f"{route:14s} {name:9s} {len(passes):5d} target passes  {seconds:6.2f} s  "
                f"{'equals' if exact else 'DIFFERS FROM'} plain greedy"
            )
    if args.out:
        command = " ".join(["python -m bench.hybrid_rollback", *(sys.argv[1:] if argv is None else argv)])
        write_json_atomic(args.out, {"command": command, "environment": environment(), "rows": rows})
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
