"""`python -m mlx_port convert ...` and `python -m mlx_port generate ...`, as `mlx_lm generate` does: running a
command through the package avoids runpy's warning for `python -m mlx_port.generate`, a module that importing the
package has already loaded."""

import importlib
import sys

COMMANDS = ("convert", "generate")


USAGE = f"usage: python -m mlx_port {{{','.join(COMMANDS)}}} [options]  (--help after a command for its options)"


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(
            f"{USAGE}\n\n  convert   convert (and quantize) a DFlash draft for MLX\n"
            "  generate  generate with an mlx-lm target and a DFlash draft"
        )
        return
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    command = sys.argv.pop(1)
    sys.argv[0] = f"python -m mlx_port {command}"
    importlib.import_module(f"mlx_port.{command}").main()


if __name__ == "__main__":
    main()
