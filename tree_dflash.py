"""Draft trees from one DFlash pass (DDTree, Ringel et al. 2026), verified in one target pass.

A DFlash draft gives a distribution at every block position at once. Instead of verifying its argmax chain, build a
tree best-first on the product of the draft's probabilities along each path, verify all of it in one target pass
with an ancestor-only mask, and walk from the root along the children that hold the target's choices. A chain is the
tree whose every node has one child, so both decoding modes share this code. Framework-free (neither torch nor
transformers): the torch loops (`proposal_dflash.py`) and the MLX port build, cut and walk trees by the same rules.
"""

import functools
import heapq
import inspect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ATTENTION_FOR_TREES = ("eager", "sdpa")  # the implementations that take an arbitrary 4D mask


@dataclass
class DraftTree:
    """Drafted tokens below the root (the last committed token), parents before children.

    Node 0 is the root; node `i >= 1` holds `tokens[i - 1]` at depth `depths[i - 1]` below node `parents[i - 1]`.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    log_probs: list[float] = field(default_factory=list)  # each drafted node's path log-probability, where known

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(len(tokens))), list(range(1, len(tokens) + 1)))

    def prefix(self, nodes: int) -> "DraftTree":
        """The first `nodes` drafted nodes: a tree, since parents come before their children."""
        return DraftTree(self.tokens[:nodes], self.parents[:nodes], self.depths[:nodes], self.log_probs[:nodes])

    def path_probs(self) -> list[float]:
        return [math.exp(score) for score in self.log_probs]

    def subtree(self, nodes: list[int]) -> "DraftTree":
        """The tree of drafted `nodes` (ascending, each with its parent among them), renumbered in that order."""
        number = {0: 0} | {node: i for i, node in enumerate(nodes, 1)}
        return DraftTree(
            [self.tokens[n - 1] for n in nodes],
            [number[self.parents[n - 1]] for n in nodes],
            [self.depths[n - 1] for n in nodes],
        )

    def branch_nodes(self, branch: list[int]) -> list[int]:
        """The nodes that hold `branch` (tokens below the root), as far as the tree holds it."""
        children = {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens), 1)}
        nodes = [0]
        for token in branch:
            if (child := children.get((nodes[-1], token))) is None:
                break
            nodes.append(child)
        return nodes[1:]

    def node_token(self, node: int) -> int:
        """The token node `node >= 1` holds (node 0, the root, is the last committed token, held elsewhere)."""
        return self.tokens[node - 1]

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from below the root down to `node`, in order (none for the root)."""
        tokens = []
        while node:
            tokens.append(self.tokens[node - 1])
            node = self.parents[node - 1]
        return tokens[::-1]

    def with_branch(self, branch: list[int]) -> "DraftTree":
        """This tree plus `branch` (tokens below the root) as one more path; a prefix it shares with the tree reuses
        the tree's nodes, and new nodes come after the old ones, parents first."""
        tree = DraftTree(list(self.tokens), list(self.parents), list(self.depths), list(self.log_probs))
        children = {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens), 1)}
        node = 0
        for depth, token in enumerate(branch, 1):
            if (node, token) not in children:
                tree.tokens.append(token), tree.parents.append(node), tree.depths.append(depth)
                children[(node, token)] = len(tree.tokens)
            node = children[(node, token)]
        return tree

    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.tokens)))

    def accept(self, chosen: list[int]) -> list[int]:
        """The accepted path (node indices, from the root): at each node, the child holding the target's choice
        there (`chosen[node]`), until there is none. The target's choice at the last node is the bonus token."""
        children = {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens), 1)}
        path = [0]
        while (child := children.get((path[-1], chosen[path[-1]]))) is not None:
            path.append(child)
        return path

    def ancestor_rows(self) -> list[list[bool]]:
        """`[n + 1][n + 1]`: node `i` may attend to node `j` iff `j` is `i` or one of its ancestors."""
        rows = [[i == j for j in range(len(self.tokens) + 1)] for i in range(len(self.tokens) + 1)]
        for node, parent in enumerate(self.parents, 1):
            rows[node] = [mine or theirs for mine, theirs in zip(rows[node], rows[parent])]
        return rows

    def positions(self, start: int) -> list[int]:
        """The root at `start`, every node at `start + depth`."""
        return [start] + [start + d for d in self.depths]


