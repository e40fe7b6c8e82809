"""`target.generate(ids, assistant_model=draft)`: our candidate generator, and transformers' own
`speculation_type="dflash"`."""

import ast
import inspect
import textwrap
import warnings

import pytest
import torch
import transformers
from conftest import (
    MISMATCHES,
    VOCAB,
    OracleDraft,
    chi_square_p_value,
    exact_joint_distribution,
    greedy_reference,
    make_draft,
    make_draft_config,
    make_target,
    make_tokenizer,
)
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

HAS_BUILTIN = hasattr(GenerationConfig(), "speculation_type")
ROUTES = ["ours", "builtin"]


def run_generate(target, draft, ids, route="ours", **kwargs):
    """`target.generate` with a DFlash assistant; on transformers without the built-in route, check its error."""
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0} | kwargs
    if route == "builtin":
        kwargs["speculation_type"] = "dflash"
        if not HAS_BUILTIN:
            with pytest.raises(
                ValueError, match=f"speculation_type needs transformers 5.15 or newer; {transformers.__version__}"
            ):
                target.generate(ids, assistant_model=draft, **kwargs)
            return None
    return target.generate(ids, assistant_model=draft, **kwargs)


def count_target_passes(target):
    calls = []
    handle = target.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls, handle


def assert_target_untouched(target):
    """No instance patches and no DFlash hooks (transformers installs its own output-capturing hooks for good)."""
    assert "_get_candidate_generator" not in vars(target) and "_get_stopping_criteria" not in vars(target)
    hooks = [h for m in target.modules() for h in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]]
    assert not [h for h in hooks if "DFlash" in h.__qualname__], "DFlash hooks left on the target"


def skipped_for(generator, test: ast.AST) -> bool:
    """Whether an `if` test rules out `generator`: a type check (`isinstance` / `hasattr` on it, true for other
    generators only) or one of its own flags that is off (`if candidate_generator.requires_model_outputs:`)."""
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "candidate_generator":
        return not getattr(generator, test.attr)
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("isinstance", "hasattr")
        and n.args
        and isinstance(n.args[0], ast.Name)
        and n.args[0].id == "candidate_generator"
        for n in ast.walk(test)
    )


def generator_reads(fn, generator) -> set[str]:
    """The `candidate_generator.<name>` attributes `fn` reads when it runs with `generator`."""
    names = set()

    def visit(node):
        nodes = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and skipped_for(generator, node.test):
            nodes = [node.test, *node.orelse] if isinstance(node.test, ast.Attribute) else node.orelse
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "candidate_generator"
        ):
            names.add(node.attr)
        for child in nodes:
            visit(child)

    visit(ast.parse(textwrap.dedent(inspect.getsource(fn))))
    return names


