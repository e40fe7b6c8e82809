"""`python -m bench.prefill_memory`: peak memory of a long-prompt `spec_generate` on the default target, against a
prefill that keeps every layer's hidden states (what the loop asked the target for before `LayerFeatures`).

Each variant runs in a fresh process, so each peak RSS is its own; the baseline is the process after loading.
"""

import argparse
import json
import resource
import subprocess
import sys

VARIANTS = ("loaded", "all-hidden-states-prefill", "spec-generate")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(variant: str, prompt_tokens: int, threads: int) -> dict:
    import torch

    from default_target import load_default_target
    from modeling_dflash import DFlashDraftModel

    torch.set_num_threads(threads)
    target, _ = load_default_target()
    draft = DFlashDraftModel.from_pretrained(".").eval()
    ids = torch.randint(100, 20000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        if variant == "all-hidden-states-prefill":
            out = target(input_ids=ids, use_cache=True, output_hidden_states=True, logits_to_keep=1)
            torch.cat([out.hidden_states[i + 1] for i in draft.config.target_layer_ids], dim=-1)
        elif variant == "spec-generate":
            draft.spec_generate(target=target, input_ids=ids, max_new_tokens=16)
    return {"variant": variant, "prompt_tokens": prompt_tokens, "peak_rss_mib": round(peak_rss_mib())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measurement, in a child process
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args.variant, args.prompt_tokens, args.threads)))
        return 0
    rows = []
    for variant in VARIANTS:
        command = [
            sys.executable,
            "-m",
            "bench.prefill_memory",
            "--variant",
            variant,
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--threads",
            str(args.threads),
        ]
        rows.append(
            json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        )
    base = rows[0]["peak_rss_mib"]
    for row in rows:
        print(
            f"{row['variant']:>26}: peak RSS {row['peak_rss_mib']:6d} MiB (+{row['peak_rss_mib'] - base} over loaded), "
            f"{row['prompt_tokens']}-token prompt"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