def best_first(
    values: list[list[float]], indices: list[list[int]], budget: int, min_log_prob: float = float("-inf")
) -> DraftTree:
    """The `budget` highest-scoring paths' nodes, best first, from each depth's top choices (`values`, their
    log-probabilities in descending order, and `indices`, their tokens). A node's score is the sum of its path's
    log-probabilities, so a child never outscores its parent nor a sibling its better-ranked sibling: popping a heap
    that holds, for each node taken, its next sibling and its first child yields the nodes in exact score order
    (parents first). Nodes scoring below `min_log_prob` are left out (the tree may then be empty). Framework-free:
    the torch and MLX loops build the same tree."""
    width = len(values[0])
    tree = DraftTree([], [], [])
    heap = [(-values[0][0], 1, 0, 0, 0.0)]  # (-score, depth, rank among siblings, parent node, parent score)
    while heap and len(tree.tokens) < budget:
        negative, depth, rank, parent, parent_score = heapq.heappop(heap)
        if -negative < min_log_prob:  # nodes come best first: every later one scores lower still
            break
        tree.tokens.append(indices[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.log_probs.append(-negative)
        node, score = len(tree.tokens), -negative
        candidates = [(depth, rank + 1, parent, parent_score)] if rank + 1 < width else []
        candidates += [(depth + 1, 0, node, score)] if depth < len(values) else []
        for d, r, p, base in candidates:
            if values[d - 1][r] != float("-inf"):  # a token outside the draft's vocabulary is never proposed
                heapq.heappush(heap, (-(base + values[d - 1][r]), d, r, p, base))
    return tree


@dataclass
class VerifyCosts:
    """The target's verify time by the tokens it verifies, t(n), from a few timed passes: linear between the
    measured sizes and beyond the largest. Framework-free, so torch and MLX size their verifies by the same rule."""

    tokens: list[int]
    seconds: list[float]

    @classmethod
    def given(cls, costs) -> "VerifyCosts":
        """A caller's t(n): a `VerifyCosts`, or a mapping of verified tokens to seconds."""
        return costs if isinstance(costs, VerifyCosts) else cls(sorted(costs), [costs[n] for n in sorted(costs)])

    @staticmethod
    def sizes_to_time(most_tokens: int) -> list[int]:
        """The verify lengths a measurement times: 1, 2, 4, ... and `most_tokens`."""
        return sorted({1 << i for i in range(max(most_tokens, 1).bit_length())} | {max(most_tokens, 1)})

    @classmethod
    def timed(cls, sizes: list[int], time_pass: Callable[[int], float], repeats: int = 2) -> "VerifyCosts":
        """t(n) at `sizes` from `repeats` rounds of `time_pass(n)` over every size in turn, so a slow spell of the
        machine falls on all sizes rather than one. A pass's noise only adds time and a wider verify never costs
        less, so each size keeps the fastest time of itself and every wider size (a lower envelope)."""
        fastest = [math.inf] * len(sizes)
        for _ in range(repeats):
            fastest = [min(best, time_pass(n)) for best, n in zip(fastest, sizes)]
        return cls(list(sizes), list(itertools.accumulate(reversed(fastest), min))[::-1])

    def __call__(self, n: int) -> float:
        points = list(zip(self.tokens, self.seconds))
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1 or (n1, t1) == points[-1]:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return self.seconds[0]

    def table(self) -> str:
        return "\n".join(f"{n:>5} tokens  {t * 1000:8.2f} ms" for n, t in zip(self.tokens, self.seconds))


class Calibration:
    """The ratio of what a call measured to what it predicted so far (drafted tokens accepted to their expected
    count, or a verify's seconds to its t(n)), with a prior of `prior` predicted at `prior_rate` (the factor before
    the first update)."""

    def __init__(self, prior: float = 2.0, prior_rate: float = 1.0):
        self.measured, self.predicted, self.updates = prior * prior_rate, prior, 0

    @property
    def factor(self) -> float:
        return self.measured / self.predicted

    def update(self, predicted: float, measured: float) -> None:
        self.predicted += predicted
        self.measured += measured
        self.updates += 1


def sized_width(row_values: list[list[float]], cost: Callable[[int], float], draft_seconds: float) -> int:
    """How many of each row's best nodes to verify (`row_values`: each row's expected accepted tokens per node, in
    descending order): the `w` that maximises expected committed tokens per second, `(rows + sum of the rows' first
    w values) / (draft_seconds + t(rows * (w + 1)))`, every row padded to `w` in the packed verify. `w = 0` is a
    plain decode step."""
    widest = max(map(len, row_values), default=0)
    rates = [committed_rate(row_values, width, cost, draft_seconds) for width in range(widest + 1)]
    return rates.index(max(rates))  # the first best: ties go to the smaller verify


def committed_rate(
    row_values: list[list[float]], width: int, cost: Callable[[int], float], draft_seconds: float
) -> float:
    """Expected committed tokens per second when each row verifies its first `width` nodes (`sized_width`)."""
    expected = len(row_values) + sum(sum(values[:width]) for values in row_values)
    return expected / (draft_seconds + cost(len(row_values) * (width + 1)))


def node_values(tree: "DraftTree", drafted: int, branch: list[int], draft_factor: float, lookup_rates: dict):
    """Each node's expected acceptance: the first `drafted` nodes' calibrated path probability under the draft
    (capped at 1), and each lookup branch node's parent's value times its kind's rate (`lookup_kinds`), whichever is
    larger (a shared node is proposed by both)."""
    values = [min(1.0, draft_factor * math.exp(score)) for score in tree.log_probs[:drafted]]
    values += [0.0] * (len(tree.tokens) - drafted)
    parent = 1.0  # the root's
    for node, kind in lookup_kinds(tree, branch):
        values[node - 1] = parent = max(values[node - 1], parent * lookup_rates[kind])
    return values


def lookup_kinds(tree: "DraftTree", branch: list[int]) -> list[tuple[int, str]]:
    """The nodes that hold `branch`, by depth, each with its kind: "first" for the branch's first token, "follows"
    below it, since a copy that has begun to match tends to go on matching."""
    return [(node, "follows" if depth else "first") for depth, node in enumerate(tree.branch_nodes(branch))]


def best_nodes(values: list[float], width: int) -> list[int]:
    """The `width` most valuable nodes, ascending; a child is never worth more than its parent, and ties go to the
    earlier node, so every chosen node's parent is chosen too."""
    ranked = sorted(range(1, len(values) + 1), key=lambda node: (-values[node - 1], node))
    return sorted(ranked[:width])


class TreeSizer:
    """Cuts each round's trees (a best-first draft tree plus its lookup branch) to the width that pays for its
    verify (`tree_dflash.sized_width`), valuing each node by its calibrated chance of acceptance: the draft's path
    probability times the ratio of accepted to expected draft nodes so far (nodes the lookup branch shares left out,
    since two proposers agreeing are right more often than either), and for a lookup node its parent's value times
    the rate at which the call's lookup-only tokens of its kind were accepted given their parent (`lookup_kinds`:
    the branch's first token, or one below it), each with a prior.

    t(n) comes from a table timed after a short context; a call's verifies read a longer one and carry its loop's
    own work, which slows wider verifies more. So each verify is costed at t(n) times the ratio of the seconds the
    call's verifies of its kind took to their t(n) so far (`verified`), plain steps apart from wider verifies.

    A round whose best verify, draft time included, commits tokens slower than a plain decode step would have makes
    the next 1, then 2, 4, ... (at most `MAX_SKIP`) rounds plain steps without a draft pass (`drafts`), until a
    drafted round pays again: a draft that cannot pay on this machine costs a draft pass now and then."""

    MAX_SKIP = 32

    def __init__(self, costs):
        self.costs, self.started = costs, None
        self.draft = Calibration()
        self.lookup = {"first": Calibration(1.0, 0.25), "follows": Calibration(1.0, 0.75)}
        self.step_time, self.wide_time = Calibration(prior=costs(1)), Calibration(prior=costs(1))
        self.skip, self.backoff = 0, 1

    def drafts(self) -> bool:
        """Whether this round drafts; if not, it verifies each row's next token alone and calls neither `cut` nor
        `accepted`."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def start_draft(self) -> None:
        """Marks a round's start: its draft time runs from here through building its trees to `cut`."""
        self.started = time.perf_counter()

    def verify_seconds(self, tokens: int, rows: int) -> float:
        """What a verify of `tokens` in all over `rows` rows costs this call: t(tokens), calibrated by its kind's
        verifies, or by the other kind's while none of its own has run (so neither kind is favoured unmeasured)."""
        own, other = self.timings(tokens, rows)
        return (own if own.updates or not other.updates else other).factor * self.costs(tokens)

    def verified(self, tokens: int, rows: int, seconds: float) -> None:
        """Feeds back a verify's measured seconds (every round's, plain steps too)."""
        self.timings(tokens, rows)[0].update(self.costs(tokens), seconds)

    def timings(self, tokens: int, rows: int) -> tuple[Calibration, Calibration]:
        """The calibration of this verify's kind (a plain step, or wider), then the other kind's."""
        return (self.step_time, self.wide_time) if tokens == rows else (self.wide_time, self.step_time)

    def cut(self, trees: list[DraftTree], branches: list[list[int]]) -> tuple[list[DraftTree], list[float]]:
        """The trees with their branches, cut to one width; and each row's expected acceptance length (the bonus
        token included)."""
        draft_seconds = time.perf_counter() - self.started
        merged = [tree.with_branch(branch) for tree, branch in zip(trees, branches)]
        values = [
            node_values(tree, len(drafted.tokens), branch, self.draft.factor, self.lookup_rates())
            for tree, drafted, branch in zip(merged, trees, branches)
        ]
        ranked = [sorted(v, reverse=True) for v in values]
        cost = functools.partial(self.verify_seconds, rows=len(values))
        width = sized_width(ranked, cost, draft_seconds)
        self.pace(committed_rate(ranked, width, cost, draft_seconds) > len(values) / cost(len(values)))
        kept = [best_nodes(v, width) for v in values]
        self.rounds = []  # per row: its kept draft-only nodes' expected acceptance, them, its kept branch, its nodes
        for tree, drafted, branch, nodes in zip(merged, trees, branches, kept):
            on_branch = [(n, kind) for n, kind in lookup_kinds(tree, branch) if n in nodes]
            draft_only = {n for n in nodes if n <= len(drafted.tokens)} - {n for n, _ in on_branch}
            predicted = sum(math.exp(drafted.log_probs[n - 1]) for n in draft_only)
            self.rounds.append(
                (predicted, draft_only, [(n, kind, n > len(drafted.tokens)) for n, kind in on_branch], nodes)
            )
        cut = [tree.subtree(nodes) for tree, nodes in zip(merged, kept)]
        return cut, [1 + sum(v[n - 1] for n in nodes) for v, nodes in zip(values, kept)]

    def pace(self, paid: bool) -> None:
        """After a drafted round: back to drafting every round if it paid, else skip the next rounds, twice as many
        as the last time."""
        if paid:
            self.backoff = 1
        else:
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_SKIP)

    def lookup_rates(self) -> dict[str, float]:
        return {kind: calibration.factor for kind, calibration in self.lookup.items()}

    def accepted(self, paths: list[list[int]]) -> None:
        """Feeds back each row's accepted path (node numbers of the cut tree): the draft's factor from its own nodes,
        and each lookup-only node whose parent was accepted is a trial of its kind's rate."""
        for path, (predicted, draft_only, on_branch, nodes) in zip(paths, self.rounds):
            accepted = {nodes[node - 1] for node in path[1:]}  # back to the uncut tree's numbers
            self.draft.update(predicted, len(accepted & draft_only))
            for node, kind, lookup_only in on_branch:  # the accepted ones are a prefix of the branch
                if lookup_only:
                    self.lookup[kind].update(1, node in accepted)
                if node not in accepted:
                    break


def round_trees(
    proposals: list[DraftTree] | None, histories: list[list[int]], lookup: int, max_ngram: int, sizer=None
) -> tuple[list[DraftTree], list[float]]:
    """Each row's round, by the one rule every loop follows (torch's one row and batch, MLX): nothing drafted
    (`proposals` None: a plain decode step), else the row's drafted chain or tree plus its lookup branch of up to
    `lookup` tokens (`histories`: each row's prompt and output, which the lookup searches), cut with a `sizer` to
    the width that pays; and with a `sizer`, each row's expected acceptance length."""
    if proposals is None:
        return [DraftTree.chain([])] * len(histories), [1.0] * len(histories)
    branches = [prompt_lookup(history, lookup, max_ngram) if lookup else [] for history in histories]
    if sizer:
        return sizer.cut(proposals, branches)
    return [tree.with_branch(branch) if branch else tree for tree, branch in zip(proposals, branches)], []


@dataclass
class Round:
    """One round of `decode_rounds`, for its live rows in order: each row's verified tree, the target's choice at
    each of its nodes, its accepted path and (with cost sizing) its expected acceptance length."""

    trees: list[DraftTree]
    chosen: list[list[int]]
    paths: list[list[int]]
    estimates: list[float]
    drafted: bool  # False: a plain decode step, without a draft pass

    def committed(self) -> list[list[int]]:
        """Each row's new tokens: its accepted path's, then the target's choice after it."""
        return [
            [tree.node_token(node) for node in path[1:]] + [chosen[path[-1]]]
            for tree, chosen, path in zip(self.trees, self.chosen, self.paths)
        ]


def decode_rounds(rows, lookup: int = 0, max_ngram: int = 2, sizer=None, align_rows: bool = False):
    """The round every loop runs (torch's one row and its ragged batch, MLX), yielding each `Round` once committed.
    `rows` holds the live rows' caches and state: `live()` counts them (0 ends the loop), `draft()` gives each
    one's drafted chain or tree in one draft pass (None: a bare chain left on the device), `histories()` what its
    lookup searches, `verify(trees)` the trees verified in one target pass (a chain left on the device comes to the
    host there, with the target's choices) and the target's choice at each of their nodes, and `commit(round)` moves
    each row past its accepted path. `align_rows` keeps every row to the round's shortest path."""
    while live := rows.live():
        drafting = sizer is None or sizer.drafts()  # a cost-sized call skips drafts that do not pay
        if drafting and sizer:
            sizer.start_draft()
        proposals = rows.draft() if drafting else None  # None: a plain decode step for every row
        histories = rows.histories() if drafting and lookup else [[]] * live  # only a drafted round's lookup reads
        trees, estimates = round_trees(proposals, histories, lookup, max_ngram, sizer)
        started = time.perf_counter()
        trees, chosen = rows.verify(trees)
        if sizer:  # a packed verify costs the widest row's tree in every row
            sizer.verified(live * (1 + max(len(tree.tokens) for tree in trees)), live, time.perf_counter() - started)
        paths = [tree.accept(row_chosen) for tree, row_chosen in zip(trees, chosen)]
        if align_rows:  # the target's choice after the shortest path is every row's own next token
            paths = [path[: min(map(len, paths))] for path in paths]
        if sizer and drafting:
            sizer.accepted(paths)
        step = Round(trees, chosen, paths, estimates, drafting)
        rows.commit(step)
        yield step


def resolve_tree_sizing(asked: str | None, configured: str | None, has_tree: bool, one_shape: bool = False) -> str:
    """A call's tree sizing, `"cost"` or `"fixed"`: `asked`, else the draft config's, else fixed. The config's cost
    sizing steps aside for the chain and a verify compiled to one shape (`one_shape`); an explicit one is refused."""
    sizing = asked or configured or "fixed"
    if sizing not in ("cost", "fixed"):
        raise ValueError(f"tree_sizing must be 'cost' or 'fixed', got {sizing!r}")
    if sizing == "cost" and (not has_tree or one_shape):
        if asked is not None:
            raise ValueError(
                "tree_sizing='cost' cuts a draft tree to what its verify costs; "
                + ("compile_verify=True verifies one shape every round" if one_shape else "set tree_budget")
            )
        return "fixed"
    return sizing


def config_tree(nodes: int | None, *, adaptive: bool, selector: bool, recurrent: bool) -> int | None:
    """A draft config's tree setting as a default (None: the chain): it yields to an adaptive block, a DFlash 2
    selector (whose walk is its own chain) and a recurrent target (whose state follows one path)."""
    return None if adaptive or selector or recurrent or not nodes else nodes


def prompt_lookup(tokens: list[int], num_tokens: int, max_ngram: int = 2) -> list[int]:
    """transformers' prompt-lookup rule (`PromptLookupCandidateGenerator`): the up to `num_tokens` tokens that
    followed the earliest earlier occurrence of the last `n` tokens, trying `n = max_ngram` down to 1; none if nothing
    matches."""
    length = len(tokens)
    for size in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - size :]
        for start in range(length - size):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + num_tokens]
    return []


