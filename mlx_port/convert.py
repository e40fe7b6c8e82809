"""Converts a DFlash draft (ours or the published z-lab layout) to an MLX folder, optionally quantized.

    python -m mlx_port convert --hf-path DRAFT_DIR --mlx-path draft-mlx \
        [-q --q-bits 4 --q-group-size 64] [--dtype bfloat16]

The output keeps the DFlash config fields. Loading, quantizing and saving are mlx-lm's own functions; the draft
class comes from `mlx_port.model`. Nothing is written at `--mlx-path` until the whole folder is complete.
"""

import argparse
import glob
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import quantize_model, save_config, save_model

from common.checks import check_model_path

from .model import Model
from .utils import fetch_path, load_draft_model

DTYPES = ("float16", "bfloat16", "float32")


def cast_floats(model: Model, dtype: str) -> None:
    """Casts every floating parameter of `model` to `dtype` in place."""
    target = getattr(mx, dtype)
    model.update(tree_map(lambda v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))


def convert(
    hf_path: str,
    mlx_path: str = "mlx_model",
    quantize: bool = False,
    q_group_size: int | None = None,
    q_bits: int | None = None,
    dtype: str | None = None,
) -> Path:
    """Writes the converted draft to `mlx_path`, which must not exist yet; returns that path."""
    out = Path(mlx_path)
    if out.exists():
        raise ValueError(f"Cannot save to {out}: it already exists. Delete it or choose another --mlx-path.")
    src = fetch_path(hf_path)
    model, config = load_draft_model(src, lazy=True)
    if dtype is not None:
        cast_floats(model, dtype)
        config["dtype"] = dtype
        config.pop("torch_dtype", None)  # transformers 4 name; one dtype field avoids a stale second one
    if quantize:
        model, config = quantize_model(model, config, q_group_size, q_bits)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a half-written folder must never sit at `mlx_path`: write beside it, then rename
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_model(tmp, model, donate_model=True)
        save_config(config, config_path=tmp / "config.json")
        for file in glob.glob(str(src / "*.py")) + glob.glob(str(src / "generation_config.json")):
            shutil.copy(file, tmp)  # keeps an unquantized folder loadable by transformers with remote code
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def configure_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Convert a DFlash draft to MLX format.")
    parser.add_argument("--hf-path", required=True, help="Draft folder or Hugging Face Hub id (ours or z-lab's).")
    parser.add_argument("--mlx-path", default="mlx_model", help="Output folder; must not exist yet.")
    parser.add_argument("-q", "--quantize", action="store_true", help="Quantize the draft's linear layers.")
    parser.add_argument("--q-group-size", type=int, default=None, help="Group size for quantization (default 64).")
    parser.add_argument("--q-bits", type=int, default=None, help="Bits per weight for quantization (default 4).")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="Cast floating weights to this dtype.")
    return parser


def main() -> None:
    parser = configure_parser()
    args = parser.parse_args()
    check_model_path(parser, "--hf-path", args.hf_path, draft=True)
    path = convert(**vars(args))
    print(f"[INFO] Saved the MLX draft to {path}")


if __name__ == "__main__":
    main()