def test_the_generator_has_every_attribute_the_installed_assisted_loop_reads():
    """transformers 5.25 began reading `num_drafting_tokens`: a new read fails here before it fails a user."""
    from candidates_dflash import DFlashCandidateGenerator

    target, draft = make_target("llama"), make_draft()
    config = GenerationConfig(max_length=32, do_sample=False)
    generator = DFlashCandidateGenerator(target, draft, config)
    try:
        reads = generator_reads(GenerationMixin._assisted_decoding, generator)
        assert {"get_candidates", "update_candidate_strategy"} <= reads, reads  # the parse found the loop's reads
        assert [name for name in sorted(reads) if not hasattr(generator, name)] == []
    finally:
        generator.close()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_equals_plain_greedy(route, arch, block_size):
    target = make_target(arch)
    ids = torch.randint(3, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(block_size))
    expected = greedy_reference(target, ids, 2 * block_size + 3)
    oracle = OracleDraft(make_draft_config(block_size=block_size)).eval().setup(target, expected, block_size // 2)
    for draft in (make_draft(block_size=block_size), oracle):
        out = run_generate(target, draft, ids, route, max_new_tokens=2 * block_size + 3)
        assert out is None or torch.equal(out, expected), f"{type(draft).__name__}"
    assert_target_untouched(target)


@pytest.mark.parametrize("route", ROUTES)
def test_forced_partial_acceptance_at_every_k(route):
    target, block_size = make_target("qwen2"), 8
    ids = torch.tensor([[4, 9, 11, 30]])
    expected = greedy_reference(target, ids, 48)
    for k in range(block_size):
        draft = OracleDraft(make_draft_config(block_size=block_size)).eval().setup(target, expected, k)
        calls, handle = count_target_passes(target)
        out = run_generate(target, draft, ids, route, max_new_tokens=40)
        handle.remove()
        if out is None:
            return
        assert torch.equal(out, expected[:, :44]), f"k={k}"
        # each pass after the prefill commits k + 1 tokens
        assert len(calls) == 1 + -(-39 // (k + 1)), f"k={k}: {len(calls)} target passes"
        assert all(n == k + 1 for n, _ in draft.calls[1:]), draft.calls


def test_heuristic_schedule_adapts_block_and_stays_exact():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 48)
    draft = OracleDraft(make_draft_config()).eval().setup(target, expected, 0)
    out = run_generate(target, draft, ids, max_new_tokens=40, num_assistant_tokens_schedule="heuristic")
    assert torch.equal(out, expected[:, :43])
    assert draft.blocks[:8] == [8, 7, 6, 5, 4, 3, 2, 2]


@pytest.mark.parametrize("route", ROUTES)
def test_drafting_needs_fewer_target_passes_than_tokens(route):
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 40)
    draft = OracleDraft(make_draft_config()).eval().setup(target, expected, 7)
    calls, handle = count_target_passes(target)
    out = run_generate(target, draft, ids, route, max_new_tokens=32)
    handle.remove()
    if out is not None:
        assert torch.equal(out, expected[:, :35]) and len(calls) == 5  # prefill + 4 blocks of 8


def test_return_dict_and_scores_keep_their_shapes():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    args = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **args)
    oracle = OracleDraft(make_draft_config()).eval().setup(target, plain.sequences, 5)
    ours = run_generate(target, oracle, ids, **args)
    assert torch.equal(ours.sequences, plain.sequences)
    assert len(ours.scores) == len(plain.scores) == 12 and len(ours.logits) == 12
    for a, b in zip(ours.scores, plain.scores):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_gets_every_token_once_in_order():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 30)
    streamer = Recorder()
    draft = OracleDraft(make_draft_config()).eval().setup(target, expected, 4)
    out = run_generate(target, draft, ids, max_new_tokens=30, streamer=streamer)
    assert torch.equal(out, expected)
    assert streamer.chunks[0] == [5, 6, 7] and streamer.chunks[-1] == "end"
    assert [t for chunk in streamer.chunks[1:-1] for t in chunk] == expected[0, 3:].tolist()


def test_eos_inside_accepted_block_stops_like_plain_decoding():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    free = greedy_reference(target, ids, 40)
    eos = int(free[0, 3 + 10])
    target.generation_config.eos_token_id = eos
    expected = greedy_reference(target, ids, 40)
    assert expected.shape[1] < free.shape[1] and expected[0, -1] == eos
    streamer = Recorder()
    draft = OracleDraft(make_draft_config()).eval().setup(target, free, 7)
    out = run_generate(target, draft, ids, max_new_tokens=40, streamer=streamer)
    assert torch.equal(out, expected)
    assert [t for chunk in streamer.chunks[1:-1] for t in chunk] == expected[0, 3:].tolist()


class StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("kind", ["criteria", "stop_strings"])
def test_custom_stopping_cuts_where_plain_decoding_does(kind):
    target, tokenizer = make_target("llama"), make_tokenizer()
    ids = torch.tensor([[5, 6, 7]])
    free = greedy_reference(target, ids, 40)
    stop = int(free[0, 3 + 9])
    extra = (
        {"stopping_criteria": [StopAfter(stop)]}
        if kind == "criteria"
        else {"stop_strings": [f"t{stop}"], "tokenizer": tokenizer}
    )
    plain = target.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=40, **extra
    )
    assert plain.shape[1] < free.shape[1]
    streamer = Recorder()
    draft = OracleDraft(make_draft_config()).eval().setup(target, free, 7)
    out = run_generate(target, draft, ids, max_new_tokens=40, streamer=streamer, **extra)
    assert torch.equal(out, plain)
    assert [t for chunk in streamer.chunks[1:-1] for t in chunk] == plain[0, 3:].tolist()