def check_tree_supported(
    target, tree_budget: int, final_length: int, what: str = "tree", instead: str = "use the chain (tree_budget=0)"
) -> None:
    """Refuses, before any compute, targets whose verify pass cannot take a tree mask (or a batch's, `what`) or whose
    cache cannot be compacted to the accepted path; `instead` says what to do."""
    if tree_budget < 1:
        raise ValueError(f"tree_budget must be at least 1 drafted node (or 0 for the chain), got {tree_budget}")
    config = target.config.get_text_config()
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ATTENTION_FOR_TREES:
        raise ValueError(
            f"{what} verification needs an attention implementation that takes a custom 4D mask "
            f"({', '.join(ATTENTION_FOR_TREES)}); "
            f"the target uses {attention!r}. Load it with attn_implementation='sdpa' or {instead}."
        )
    if getattr(config, "attn_temperature_tuning", False):  # Llama 4 scales its NoPE layers' queries by cache slot
        raise ValueError(
            f"{what} verification places tokens in cache slots other than their positions, and this target scales "
            f"attention by the slot (attn_temperature_tuning); {instead}."
        )
    window, mixed = attention_window(config)
    if window is not None and final_length > window and mask_layout(target)[0] is None:
        raise ValueError(
            f"{what} verification past the target's sliding window ({window} tokens) needs a mask per layer type, "
            f"and {type(target).__name__}'s forward takes one mask for its sliding and full layers alike; this call "
            f"may reach {final_length} tokens. Generate fewer tokens or {instead}."
        )


