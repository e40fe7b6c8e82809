"""Training loop: frozen target, trainable draft, random anchors with a block-sparse mask, weighted block loss.

The target's forward gives both the context features and its own next-token distributions, which serve as labels
(its argmax, what decoding must match) and as soft labels for distillation.
"""

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from configuration_dflash import DFlashConfig
from decoding_dflash import LayerFeatures
from head_dflash import draft_embedding
from modeling_dflash import DFlashDraftModel
from plan_dflash import base_model, check_draft_fits_target, decoder_layers

from .anchors import (
    additive_mask,
    anchor_attention_mask,
    block_inputs,
    default_gamma,
    dpace_weights,
    loss_weights,
    sample_anchors,
)
from .data import Sequence

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
DRAFT_FILES = {"config.json", "model.safetensors"}


@dataclass
class TrainConfig:
    """Optimisation settings; the paper's values where they apply (lr 6e-4, warmup 0.04, clip 1.0)."""

    num_anchors: int = 32  # blocks per sequence per step; 0: dense (one per `anchor_stride` response tokens)
    anchor_stride: int | None = None  # dense anchors: response tokens per anchor (None: the block size)
    batch_size: int = 4
    learning_rate: float = 6e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.04
    schedule: str = (
        "cosine"  # "cosine", or "wsd": warm up, hold, then decay linearly over the last `decay_ratio` of steps
    )
    decay_ratio: float = 0.2
    epochs: int = 1
    max_steps: int | None = None
    grad_clip: float = 1.0
    gamma: float | None = None  # None: the paper's value for the block size
    position_weights: str = (
        "decay"  # "decay": exp(-(k-1)/gamma); "dpace": D-PACE weights from the draft's own confidence
    )
    dpace_alpha: float = 0.5  # D-PACE smoothing of each position's acceptance probability (the paper's default)
    distill_weight: float = 0.5  # 0: hard labels only; 1: soft labels only
    updates_per_batch: int = (
        1  # optimizer steps per target pass, each with fresh anchors (the target pass dominates on CPU)
    )
    train_vocab_size: int | None = None  # train over the most frequent response tokens only (FR-Spec); None: all
    label_source: str = "target"  # "target": the target's argmax; "data": the sequence's own next token
    mixed_precision: str = (
        "no"  # "bf16": the draft's forward and backward under bfloat16 autocast (fp32 master weights)
    )
    bucket_by_length: bool = False  # batch sequences of similar length together (less padding)
    precondition_fc: bool = False  # train `fc` per input channel in units of that feature channel's RMS
    eval_every: int = 100
    save_every: int = 50
    time_budget_s: float | None = None
    seed: int = 0
    stop_after: int | None = None  # stop (as if interrupted) after this many steps; for tests


# ---------------------------------------------------------------------------------------------------------------------
# Building the draft.


def build_draft_config(
    target,
    *,
    num_layers: int = 3,
    target_layer_ids: list[int] | None = None,
    block_size: int = 8,
    mask_token_id: int | None = None,
) -> DFlashConfig:
    """A draft config that copies the target's attention and MLP shapes, so its layers can warm-start from it."""
    num_target_layers = len(decoder_layers(target))
    t = target.config.get_text_config()
    config = DFlashConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters=draft_rope_parameters(t),
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        tie_word_embeddings=False,
    )
    if mask_token_id is None:
        raise ValueError(
            "a mask token id is required: pick a token the target never writes (e.g. an unused special token)"
        )
    return config


def draft_rope_parameters(text_config) -> dict:
    """One RoPE for the draft's full-attention layers, from any layout a target config uses.

    transformers 5 writes one `rope_parameters` dict, or one per layer type (Gemma 3:
    `{"full_attention": ..., "sliding_attention": ...}`), of which the draft takes the full-attention one; older
    configs give `rope_theta` and `rope_scaling` at the top level.
    """
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    if not params:
        scaling = getattr(text_config, "rope_scaling", None) or {}
        params = {**scaling, "rope_theta": getattr(text_config, "rope_theta", 10000.0)}
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    return params