def test_stops_whose_trigger_lies_in_the_prompt_never_fire():
    """Chat prompts hold the EOS token (and may hold a stop string or a criterion's trigger) before their end: only
    the tokens a step added are checked, so none of them cuts the output (issue 9: it ended after one token)."""
    target, tokenizer = make_target("llama"), make_tokenizer()
    ids = torch.tensor([[5, 2, 40, 41, 42, 6, 7]])
    free = greedy_reference(target, ids, 30)
    unused = [t for t in ids[0, :-1].tolist() if t not in free[0, 7:].tolist()]
    eos, word, trigger = unused[:3]
    target.generation_config.eos_token_id = eos
    extra = dict(
        max_new_tokens=30, stopping_criteria=[StopAfter(trigger)], stop_strings=[f"t{word}"], tokenizer=tokenizer
    )
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **extra)
    assert torch.equal(plain, free)
    draft = OracleDraft(make_draft_config()).eval().setup(target, free, 3)
    out = run_generate(target, draft, ids, **extra)
    assert torch.equal(out, free) and len(draft.calls) >= 5, (
        f"{out.shape[1] - 7} new tokens, {len(draft.calls)} draft calls"
    )


def test_criteria_see_each_new_prefix_once():
    """Per-token stopping checks exactly the prefixes each step added: once each, never inside the prompt."""
    target, seen = make_target("llama"), []

    class Record(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(input_ids.shape[1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor([[5, 6, 7]])
    draft = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 30), 4)
    out = run_generate(target, draft, ids, max_new_tokens=20, stopping_criteria=[Record()])
    assert out.shape[1] == 23 and seen == list(range(4, 24))


def test_time_limit_cuts_at_the_first_new_token_past_it():
    """`max_time` is checked at each new prefix too: once it has passed, the output ends at the step's first token."""
    from transformers import MaxTimeCriteria, StoppingCriteriaList

    from routing_dflash import TokenStopping

    expired = MaxTimeCriteria(max_time=0.0, initial_timestamp=0.0)
    stopping = TokenStopping(StoppingCriteriaList([expired]), prompt_len=3)
    assert bool(stopping(torch.tensor([[5, 6, 7, 8, 9, 10]]))[0]) and stopping.stop_length == 4


class Boom(LogitsProcessor):
    def __init__(self, error, after):
        self.error, self.calls, self.after = error, 0, after

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls > self.after:
            raise self.error
        return scores


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_no_hooks_or_patches_left_after_an_exception(error):
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    oracle = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 30), 3)
    with pytest.raises(type(error)):
        run_generate(target, oracle, ids, max_new_tokens=20, logits_processor=LogitsProcessorList([Boom(error, 5)]))
    assert_target_untouched(target)
    assert torch.equal(run_generate(target, oracle, ids, max_new_tokens=20), greedy_reference(target, ids, 20))


def test_other_assistants_behave_as_stock():
    target, assistant = make_target("llama"), make_target("llama", seed=3)
    target.generation_config.eos_token_id = 2  # transformers 4.57's assisted path needs an EOS
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=16)
    expected = target.generate(ids, **common)
    assert torch.equal(target.generate(ids, assistant_model=assistant, **common), expected)
    assert torch.equal(target.generate(ids, prompt_lookup_num_tokens=3, **common), expected)
    assert_target_untouched(target)


