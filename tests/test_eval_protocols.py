"""stare.eval.protocols (eval/protocols.py): the named protocols and ``resolve_protocol``'s refusals (each bound
worked by hand), greedy decoding, and the sample seeds (``problem_seed``, ``turn_seed``): by hand, and no two samples
or runs sharing one."""
import pytest

from stare.eval import protocols


def test_seed_blocks_of_different_runs_do_not_overlap():
    k, n = 8, 30
    runs = {s: {protocols.problem_seed(s, i, k) + j for i in range(n) for j in range(k)} for s in (0, 1, 2, 99)}
    assert all(len(v) == n * k for v in runs.values())
    assert len(set().union(*runs.values())) == 4 * n * k
    with pytest.raises(ValueError):
        protocols.problem_seed(0, 2**32, 1)  # beyond one run's block


def test_tool_turn_seeds_are_distinct_across_a_run():
    from stare.eval.protocols import problem_seed, turn_seed

    k, n, turns = 4, 30, 6
    seeds = [turn_seed(problem_seed(3, i, k) + j, r) for i in range(n) for j in range(k) for r in range(turns)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**64 for s in seeds)
    assert all(turn_seed(s, 0) == s and turn_seed(s, 1) >= 2**63 for s in seeds[:10])


def test_the_named_protocols_are_the_papers_settings():
    got = {name: (p.k, p.temperature, p.top_p, p.max_tokens) for name, p in protocols.PROTOCOLS.items()}
    assert got == {"stare": (32, 1.0, 0.7, 3072), "dapo": (32, 1.0, 0.7, 20480), "r1": (64, 0.6, 0.95, 32768)}
    assert all(p.instruction.endswith("within \\boxed{}.") for p in protocols.PROTOCOLS.values())


def test_resolve_protocol_applies_the_overrides_given():
    p = protocols.resolve_protocol("r1", k=4, temperature=None, top_p=1.0, max_tokens=None)
    assert (p.name, p.k, p.temperature, p.top_p, p.max_tokens) == ("r1", 4, 0.6, 1.0, 32768)  # None: not given
    assert protocols.PROTOCOLS["r1"].k == 64  # the table is left as it was
    # the bounds themselves are accepted: top_p 1, temperature 0 (greedy, with k 1) and 2, one token, one sample
    assert protocols.resolve_protocol("stare", temperature=2.0, k=1, max_tokens=1).temperature == 2.0
    greedy = protocols.resolve_protocol("stare", temperature=0.0, k=1)
    assert protocols.is_greedy(greedy) and not protocols.is_greedy(protocols.resolve_protocol("stare",
                                                                                              temperature=1e-6))


@pytest.mark.parametrize("name, overrides, message", [
    ("greedy", {}, "unknown protocol 'greedy'; valid protocols: stare, dapo, r1"),
    ("stare", {"k": 0}, "--k must be >= 1, got 0"),
    ("stare", {"top_p": 0.0}, r"--top-p must be in \(0, 1\], got 0.0"),
    ("stare", {"top_p": 1.01}, r"--top-p must be in \(0, 1\], got 1.01"),
    ("stare", {"temperature": -0.1}, r"--temperature must be in \[0, 2\], got -0.1"),
    ("stare", {"temperature": 2.01}, r"--temperature must be in \[0, 2\], got 2.01"),
    ("stare", {"temperature": float("nan")}, r"--temperature must be in \[0, 2\], got nan"),
    ("stare", {"temperature": float("inf")}, r"--temperature must be in \[0, 2\], got inf"),
    ("stare", {"temperature": 0.0, "k": 2}, "--temperature 0.0 is greedy decoding, .* but --k is 2: use --k 1"),
    ("r1", {"temperature": 0.0}, "--temperature 0.0 is greedy decoding, .* but --k is 64"),  # r1's own k
    ("stare", {"max_tokens": 0}, "--max-tokens must be >= 1, got 0"),
])
def test_resolve_protocol_refusals(name, overrides, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        protocols.resolve_protocol(name, **overrides)


def test_problem_seed_by_hand():
    block = 2**32
    assert protocols.SEED_BLOCK == block
    assert protocols.problem_seed(3, 2, 4) == 3 * block + 8  # problem 2's samples: offsets 8, 9, 10, 11
    assert protocols.problem_seed(0, 0, 5) == 0
    assert protocols.problem_seed(-1, 1, 3) == (2**31 - 1) * block + 3  # Python's -1 mod 2**31
    assert protocols.problem_seed(2**31 + 7, 0, 1) == 7 * block  # a seed is read mod 2**31
    assert protocols.problem_seed(2**31 - 1, block - 1, 1) == 2**63 - 1  # the largest: still below 2**63
    assert protocols.problem_seed(0, block // 4 - 1, 4) == block - 4  # the last problem that fits the block
    for index, k in ((block // 4, 4), (-1, 1), (0, 0)):
        with pytest.raises(ValueError, match=f"problem index {index} with k {k} is outside"):
            protocols.problem_seed(0, index, k)


def test_turn_seed_is_the_samples_own_for_turn_0_and_fixed_per_sample_and_turn():
    assert protocols.turn_seed(12345, 0) == 12345
    later = [protocols.turn_seed(12345, t) for t in range(1, 50)]
    assert len(set(later)) == 49 and all(2**63 <= s < 2**64 for s in later)
    assert later == [protocols.turn_seed(12345, t) for t in range(1, 50)]  # the same on a re-run
    assert protocols.turn_seed(12346, 1) != later[0]
