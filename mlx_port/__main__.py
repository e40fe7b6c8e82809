"""`python -m mlx_port convert ...` and `python -m mlx_port generate ...`, as `mlx_lm generate` does: running a
command through the package avoids runpy's warning for `python -m mlx_port.generate`, a module that importing the
package has already loaded."""

import importlib
import sys

COMMANDS = ("convert", "generate")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python -m mlx_port {{{','.join(COMMANDS)}}} [options]  (--help after a command for its options)")
    command = sys.argv.pop(1)
    sys.argv[0] = f"python -m mlx_port {command}"
    importlib.import_module(f"mlx_port.{command}").main()


if __name__ == "__main__":
    main()