def processors(temperature, top_k, top_p, repetition_penalty):
    """The processors generate builds for these settings, in its order."""
    return LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(repetition_penalty),
            TemperatureLogitsWarper(temperature),
            TopKLogitsWarper(top_k),
            TopPLogitsWarper(top_p),
        ]
    )


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_sampling_matches_target_distribution(proposal):
    """Chi-square test (fails at p < 1e-4) of the second and third sampled tokens, which come from drafted blocks,
    against the exact processed target distribution, with temperature, top-k, top-p and repetition penalty."""
    target = make_target("llama", initializer_range=0.5)
    ids, n = torch.tensor([[5, 6, 7]]), 1500
    settings = dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.3)
    exact = exact_joint_distribution(target, ids, processors(**settings), 3).sum(0).flatten()
    draft = OracleDraft(make_draft_config(block_size=4)).eval().setup(target, greedy_reference(target, ids, 8), 3)
    draft.dflash_proposal = proposal
    torch.manual_seed(0)
    counts, accepted = torch.zeros(VOCAB * VOCAB), 0
    for _ in range(n):
        calls, handle = count_target_passes(target)
        out = run_generate(target, draft, ids, max_new_tokens=6, do_sample=True, **settings)
        handle.remove()
        counts[out[0, 4] * VOCAB + out[0, 5]] += 1
        accepted += len(calls) < 6  # some drafted token was kept
    p_value, chi2, dof = chi_square_p_value(counts, exact)
    assert p_value > 1e-4, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"
    assert len(draft.calls) >= 2 * n and accepted > n // 10, (
        f"{len(draft.calls)} draft calls, {accepted} runs kept a drafted token"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences > 1 is not supported"),
        ({"num_beams": 2}, r"beam search \(num_beams > 1\) is not supported"),
        ({"cache_implementation": "offloaded"}, "cannot be cropped"),
        ({"num_assistant_tokens_schedule": "heuristic_transient"}, "schedule 'heuristic_transient' is not supported"),
        ({"tree_budget": 8}, "cannot verify a tree; use draft.spec_generate"),
        ({"generation_config": GenerationConfig(tree_budget=8, max_new_tokens=4)}, "cannot verify a tree"),
        ({"prompt_lookup_num_tokens": 4}, "prompt_lookup_num_tokens is not supported .* use draft.spec_generate"),
    ],
)
def test_unsupported_options_are_refused(kwargs, message):
    target = make_target("llama")
    calls, handle = count_target_passes(target)
    with pytest.raises(ValueError, match=message):
        run_generate(target, make_draft(), torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kwargs)
    assert not calls
    assert_target_untouched(target)


@pytest.mark.parametrize("k", [1, 3])
def test_static_cache_implementation_is_exact(k):
    """transformers 5 runs the assisted loop on a `StaticCache` and crops it (4.57 uses a dynamic one instead)."""
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 20)
    oracle = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 40), k)
    caches = []
    target.register_forward_pre_hook(
        lambda m, a, kw: caches.append(type(kw.get("cache", kw.get("past_key_values"))).__name__), with_kwargs=True
    )
    assert torch.equal(run_generate(target, oracle, ids, max_new_tokens=20, cache_implementation="static"), expected)
    assert len(oracle.calls) > 2
    assert set(caches) == ({"StaticCache"} if int(transformers.__version__.split(".")[0]) >= 5 else {"DynamicCache"})


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="4.57's assisted loop uses a dynamic cache, which it does not compile",
)
def test_static_cache_with_compile_config_compiles_the_verify_and_stays_exact():
    """transformers 5 compiles the assisted loop's target call when the cache is static (by default on GPUs; here
    `compile_config` asks for it on the CPU): exact at two acceptance lengths, and a random draft gets the same
    target features as with the eager static loop."""
    from transformers import CompileConfig

    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 20)
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    run = lambda draft, **kw: run_generate(target, draft, ids, max_new_tokens=20, cache_implementation="static", **kw)  # noqa: E731
    for k in (1, 3):
        oracle = OracleDraft(make_draft_config()).eval().setup(target, greedy_reference(target, ids, 40), k)
        assert torch.equal(run(oracle, compile_config=compile_config), expected) and len(oracle.calls) > 2
    assert (
        getattr(target, "_compiled_call", None) is not None
    )  # the verify passes ran through transformers' compiled call
    draft, seen = make_draft(), []
    draft.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["context_hidden_states"].clone()), with_kwargs=True)
    assert torch.equal(run(draft), expected)
    eager, seen[:] = list(seen), []
    assert torch.equal(run(draft, compile_config=compile_config), expected)
    assert len(seen) == len(eager) > 2 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(seen, eager))


def test_draft_config_tree_budget_verifies_the_chain_without_warning():
    """The config's tree is a spec_generate default the caller did not ask for here: said once at info level, never
    as a warning."""
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 12)
    oracle = OracleDraft(make_draft_config()).eval().setup(target, expected, 3)
    oracle.config.tree_budget = 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert torch.equal(run_generate(target, oracle, ids, max_new_tokens=12), expected)
    assert oracle.calls, "the draft ran"


