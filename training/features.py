"""Offline target features: the frozen target runs once over the training sequences, and training reads what its loss
needs from disk instead of re-running the target every step (SpecForge's `prepare_hidden_states` does the same).

Per sequence the cache holds the read layers' features `[L, len(ids) * H]`, the final normed hidden states `[L, H]`
(the teacher's logits come from them through the shared head) and the target's greedy next token over its full
vocabulary (`-1` before the response, where the loss never looks), in bfloat16 safetensors shards beside
`manifest.json`. The manifest records the target's weights hash, the layer ids, the pass dtype and a hash of the
data; a cache that does not match the run is refused. Shards are written to a temporary name and renamed, and the
manifest after them, so an interrupted build resumes where the last recorded shard ends. A build holds a lock on the
folder: a second builder waits for the first, then finds the cache complete.
"""

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.io import atomic_path, write_json_atomic

from .data import Sequence
from .trainer import collate, data_hash, target_greedy, target_pass

MANIFEST = "manifest.json"
LOCK = "build.lock"
FORMAT = 1
STORE_DTYPE = torch.bfloat16


@dataclass
class CachedBatch:
    """A padded batch as `block_loss` takes it: token batch, target output `(features, final_hidden)` and greedy
    labels."""

    batch: dict[str, torch.Tensor]
    target_out: tuple[torch.Tensor, torch.Tensor]
    greedy: torch.Tensor


LOAD_FIELDS = ("dtype", "torch_dtype", "_name_or_path", "transformers_version")  # how it was loaded, not what it is


