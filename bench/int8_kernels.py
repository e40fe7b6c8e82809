"""Int8 kernels for the draft on a CPU, side by side on the shipped draft's own linear shapes (its layers at one
block of tokens, its head over its `draft_vocab`): float32, fbgemm dynamic quantization (`int8_copy()` today,
deprecated by torch), weight-only int8 through `torch._weight_int8pack_mm` (float32 and bfloat16 activations), and
torchao's int8 configs where torchao is installed. Prints milliseconds per pass over all shapes and each kernel's
ratio to fbgemm; `--out` writes them as JSON.

    python -m bench.int8_kernels [--threads 1] [--tokens 8] [--repeats 50] [--out docs/data/int8_kernels.json]
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from bench.run import environment
from common.io import write_json_atomic
from modeling_dflash import DFlashDraftModel

ROOT = Path(__file__).resolve().parents[1]


def draft_shapes(draft) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of one draft pass, the head's draft-vocabulary rows included."""
    shapes = [tuple(m.weight.shape) for m in draft.modules() if isinstance(m, torch.nn.Linear)]
    vocab = getattr(draft.config, "draft_vocab", None)
    return shapes + [(len(vocab) if vocab else draft.config.vocab_size, draft.config.hidden_size)]


def float_layers(shapes) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(k, n, bias=False) for n, k in shapes]


def int8pack(layer, dtype):
    """Per-row symmetric int8 weights run by `torch._weight_int8pack_mm` with `dtype` activations."""
    weight = layer.weight.detach()
    scale = weight.abs().amax(1).clamp(min=1e-8) / 127
    q, s = torch.round(weight / scale[:, None]).to(torch.int8), scale.to(dtype)
    return lambda x: torch._weight_int8pack_mm(x.to(dtype), q, s)


def fbgemm(layer):
    from torch.ao.quantization import quantize_dynamic  # what int8_copy() runs

    return quantize_dynamic(torch.nn.Sequential(copy.deepcopy(layer)), {torch.nn.Linear}, torch.qint8)


def torchao(layer, config, dtype):
    from torchao.quantization import quantize_

    model = torch.nn.Sequential(copy.deepcopy(layer).to(dtype))
    quantize_(model, config)
    return lambda x: model(x.to(dtype))


def kernels() -> dict:
    """Name -> a function building one layer's kernel from its float `torch.nn.Linear`."""
    out = {
        "float32": lambda layer: layer,
        "fbgemm dynamic int8": fbgemm,
        "_weight_int8pack_mm float32": lambda layer: int8pack(layer, torch.float32),
        "_weight_int8pack_mm bfloat16": lambda layer: int8pack(layer, torch.bfloat16),
    }
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    except ImportError:
        return out
    for name, config in (("weight-only", Int8WeightOnlyConfig), ("dynamic", Int8DynamicActivationInt8WeightConfig)):
        for dtype in (torch.float32, torch.bfloat16):
            out[f"torchao {name} {str(dtype)[6:]}"] = lambda layer, c=config, d=dtype: torchao(layer, c(), d)
    return out


def torchao_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchao")
    except ImportError:
        return None


def pass_ms(layers, inputs, repeats: int) -> float:
    """Milliseconds of one pass through every layer, each on an input of its own width."""
    run = lambda: [layer(x) for layer, x in zip(layers, inputs)]  # noqa: E731
    run()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats * 1000


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=str(ROOT))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="rows per matmul: the draft's block size")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = draft_shapes(DFlashDraftModel.from_pretrained(args.draft))
    layers = float_layers(shapes)
    inputs = [torch.randn(args.tokens, layer.in_features) for layer in layers]
    with torch.inference_mode():
        built = {name: [build(layer) for layer in layers] for name, build in kernels().items()}
        timings = {name: pass_ms(kernel_layers, inputs, args.repeats) for name, kernel_layers in built.items()}
    base = timings["fbgemm dynamic int8"]
    for name, ms in timings.items():
        print(f"{name:32s} {ms:8.3f} ms   {ms / base:5.2f}x fbgemm")
    if args.out:
        environment_used = environment() | {"torchao": torchao_version()}
        command = " ".join(["python -m bench.int8_kernels", *(sys.argv[1:] if argv is None else argv)])
        write_json_atomic(
            args.out,
            {
                "command": command,
                "environment": environment_used,
                "tokens": args.tokens,
                "shapes": shapes,
                "ms": timings,
            },
        )


if __name__ == "__main__":
    main()