BATCH = [[5], [7, 8, 9, 10, 11, 12], [20, 21, 3, 40, 41, 42, 43, 44]]


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, BATCH))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in BATCH])
    return ids, torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in BATCH])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_left_padded_batch_gives_every_row_its_own_greedy_output(arch):
    """transformers' assisted loop refuses batches; with a DFlash assistant the call runs the batched loop, and every
    row equals that prompt's plain greedy output, padded after its end with the call's pad token."""
    target, draft = make_target(arch), make_draft()
    ids, mask = left_padded_batch()
    shapes, drafts = [], []
    handles = [
        target.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True),
        draft.register_forward_hook(lambda *args: drafts.append(1)),
    ]
    out = target.generate(
        ids, attention_mask=mask, assistant_model=draft, max_new_tokens=18, do_sample=False, pad_token_id=0
    )
    for handle in handles:
        handle.remove()
    assert out.shape == (3, ids.shape[1] + 18) and torch.equal(out[:, : ids.shape[1]], ids)
    for row, prompt in enumerate(BATCH):
        expected = greedy_reference(target, torch.tensor([prompt]), 18)[0, len(prompt) :]
        assert torch.equal(out[row, ids.shape[1] :], expected), f"row {row}"
    assert drafts and shapes[1] == (3, draft.config.block_size), f"one pass verified every row's block: {shapes[:3]}"
    eos = int(
        out[1, ids.shape[1] + 2]
    )  # row 1's third new token ends it; the others run on or stop where they write it
    stopped = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        max_new_tokens=18,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=1,
    )
    new = stopped[1, ids.shape[1] :].tolist()
    assert new[: new.index(eos) + 1] == out[1, ids.shape[1] : ids.shape[1] + new.index(eos) + 1].tolist()
    assert set(new[new.index(eos) + 1 :]) <= {1}, "padded with the call's pad token after the row's end"


@pytest.mark.parametrize("length", [{}, {"max_length": 14}])
def test_a_batch_without_max_new_tokens_makes_what_plain_batched_generate_makes(length):
    """No `max_new_tokens`: 20 new tokens by default (the prompts here are 8 wide), else the call's `max_length`."""
    target, draft = make_target("llama"), make_draft()
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, **length)
    plain = target.generate(ids, **kwargs)
    drafts = []
    handle = draft.register_forward_hook(lambda *args: drafts.append(1))
    out = target.generate(ids, assistant_model=draft, **kwargs)
    handle.remove()
    assert plain.shape[1] == ids.shape[1] + (6 if length else 20)
    assert torch.equal(out, plain) and drafts, "the draft ran"


def test_a_batch_samples_each_row_from_its_own_distribution():
    """Chi-square of the two new tokens of each row, sampled through `target.generate` (fails at p < 1e-4)."""
    target, draft = make_target("llama", initializer_range=0.5), make_draft()
    prompts, n = [[5, 6, 7], [9]], 1200
    ids = torch.tensor([prompts[0], [0, 0, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    warper = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    exact = [exact_joint_distribution(target, torch.tensor([p]), warper, 2).flatten() for p in prompts]
    counts = torch.zeros(2, VOCAB * VOCAB)
    torch.manual_seed(0)
    for _ in range(n):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            max_new_tokens=2,
            do_sample=True,
            temperature=0.8,
            top_k=0,
            pad_token_id=0,
            eos_token_id=None,
        )
        for row, (t1, t2) in enumerate(out[:, -2:].tolist()):
            counts[row, t1 * VOCAB + t2] += 1
    for row in range(2):
        p_value, chi2, dof = chi_square_p_value(counts[row], exact[row])
        assert p_value > 1e-4, f"row {row}: chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"guidance_scale": 1.5}, "guidance_scale=1.5 is not supported with a batch .*unconditional model"),
        ({"output_scores": True, "return_dict_in_generate": True}, "output_scores=True is not supported with a batch"),
        (
            {"prefix_allowed_tokens_fn": lambda batch, ids: [3]},
            "prefix_allowed_tokens_fn is not supported .*batch index",
        ),
        ({"streamer": BaseStreamer()}, "a streamer takes one sequence"),
        ({"num_assistant_tokens_schedule": "heuristic"}, "not supported with a batch"),
        ({"cache_implementation": "static"}, "builds its own ragged dynamic cache"),
        ({"speculation_type": "dflash"}, "one sequence at a time|speculation_type needs"),
    ],
)
def test_what_a_batch_cannot_take_is_refused_before_compute(kwargs, message):
    target, draft = make_target("llama"), make_draft()
    ids, mask = left_padded_batch()
    passes, _ = count_target_passes(target)
    with pytest.raises(ValueError, match=message):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, pad_token_id=0, **kwargs)
    assert not passes, "the target ran before the error"