def attention_window(config) -> tuple[int | None, bool]:
    """The target's sliding window (None: none) and whether only some of its layers slide (the rest full)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None) or []
    if window is None or (types and "sliding_attention" not in types):
        return None, False
    if not types and not getattr(config, "use_sliding_window", True):
        return None, False
    return window, any(kind != "sliding_attention" for kind in types)


def mask_layout(target) -> tuple[int | None, bool]:
    """How a verify's mask must window the target's attention: `(window, by_layer_type)`. A target whose layers all
    slide gets one windowed mask, one that mixes sliding and full layers a mapping of both by layer type where its
    forward takes one, else its full mask (exact while the sequence fits the window, which `check_tree_supported`
    enforces); `(None, False)`: no window."""
    window, mixed = attention_window(target.config.get_text_config())
    if mixed and not takes_masks_by_layer_type(type(getattr(target, "model", target))):
        return None, False
    return window, mixed


@functools.cache
def takes_masks_by_layer_type(decoder: type) -> bool:
    """Whether a decoder class takes a mapping of masks by layer type, as transformers' models that mix sliding and
    full layers do (`causal_mask_mapping`), read from its forward's source."""
    try:
        return "causal_mask_mapping" in inspect.getsource(decoder.forward)
    except (OSError, TypeError):
        return False