def new_draft(target, config: DFlashConfig, *, init: str = "target", seed: int = 0) -> DFlashDraftModel:
    """A fresh draft checked against `target`, warm-started from the target's last layers when `init == "target"`."""
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    check_draft_fits_target(draft, target)
    if init == "target":
        warm_start_from_target(draft, target)
    elif init != "random":
        raise ValueError(f"init must be 'target' or 'random', got {init!r}")
    return draft.float()


@torch.no_grad()
def warm_start_from_target(draft: DFlashDraftModel, target) -> list[int]:
    """Copies the target's last `n` layers into the draft's `n` layers where shapes match; returns their indices.

    `fc` starts by passing through the deepest feature layer, so the context looks like that layer's output.
    """
    layers = decoder_layers(target)
    sources = list(range(len(layers) - len(draft.layers), len(layers)))
    for layer, src in zip(draft.layers, sources):
        own, theirs = layer.state_dict(), layers[src].state_dict()
        own.update({k: v for k, v in theirs.items() if k in own and own[k].shape == v.shape})
        layer.load_state_dict(own)
        layer.self_attn.q_norm.weight.fill_(1.0)  # Llama has no q/k norm; ones keep the per-head scale
        layer.self_attn.k_norm.weight.fill_(1.0)
    hidden = draft.config.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, -hidden:] = torch.eye(hidden)
    base = base_model(target)
    if getattr(base, "norm", None) is not None and base.norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(base.norm.weight)
    draft.hidden_norm.weight.copy_(draft.layers[0].input_layernorm.weight)
    return sources


class InputScale(torch.nn.Module):
    """`fc.weight = P / scale` per input channel, with `P` trained: Adam then moves every feature channel's share of
    the context alike, however large the channel (SmolLM2's features span channel RMS from about 1 to 400)."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


@torch.no_grad()
def feature_scale(target, sequences: list[Sequence], layer_ids: list[int], pad_id: int) -> torch.Tensor:
    """Per-channel RMS of the target's context features over `sequences`, leaving out position 0: an attention
    sink whose features reach norms of 25k in SmolLM2."""
    batch = collate(sequences, pad_id)
    lengths = batch["lengths"].to(target.device)
    features, _ = target_pass(target, batch["input_ids"].to(target.device), lengths, layer_ids)
    positions = torch.arange(features.shape[1], device=features.device)
    valid = (positions[None] < lengths[:, None]) & (positions[None] > 0)
    return features[valid].float().pow(2).mean(0).sqrt().clamp(min=1e-3)


def precondition_fc(draft: DFlashDraftModel, scale: torch.Tensor) -> None:
    """Trains `fc` through `InputScale`; the function is unchanged (see `fold_fc`, which restores a plain weight)."""
    torch.nn.utils.parametrize.register_parametrization(draft.fc, "weight", InputScale(scale.to(draft.fc.weight)))


def fold_fc(draft: DFlashDraftModel) -> None:
    """Replaces a preconditioned `fc` by its plain weight, the published layout."""
    if torch.nn.utils.parametrize.is_parametrized(draft.fc):
        torch.nn.utils.parametrize.remove_parametrizations(draft.fc, "weight", leave_parametrized=True)


# ---------------------------------------------------------------------------------------------------------------------
# One step.


def collate(sequences: list[Sequence], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(s.input_ids) for s in sequences)
    return {
        "input_ids": torch.tensor([s.input_ids + [pad_id] * (width - len(s.input_ids)) for s in sequences]),
        "lengths": torch.tensor([len(s.input_ids) for s in sequences]),
        "loss_starts": torch.tensor([s.loss_start for s in sequences]),
    }


@torch.no_grad()
def target_pass(target, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: list[int]):
    """Context features `[b, L, len(ids) * H]` and the final normed hidden states `[b, L, H]` of the frozen target."""
    attention_mask = (torch.arange(input_ids.shape[1], device=input_ids.device)[None] < lengths[:, None]).long()
    base = base_model(target)
    with LayerFeatures(target, layer_ids) as features:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return features.pop(), out.last_hidden_state


@torch.no_grad()
def target_greedy(target, final_hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """`[b, L]` the target's argmax over its full vocabulary after each position (chunked: the head is wide)."""
    lm_head = target.get_output_embeddings()
    flat = final_hidden.flatten(0, 1)
    return torch.cat([lm_head(flat[i : i + chunk]).argmax(-1) for i in range(0, len(flat), chunk)]).view(
        final_hidden.shape[:2]
    )