def target_hash(target) -> str:
    """sha256 of the target's config and of every weight rounded to bfloat16, so fp32 and bf16 loads agree."""
    config = {k: v for k, v in target.config.get_text_config().to_dict().items() if k not in LOAD_FIELDS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in sorted(target.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().to("cpu", STORE_DTYPE).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def bytes_per_token(hidden_size: int, num_layers: int) -> int:
    """Features and final hidden state in bfloat16, the greedy label and the token id in int32."""
    return (num_layers + 1) * hidden_size * STORE_DTYPE.itemsize + 8


def expected_manifest(target, sequences: list[Sequence], layer_ids: list[int], dtype: torch.dtype) -> dict:
    return {
        "format": FORMAT,
        "target": target_hash(target),
        "target_layer_ids": list(layer_ids),
        "dtype": str(dtype).removeprefix("torch."),
        "data": data_hash(sequences),
        "num_sequences": len(sequences),
        "hidden_size": target.config.get_text_config().hidden_size,
    }


def check_manifest(found: dict, expected: dict, path: Path) -> None:
    """Refuses a cache made for another target, layer set, dtype or data, naming what differs."""
    changed = sorted(k for k in expected if found.get(k) != expected[k])
    if changed:
        raise ValueError(
            f"feature cache {path} was built for another {', '.join(changed)} than this run; "
            "use another --feature-cache folder (or delete that one)"
        )


def shard_ranges(sequences: list[Sequence], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive `[start, end)` sequence ranges of about `shard_tokens` tokens each."""
    ranges, start, tokens = [], 0, 0
    for i, s in enumerate(sequences):
        tokens += len(s.input_ids)
        if tokens >= shard_tokens:
            ranges.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(sequences):
        ranges.append((start, len(sequences)))
    return ranges


@torch.no_grad()
def shard_tensors(
    target, sequences: list[Sequence], layer_ids: list[int], batch_size: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """One shard: every sequence's features, final hidden states and greedy labels, concatenated in order.

    Batches group sequences of similar length (less padding); the target's head runs only from the response on.
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].input_ids))
    rows: dict[int, tuple] = {}
    device = target.device
    for i in range(0, len(order), batch_size):
        ids = order[i : i + batch_size]
        batch = collate([sequences[j] for j in ids], pad_id)
        features, final = target_pass(target, batch["input_ids"].to(device), batch["lengths"].to(device), layer_ids)
        for row, j in enumerate(ids):
            s = sequences[j]
            length, start = len(s.input_ids), max(s.loss_start - 1, 0)
            greedy = torch.full((length,), -1, dtype=torch.int32)
            greedy[start:] = target_greedy(target, final[row : row + 1, start:length]).view(-1).to("cpu", torch.int32)
            rows[j] = (
                features[row, :length].to("cpu", STORE_DTYPE),
                final[row, :length].to("cpu", STORE_DTYPE),
                greedy,
            )
    lengths = torch.tensor([len(s.input_ids) for s in sequences])
    return {
        "features": torch.cat([rows[j][0] for j in range(len(sequences))]),
        "final_hidden": torch.cat([rows[j][1] for j in range(len(sequences))]),
        "greedy": torch.cat([rows[j][2] for j in range(len(sequences))]),
        "input_ids": torch.tensor([t for s in sequences for t in s.input_ids], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "loss_starts": torch.tensor([s.loss_start for s in sequences]),
    }


@contextlib.contextmanager
def build_lock(cache_dir: Path):
    """Holds the folder's build lock; a second builder waits here until the first has finished."""
    with open(cache_dir / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"the feature cache in {cache_dir} is being built by another process; waiting for it", file=sys.stderr
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_feature_cache(
    target,
    sequences: list[Sequence],
    cache_dir: Path,
    layer_ids: list[int],
    *,
    pad_id: int = 0,
    batch_size: int = 8,
    shard_tokens: int = 1 << 18,
    progress: bool = True,
) -> "FeatureCache":
    """Runs the target over `sequences` and writes the cache to `cache_dir`, resuming a partial build of the same run.

    Refuses a folder holding another run's cache, or a disk without room for what is still to be written.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(cache_dir):
        return build_locked(target, sequences, cache_dir, layer_ids, pad_id, batch_size, shard_tokens, progress)


def build_locked(target, sequences, cache_dir, layer_ids, pad_id, batch_size, shard_tokens, progress) -> "FeatureCache":
    from tqdm.auto import tqdm

    expected = expected_manifest(target, sequences, layer_ids, target.dtype)
    manifest_path = cache_dir / MANIFEST
    manifest = (
        json.loads(manifest_path.read_text())
        if manifest_path.exists()
        else {**expected, "shards": [], "complete": False}
    )
    check_manifest(manifest, expected, cache_dir)
    if manifest["complete"]:  # another builder finished it while this one waited
        return FeatureCache(cache_dir)
    manifest.setdefault("shard_tokens", shard_tokens)
    done = manifest["shards"][-1]["end"] if manifest["shards"] else 0
    todo = [(a + done, b + done) for a, b in shard_ranges(sequences[done:], manifest["shard_tokens"])]
    remaining = sum(len(s.input_ids) for s in sequences[done:])
    need = remaining * bytes_per_token(expected["hidden_size"], len(layer_ids))
    free = shutil.disk_usage(cache_dir).free
    if need > free:
        raise ValueError(
            f"the feature cache needs about {need / 1e9:.1f} GB more in {cache_dir}, and {free / 1e9:.1f} GB is free"
        )
    bar = tqdm(total=remaining, desc=f"target features ({need / 1e9:.1f} GB)", unit="tok", disable=not progress)
    for a, b in todo:
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        tensors = shard_tensors(target, sequences[a:b], layer_ids, batch_size, pad_id)
        with atomic_path(cache_dir / name) as tmp:
            save_file(tensors, tmp)
        manifest["shards"].append({"file": name, "start": a, "end": b})
        write_json_atomic(manifest_path, manifest)
        bar.update(int(tensors["offsets"][-1]))
    bar.close()
    manifest["complete"] = True
    write_json_atomic(manifest_path, manifest)
    return FeatureCache(cache_dir)


def check_coverage(shards: list[dict], rows: list[int], num_sequences: int, path: Path) -> None:
    """Refuses a manifest whose shards do not tile `[0, num_sequences)` in order, each holding its recorded rows."""
    end = 0
    for shard, n in zip(shards, rows):
        if shard["start"] != end or shard["end"] - shard["start"] != n:
            raise ValueError(
                f"the feature cache in {path} is corrupt: {shard['file']} holds sequences "
                f"[{shard['start']}, {shard['end']}) ({n} rows) where sequence {end} comes next; delete it and rebuild"
            )
        end = shard["end"]
    if end != num_sequences:
        raise ValueError(
            f"the feature cache in {path} is corrupt: its shards end at sequence {end} of {num_sequences}; "
            "delete it and rebuild"
        )


class FeatureCache:
    """Reads a built cache lazily (memory-mapped shards), one sequence or one padded batch at a time."""

    def __init__(self, cache_dir: Path):
        self.path = Path(cache_dir)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise ValueError(
                f"{self.path} holds no feature cache (no {MANIFEST}); build it with python -m training.features"
            )
        self.manifest = json.loads(manifest_path.read_text())
        if not self.manifest.get("complete"):
            raise ValueError(f"the feature cache in {self.path} is incomplete; re-run its build command to finish it")
        self.shards = [safe_open(self.path / s["file"], "pt") for s in self.manifest["shards"]]
        self.offsets = [f.get_tensor("offsets") for f in self.shards]
        self.loss_starts = [f.get_tensor("loss_starts") for f in self.shards]
        check_coverage(
            self.manifest["shards"], [len(o) - 1 for o in self.offsets], self.manifest["num_sequences"], self.path
        )
        self.where = [
            (k, i - s["start"]) for k, s in enumerate(self.manifest["shards"]) for i in range(s["start"], s["end"])
        ]

    def __len__(self) -> int:
        return len(self.where)

    def check(self, target, sequences: list[Sequence], layer_ids: list[int]) -> None:
        """Refuses to train `sequences` with this cache unless it was built from them, by this target and layers."""
        expected = expected_manifest(target, sequences, layer_ids, torch.float32)
        expected["dtype"] = self.manifest["dtype"]  # any pass dtype serves; the manifest says which
        check_manifest(self.manifest, expected, self.path)

    def sequence(self, index: int) -> dict[str, torch.Tensor]:
        shard, row = self.where[index]
        a, b = (int(x) for x in self.offsets[shard][row : row + 2])
        f = self.shards[shard]
        return {name: f.get_slice(name)[a:b] for name in ("features", "final_hidden", "greedy", "input_ids")}

    def batch(self, indices: list[int], pad_id: int, device="cpu") -> CachedBatch:
        """Right-padded `[b, L, ...]` tensors (features in float32, as the draft's `fc` takes them)."""
        rows = [self.sequence(i) for i in indices]
        pad = torch.nn.utils.rnn.pad_sequence
        loss_starts = [int(self.loss_starts[k][r]) for k, r in (self.where[i] for i in indices)]
        batch = {
            "input_ids": pad([r["input_ids"].long() for r in rows], batch_first=True, padding_value=pad_id).to(device),
            "lengths": torch.tensor([len(r["input_ids"]) for r in rows], device=device),
            "loss_starts": torch.tensor(loss_starts, device=device),
        }
        features = pad([r["features"] for r in rows], batch_first=True).to(device, torch.float32)
        final = pad([r["final_hidden"] for r in rows], batch_first=True).to(device, torch.float32)
        greedy = pad([r["greedy"].long() for r in rows], batch_first=True, padding_value=-1).to(device)
        return CachedBatch(batch, (features, final), greedy)

    def manifest_summary(self) -> dict:
        tokens = sum(int(o[-1]) for o in self.offsets)
        return {
            "tokens": tokens,
            "gigabytes": round(sum((self.path / s["file"]).stat().st_size for s in self.manifest["shards"]) / 1e9, 2),
            **{k: self.manifest[k] for k in ("target_layer_ids", "dtype")},
        }


def open_feature_cache(
    target, sequences: list[Sequence], cache_dir: Path, layer_ids: list[int], **build
) -> FeatureCache:
    """The complete cache in `cache_dir` if it matches this run, else built (or finished) there first."""
    manifest = Path(cache_dir) / MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()).get("complete"):
        cache = FeatureCache(cache_dir)
        cache.check(target, sequences, layer_ids)
        return cache
    return build_feature_cache(target, sequences, cache_dir, layer_ids, **build)


def cli(argv=None) -> int:
    """`python -m training.features`: the training command's data flags plus `--feature-cache DIR`; builds only."""
    from .__main__ import cli as training_cli

    return training_cli(argv, features_only=True)


if __name__ == "__main__":
    import sys

    sys.exit(cli())
