"""Benchmark and evaluation harness for DFlash: `python -m bench --help`. Prompt sets: `bench.datasets.load_prompts`.

Kept import-light (no torch) so that `python -m bench.prepare_data` runs in a throwaway venv."""