def frequent_tokens(sequences: list[Sequence], size: int) -> torch.Tensor:
    """Sorted ids of the `size` most frequent response tokens: the vocabulary the loss is computed over."""
    counts = torch.zeros(max(max(s.input_ids) for s in sequences) + 1, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(torch.tensor(s.input_ids[s.loss_start :]), minlength=len(counts))
    return counts.topk(min(size, len(counts))).indices.sort().values


def block_loss(
    draft,
    target,
    batch: dict,
    *,
    num_anchors: int,
    generator: torch.Generator,
    weights: torch.Tensor,
    distill_weight: float,
    label_source: str = "target",
    vocab: torch.Tensor | None = None,
    target_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    greedy: torch.Tensor | None = None,
    anchor_stride: int | None = None,
    dpace_alpha: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Weighted block loss over `num_anchors` random blocks per sequence (0: dense, about one per `block_size`
    response tokens, or per `anchor_stride`), all in one draft pass.

    Hard labels are the target's argmax over its full vocabulary (`label_source="target"`; `greedy` from
    `target_greedy` saves recomputing it) or the data's next tokens. `vocab` restricts the teacher and draft logits to
    those token ids (the head is the costliest part on CPU): the draft then proposes only those at decode time, so
    positions whose label lies outside `vocab` are left out of the loss but count as misses in the metrics.
    Returns the loss and metrics: `accuracy_1` (first drafted token right) and `tau` (teacher-forced acceptance
    length, bonus included, over blocks with all labels inside the sequence). `target_out` reuses a `target_pass`.
    With `dpace_alpha`, D-PACE weights from the draft's probability of each hard label replace the fixed `weights`,
    and the loss is a sum per block (the paper's reduction) rather than a weighted mean.
    """
    unwrapped = getattr(draft, "module", draft)  # DDP wraps the draft: its config and embedding are on `.module`
    config = unwrapped.config
    block, device = config.block_size, batch["input_ids"].device
    input_ids, lengths = batch["input_ids"], batch["lengths"]
    features, final_hidden = target_out or target_pass(target, input_ids, lengths, config.target_layer_ids)
    anchors, valid = sample_anchors(
        batch["loss_starts"].cpu(), lengths.cpu(), num_anchors, generator, block, anchor_stride
    )
    anchors, valid = anchors.to(device), valid.to(device)
    tokens, labels, in_sequence = block_inputs(input_ids, anchors, valid, lengths, block, config.mask_token_id)
    b, m = anchors.shape
    context_len = input_ids.shape[1]
    positions = torch.cat(
        [
            torch.arange(context_len, device=device).expand(b, -1),
            (anchors[..., None] + torch.arange(block, device=device)).flatten(1),
        ],
        dim=1,
    )
    mask = additive_mask(anchor_attention_mask(anchors, context_len, block), torch.float32)
    # the target's distribution for position a+k is its output at a+k-1
    source = (anchors[..., None] + torch.arange(block - 1, device=device)).clamp(max=context_len - 1).flatten(1)
    head_weight, head_bias, vocab = frozen_head(target, vocab, getattr(unwrapped, "dtype", torch.float32))
    with torch.no_grad():
        noise = draft_embedding(unwrapped, target)(tokens.flatten(1)).to(head_weight.dtype)
        gathered = final_hidden.gather(1, source[..., None].expand(-1, -1, final_hidden.shape[-1])).to(
            head_weight.dtype
        )
        teacher = torch.nn.functional.linear(gathered, head_weight, head_bias).float().view(b, m, block - 1, -1)
    if label_source == "target" and vocab is None and greedy is None:
        labels = teacher.argmax(-1)
    elif label_source == "target":  # the teacher above sees `vocab` only; the label is its choice over all tokens
        greedy = greedy if greedy is not None else target_greedy(target, final_hidden)
        labels = greedy.gather(1, source).view(b, m, block - 1).masked_fill(~in_sequence, 0)
    hard, trained = (labels, in_sequence) if vocab is None else full_to_subset(labels, in_sequence, vocab)
    hidden = draft(
        noise_embeds=noise, context_hidden_states=features, position_ids=positions, attention_mask=mask
    ).last_hidden_state
    logits = torch.nn.functional.linear(hidden.view(b, m, block, -1)[:, :, 1:], head_weight, head_bias).float()
    log_probs = logits.log_softmax(-1)
    hard_ce = -log_probs.gather(-1, hard[..., None])[..., 0]
    soft_ce = -(teacher.softmax(-1) * log_probs).sum(-1) if distill_weight > 0 else torch.zeros_like(hard_ce)
    per_token = (1 - distill_weight) * hard_ce + distill_weight * soft_ce
    if dpace_alpha is None:
        w = weights.to(device)[None, None] * trained
        loss = (per_token * w).sum() / w.sum().clamp(min=1e-6)
    else:
        w = dpace_weights(torch.exp(-hard_ce.detach()), trained, dpace_alpha)
        loss = (per_token * w).sum() / trained.any(-1).sum().clamp(min=1)
    proposed = logits.detach().argmax(-1)
    metrics = block_metrics(proposed if vocab is None else vocab[proposed], labels, in_sequence)
    return loss, {**metrics, "trained_blocks": int(valid.sum())}


def frozen_head(target, vocab: torch.Tensor | None, dtype: torch.dtype):
    """The target's head weight and bias in the draft's `dtype`, detached (the shared head never trains), restricted
    to `vocab` if given. A bf16 target's head in a float32 draft's matmuls is several times slower on CPU."""
    lm_head = target.get_output_embeddings()
    weight, bias = lm_head.weight.detach().to(dtype), None if lm_head.bias is None else lm_head.bias.detach().to(dtype)
    if vocab is None:
        return weight, bias, None
    vocab = vocab.to(weight.device)
    return weight[vocab], None if bias is None else bias[vocab], vocab


@torch.no_grad()
def block_metrics(proposed: torch.Tensor, labels: torch.Tensor, in_sequence: torch.Tensor) -> dict:
    """First-token accuracy and teacher-forced tau of `[b, m, B-1]` proposals against the labels."""
    right = (proposed == labels) & in_sequence
    full = in_sequence.all(-1)
    accepted = right.long().cumprod(-1).sum(-1)
    return {
        "accuracy_1": float(right[..., 0].sum() / in_sequence[..., 0].sum().clamp(min=1)),
        "tau": float((accepted[full] + 1).float().mean()) if bool(full.any()) else float("nan"),
        "blocks": int(full.sum()),
    }


def full_to_subset(labels: torch.Tensor, label_mask: torch.Tensor, vocab: torch.Tensor):
    """Maps token ids to indices in the sorted `vocab`, and masks the labels that lie outside it."""
    index = torch.searchsorted(vocab, labels).clamp(max=len(vocab) - 1)
    return index, label_mask & (vocab[index] == labels)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and output.


def same_architecture(config: dict) -> dict:
    """A draft config without where it was loaded from: resuming from another copy of the same draft is fine."""
    return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}


def lr_lambda(total_steps: int, warmup_ratio: float, schedule: str = "cosine", decay_ratio: float = 0.2):
    """LR factor by step (never by wall time, so a resumed run follows the same curve)."""
    if schedule not in ("cosine", "wsd"):
        raise ValueError(f"schedule must be 'cosine' or 'wsd', got {schedule!r}")
    warmup = max(1, round(total_steps * warmup_ratio))
    decay_start = total_steps - max(1, round(total_steps * decay_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "wsd":
            return 1.0 if step < decay_start else max(0.0, (total_steps - step) / (total_steps - decay_start))
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


FINGERPRINT_IGNORES = {"eval_every", "save_every", "time_budget_s", "stop_after"}


def data_hash(sequences: list[Sequence]) -> str:
    data = hashlib.sha256()
    for s in sequences:
        data.update(f"{s.id}:{s.loss_start}:{','.join(map(str, s.input_ids))};".encode())
    return data.hexdigest()


def settings_fingerprint(config: TrainConfig, sequences: list[Sequence]) -> dict:
    """What decides which batch, anchors and LR each step gets: the settings and a hash of the training data."""
    settings = {k: v for k, v in asdict(config).items() if k not in FINGERPRINT_IGNORES}
    return {**settings, "data": data_hash(sequences)}


def check_resume(saved: dict | None, current: dict, path: Path) -> None:
    """Refuses to resume a run whose settings or data changed: the steps left would see other batches and LRs."""
    changed = sorted(k for k in current if (saved or {}).get(k) != current[k])
    if changed:
        raise ValueError(
            f"{path} was written with other training settings or data ({', '.join(changed)}); resuming would remap "
            "batches and the LR schedule. Use another --run-dir, or --allow-changed-settings to continue anyway."
        )


def atomic_torch_save(obj, path: Path) -> None:
    """Writes to a temporary file in the same folder, then renames: a crash never leaves a half-written checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_output_dir(path: Path, overwrite: bool = False) -> None:
    """Refuses an output folder that holds anything but a previous DFlash draft, and a draft unless `overwrite`."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not path.is_dir():
        raise FileExistsError(f"output {path} exists and is not a folder")
    config = path / "config.json"
    is_draft = config.exists() and "DFlashDraftModel" in json.loads(config.read_text()).get("architectures", [])
    if not is_draft:
        raise FileExistsError(
            f"output folder {path} holds other files; refusing to overwrite it. Choose an empty or new folder"
        )
    if not overwrite:
        raise FileExistsError(f"output folder {path} already holds a DFlash draft; pass --overwrite to replace it")


def save_draft(draft: DFlashDraftModel, output: Path, *, overwrite: bool = False) -> Path:
    """`save_pretrained` into a temporary sibling, then swapped in: the old draft stays until the new one is
    complete."""
    output = Path(output)
    check_output_dir(output, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        draft.save_pretrained(tmp)
        if output.exists():
            old = output.with_name(f".{output.name}-old-{os.getpid()}")
            output.rename(old)
            tmp.rename(output)
            shutil.rmtree(old)
        else:
            tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def install_weights(draft_dir: Path, repo_root: Path, config=None) -> None:
    """Moves just `config.json` (or `config`, written in its place) and `model.safetensors` of a saved draft into a
    model repo, each by an atomic rename."""
    for name in sorted(DRAFT_FILES):
        tmp = repo_root / f".{name}.tmp"
        if name == "config.json" and config is not None:
            config.to_json_file(tmp)
        else:
            shutil.copyfile(draft_dir / name, tmp)
        os.replace(tmp, repo_root / name)


# ---------------------------------------------------------------------------------------------------------------------
# The loop.


BUCKET_BATCHES = 16  # batches per length-sorted window: similar lengths, still a random order


def batch_order(
    num_sequences: int,
    batch_size: int,
    epoch: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """This process's batches for `epoch`: a seeded shuffle, so a resumed run sees the same order. With `lengths`,
    each window of `BUCKET_BATCHES` batches is sorted by length before it is cut, and the batches are shuffled."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(num_sequences, generator=generator).tolist()
    if lengths is not None:
        window = batch_size * BUCKET_BATCHES
        order = [
            i for w in range(0, num_sequences, window) for i in sorted(order[w : w + window], key=lengths.__getitem__)
        ]
    batches = [order[i : i + batch_size] for i in range(0, num_sequences, batch_size)]
    if lengths is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    usable = len(batches) - len(batches) % world if len(batches) >= world else len(batches)
    return batches[rank:usable:world]


@torch.no_grad()
def evaluate(
    draft,
    target,
    sequences: dict[str, list[Sequence]],
    *,
    num_anchors: int,
    weights: torch.Tensor,
    pad_id: int,
    batch_size: int = 4,
    seed: int = 1234,
) -> dict[str, dict]:
    """Held-out loss and teacher-forced tau per set, with fixed anchors so numbers compare across steps."""
    draft.eval()
    results = {}
    # tau as decoding sees it: a draft trained on a subset proposes from that subset only
    vocab = None if draft.config.draft_vocab is None else torch.tensor(draft.config.draft_vocab, device=target.device)
    for name, seqs in sequences.items():
        generator = torch.Generator().manual_seed(seed)
        losses, taus, blocks = [], [], 0
        for i in range(0, len(seqs), batch_size):
            batch = {k: v.to(target.device) for k, v in collate(seqs[i : i + batch_size], pad_id).items()}
            loss, metrics = block_loss(
                draft,
                target,
                batch,
                num_anchors=num_anchors,
                generator=generator,
                weights=weights,
                distill_weight=0.0,
                vocab=vocab,
            )
            losses.append(float(loss))
            if metrics["blocks"]:
                taus.append(metrics["tau"] * metrics["blocks"])
                blocks += metrics["blocks"]
        results[name] = {"loss": sum(losses) / max(len(losses), 1), "tau": sum(taus) / max(blocks, 1)}
    draft.train()
    return results


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[Callable[[], bool]]:
    """Ctrl-C asks the loop to stop at the next step, which then checkpoints (a second Ctrl-C stops at once);
    yields whether it was asked."""
    asked = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
        yield lambda: False
        return

    def ask(signum, frame):
        asked.append(signum)
        signal.signal(signal.SIGINT, previous)
        logger.warning("stopping after this step and checkpointing (Ctrl-C again to stop at once)")

    previous = signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def train(
    draft: DFlashDraftModel,
    target,
    train_sequences: list[Sequence],
    run_dir: Path,
    config: TrainConfig,
    *,
    eval_sequences: dict[str, list[Sequence]] | None = None,
    pad_id: int = 0,
    accelerator=None,
    progress: bool = True,
    allow_changed_settings: bool = False,
    feature_cache=None,
) -> dict:
    """Trains `draft` in place against the frozen `target`, resuming from `run_dir/checkpoint.pt` if present.

    With `feature_cache` (a `training.features.FeatureCache` built from `train_sequences`), the target's features,
    final hidden states and greedy labels come from disk and the target never runs a training forward.

    With `train_vocab_size`, the draft's config records that vocabulary (`draft_vocab`), which decoding then proposes
    from. A checkpoint written with other settings or data is refused unless `allow_changed_settings`.

    Ctrl-C stops it cleanly at the next step, checkpointed; calling it again resumes there.

    Returns a summary with the last step, the steps planned, the held-out evaluations, whether training finished
    and whether Ctrl-C stopped it.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    if not train_sequences:
        raise ValueError("the training dataset is empty: no sequence has a response with at least two tokens")
    if any(layer.self_attn.causal or layer.self_attn.sliding_window for layer in draft.layers):
        raise ValueError(
            "training supports drafts whose layers are all non-causal full attention: the one-pass block "
            "mask does not model causal or sliding-window layers"
        )
    if config.mixed_precision not in ("no", "bf16"):
        raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {config.mixed_precision!r}")
    if config.position_weights not in ("decay", "dpace"):
        raise ValueError(f"position_weights must be 'decay' or 'dpace', got {config.position_weights!r}")
    if config.num_anchors < 0:
        raise ValueError(f"num_anchors must be positive, or 0 for dense anchors; got {config.num_anchors}")
    accelerator = accelerator or Accelerator()
    target.requires_grad_(False).eval().to(accelerator.device)
    if feature_cache is not None:
        feature_cache.check(target, train_sequences, draft.config.target_layer_ids)
    weights = loss_weights(draft.config.block_size, config.gamma or default_gamma(draft.config.block_size))
    vocab = frequent_tokens(train_sequences, config.train_vocab_size) if config.train_vocab_size else None
    draft.config.draft_vocab = None if vocab is None else vocab.tolist()
    fingerprint = settings_fingerprint(config, train_sequences)
    repeats = config.updates_per_batch
    lengths = [len(s.input_ids) for s in train_sequences] if config.bucket_by_length else None
    steps_per_epoch = repeats * len(
        batch_order(len(train_sequences), config.batch_size, 0, config.seed, 0, accelerator.num_processes)
    )
    total_steps = config.max_steps or steps_per_epoch * config.epochs
    if config.precondition_fc:
        precondition_fc(draft, feature_scale(target, train_sequences[:8], draft.config.target_layer_ids, pad_id))
    optimizer = torch.optim.AdamW(
        draft.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay, betas=(0.9, 0.95)
    )
    factor = lr_lambda(total_steps, config.warmup_ratio, config.schedule, config.decay_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    step, history = 0, []
    checkpoint_path = Path(run_dir) / CHECKPOINT_NAME
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        if same_architecture(state["draft_config"]) != same_architecture(draft.config.to_dict()):
            raise ValueError(f"{checkpoint_path} was written for a different draft config; use another --run-dir")
        if not allow_changed_settings:
            check_resume(state.get("fingerprint"), fingerprint, checkpoint_path)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history = state["step"], state["history"]
        logger.info("resumed from %s at step %d", checkpoint_path, step)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    model = accelerator.unwrap_model(draft)
    model.train()

    def save() -> None:
        if accelerator.is_main_process:
            state = {
                "draft": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "history": history,
                "draft_config": model.config.to_dict(),
                "train_config": asdict(config),
                "fingerprint": fingerprint,
            }
            atomic_torch_save(state, checkpoint_path)
        accelerator.wait_for_everyone()

    def run_eval() -> None:
        if eval_sequences and accelerator.is_main_process:
            result = evaluate(
                model, target, eval_sequences, num_anchors=config.num_anchors, weights=weights, pad_id=pad_id
            )
            history.append({"step": step, **{f"{k}/{m}": v[m] for k, v in result.items() for m in v}})
            logger.info(
                "step %d held-out (teacher-forced, target-greedy): %s",
                step,
                "  ".join(f"{k} tau {v['tau']:.2f} loss {v['loss']:.3f}" for k, v in result.items()),
            )

    start_time, finished, cached = time.monotonic(), True, None
    speed, first_step = {"seconds": 0.0, "blocks": 0, "tokens": 0, "steps": 0}, step
    autocast = torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=config.mixed_precision == "bf16")
    bar = tqdm(
        total=total_steps,
        initial=step,
        desc="training draft",
        unit="step",
        disable=not progress or not accelerator.is_main_process,
    )
    if step == 0:
        run_eval()
    with stop_on_interrupt() as interrupted:
        while step < total_steps:
            if (
                config.stop_after is not None
                and step >= config.stop_after
                or (config.time_budget_s is not None and time.monotonic() - start_time > config.time_budget_s)
                or interrupted()
            ):
                finished = False
                break
            t0 = time.monotonic()
            epoch, index = divmod(step, steps_per_epoch)
            new_batch = cached is None or cached[0] != (epoch, index // repeats)
            if new_batch:
                ids = batch_order(
                    len(train_sequences),
                    config.batch_size,
                    epoch,
                    config.seed,
                    accelerator.process_index,
                    accelerator.num_processes,
                    lengths,
                )[index // repeats]
                cached = (
                    (epoch, index // repeats),
                    *target_batch(
                        target,
                        train_sequences,
                        ids,
                        model.config.target_layer_ids,
                        pad_id,
                        accelerator.device,
                        feature_cache,
                        vocab is not None and config.label_source == "target",
                    ),
                )
            batch, target_out, greedy = cached[1:]
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 101 + accelerator.process_index)
            with autocast:
                loss, metrics = block_loss(
                    draft,
                    target,
                    batch,
                    num_anchors=config.num_anchors,
                    generator=generator,
                    weights=weights,
                    distill_weight=config.distill_weight,
                    label_source=config.label_source,
                    vocab=vocab,
                    target_out=target_out,
                    greedy=greedy,
                    anchor_stride=config.anchor_stride,
                    dpace_alpha=config.dpace_alpha if config.position_weights == "dpace" else None,
                )
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(draft.parameters(), config.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            elapsed = time.monotonic() - t0
            tokens_per_s = int(batch["lengths"].sum()) / elapsed
            if step > first_step + 1:  # the first step warms up
                speed["seconds"] += elapsed
                speed["blocks"] += metrics["trained_blocks"]
                speed["tokens"] += int(batch["lengths"].sum()) if new_batch else 0
                speed["steps"] += 1
            bar.update(1)
            bar.set_postfix(
                loss=f"{float(loss.detach()):.3f}",
                acc1=f"{metrics['accuracy_1']:.2f}",
                tau=f"{metrics['tau']:.2f}",
                tok_s=f"{tokens_per_s:.0f}",
                lr=f"{scheduler.get_last_lr()[0]:.1e}",
                gnorm=f"{float(grad_norm):.2f}",
            )
            if step % config.save_every == 0:
                save()
            if config.eval_every and step % config.eval_every == 0:
                run_eval()
        stopped_by_user = interrupted()
    bar.close()
    save()
    if finished and (not history or history[-1]["step"] != step):
        run_eval()
    fold_fc(model)
    return {
        "step": step,
        "total_steps": total_steps,
        "finished": finished,
        "interrupted": stopped_by_user,
        "history": history,
        "throughput": throughput(speed),
    }


def throughput(speed: dict) -> dict:
    """Trained blocks and training tokens (each batch's tokens once, however many updates reuse it) per second."""
    seconds = max(speed["seconds"], 1e-9)
    return {
        "steps": speed["steps"],
        "blocks_per_s": round(speed["blocks"] / seconds, 1),
        "tokens_per_s": round(speed["tokens"] / seconds, 1),
    }


def target_batch(
    target,
    sequences: list[Sequence],
    ids: list[int],
    layer_ids: list[int],
    pad_id: int,
    device,
    feature_cache=None,
    need_greedy: bool = False,
) -> tuple[dict, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """A batch with the target's output for it: read from `feature_cache`, or from a target forward."""
    if feature_cache is not None:
        cached = feature_cache.batch(ids, pad_id, device)
        return cached.batch, cached.target_out, cached.greedy
    batch = {k: v.to(device) for k, v in collate([sequences[i] for i in ids], pad_id).items()}
    target_out = target_pass(target, batch["input_ids"], batch["lengths"], layer_ids)
    return batch, target_out, target_greedy(target, target_out[1]) if need_greedy else None


@torch.no_grad()
def measure_acceptance(
    draft,
    target,
    tokenizer,
    examples: list[dict],
    *,
    max_new_tokens: int = 64,
    block_size: int | None = None,
    max_prompt_tokens: int = 256,
) -> float:
    """Mean acceptance length (bonus included) of real greedy `spec_generate` runs over `examples`' prompts."""
    from .data import encode_prompt

    stop = [t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} if isinstance(t, int)]
    lengths = []
    for example in examples:
        ids = torch.tensor([encode_prompt(tokenizer, example["messages"], max_prompt_tokens)], device=target.device)
        out = draft.spec_generate(
            target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop, block_size=block_size, return_stats=True
        )
        lengths += out.acceptance_lengths
    return sum(lengths) / max(len(lengths), 1)