@pytest.mark.parametrize("change, message", MISMATCHES)
def test_mismatched_draft_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        run_generate(make_target("llama"), make_draft(**change), torch.tensor([[5, 6]]), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------------------------
# Arguments as users pass them.


def test_positional_generation_config_is_routed():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 20)
    oracle = OracleDraft(make_draft_config()).eval().setup(target, expected, 3)
    config = GenerationConfig(max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = target.generate(ids, config, assistant_model=oracle, attention_mask=torch.ones_like(ids))
    assert torch.equal(out, expected) and len(oracle.calls) >= 3


def test_num_assistant_tokens_sets_the_block_size():
    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = greedy_reference(target, ids, 20)
    oracle = OracleDraft(make_draft_config(block_size=8)).eval().setup(target, expected, 7)
    assert torch.equal(run_generate(target, oracle, ids, max_new_tokens=20, num_assistant_tokens=3), expected)
    assert set(oracle.blocks) == {4}, oracle.blocks


@pytest.mark.parametrize(
    "extra, message",
    [
        ("inputs_embeds", "DFlash needs the prompt as input_ids"),
        ("past_key_values", "a pre-filled past_key_values is not supported"),
        ("assistant_tokenizer", "assistant_tokenizer is not supported"),
    ],
)
def test_arguments_dflash_cannot_honour_are_refused(extra, message):
    from transformers import DynamicCache

    from cache_dflash import cache_kwarg

    target = make_target("llama")
    ids = torch.tensor([[5, 6, 7]])
    if extra == "inputs_embeds":
        kwargs = {"inputs_embeds": target.get_input_embeddings()(ids)}
        ids = None
    elif extra == "past_key_values":
        cache = DynamicCache()
        target(torch.tensor([[5, 6]]), use_cache=True, **{cache_kwarg(target): cache})
        kwargs = {"past_key_values": cache}
    else:
        kwargs = {"assistant_tokenizer": make_tokenizer(), "tokenizer": make_tokenizer()}
    calls, handle = count_target_passes(target)
    with pytest.raises(ValueError, match=message):
        target.generate(ids, assistant_model=make_draft(), max_new_tokens=4, do_sample=False, pad_token_id=0, **kwargs)
    handle.remove()
    assert not calls
    assert_target_untouched(target)


def test_call_runs_the_drafts_own_copy_of_the_code(monkeypatch):
    """Remote code loads one copy of our modules per revision; each draft's call goes through its own copy."""
    target, draft, seen = make_target("llama"), make_draft(), []
    own = draft._dflash_assisted_generate
    monkeypatch.setattr(draft, "_dflash_assisted_generate", lambda *args: seen.append(1) or own(*args))
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(run_generate(target, draft, ids, max_new_tokens=8), greedy_reference(target, ids, 8)) and seen


def test_concurrent_calls_in_threads_stay_exact():
    """Per-call state is thread-local: DFlash calls on two targets and a plain call run at once, all exact."""
    import threading

    ids = torch.tensor([[5, 6, 7]])
    targets = [make_target("llama", seed=s) for s in (0, 1, 2)]
    expected = [greedy_reference(t, ids, 24) for t in targets]
    drafts = [OracleDraft(make_draft_config()).eval().setup(t, e, k) for t, e, k in zip(targets[:2], expected, (2, 5))]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(3):
                if i < 2:
                    results[i] = run_generate(targets[i], drafts[i], ids, max_new_tokens=24)
                else:
                    results[i] = greedy_reference(targets[i], ids, 24)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert all(torch.equal(results[i], expected[i]) for i in range(3)) and all(len(d.calls) >= 9 for d in drafts)
