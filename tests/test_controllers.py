"""Controllers on scripted entropy sequences, state round-trips, parameter validation."""
import pytest

from stare.algorithms import BandGate, PaperGate

FULL = dict(w=1.5, m=0.5, damp=0.5)  # a band gate's weights at full strength (BandGate has no defaults for them)


def test_paper_gate_binary():
    gate = PaperGate(target_entropy=0.3)
    seq = [0.5, 0.29, 0.3, 0.1, 0.31]
    assert [gate.update(h).gate_on for h in seq] == [False, True, False, True, False]
    assert gate.last.w == 1.1 and gate.last.m == 0.9  # fixed weights when not adaptive


def test_paper_gate_adaptive_sequence_by_hand():
    gate = PaperGate(0.3, w=1.1, m=0.9, adaptive=True, alpha=0.1, w_max=1.3, m_min=0.75)
    # H above target: W down towards 1, M up towards 1; below: W up to w_max, M down to m_min; equal: no move
    seq = [0.5, 0.5, 0.2, 0.2, 0.2, 0.2, 0.3, 0.9]
    expected_w = [1.0, 1.0, 1.1, 1.2, 1.3, 1.3, 1.3, 1.2]
    expected_m = [1.0, 1.0, 0.9, 0.8, 0.75, 0.75, 0.75, 0.85]
    states = [gate.update(h) for h in seq]
    assert [s.w for s in states] == pytest.approx(expected_w)
    assert [s.m for s in states] == pytest.approx(expected_m)
    assert [s.gate_on for s in states] == [False, False, True, True, True, True, False, False]


def test_band_gate_sequence_by_hand():
    assert BandGate(0.3, 0.45, **FULL).target == 0.45  # the default target is the top of the band
    gate = BandGate(0.3, 0.45, target=0.375, w=1.5, m=0.5, damp=0.5)
    cases = {  # H: (strength, gate_on)
        0.5: (0.0, False),     # above the band, one-sided: off
        0.4: (0.0, False),     # dead zone
        0.375: (0.0, False),   # at the target: nothing to do
        0.3375: (0.5, True),   # half-way between target and low
        0.3: (1.0, True),      # at low: full strength
        0.05: (1.0, True),     # below: capped at full strength
    }
    for h, (s, on) in cases.items():
        st = gate.update(h)
        assert st.strength == pytest.approx(s) and st.gate_on == on and st.direction == 1
        assert st.w == pytest.approx(1 + s * 0.5) and st.m == pytest.approx(1 - s * 0.5)
        assert st.damp == pytest.approx(1 - s * 0.5)
    two = BandGate(0.3, 0.45, target=0.4, two_sided=True, gain=2.0, **FULL)
    st = two.update(0.475)  # excess 0.025 over a span of 0.05, gain 2 -> 1.0
    assert st.direction == -1 and st.strength == pytest.approx(1.0) and st.gate_on
    st = two.update(0.4625)
    assert st.direction == -1 and st.strength == pytest.approx(0.5)
    st = two.update(0.375)  # shortfall 0.025 over a span of 0.1, gain 2 -> 0.5
    assert st.direction == 1 and st.strength == pytest.approx(0.5)
    kwargs = st.weight_kwargs()
    assert set(kwargs) == {"gate_on", "w", "m", "damp", "direction"}


EPS = 1e-6


@pytest.mark.parametrize("two_sided", [False, True])
def test_band_gate_at_and_beside_both_edges_with_the_default_target(two_sided):
    """The default target is the band's top (0.45), so below it the push up starts at once and above it, two-sided,
    the push down is at full strength at once (its span, top - target, is 0). At the top itself neither acts: the
    branch is ``h > high``, and ``>=`` would push down at full strength there."""
    gate = BandGate(0.3, 0.45, w=1.5, m=0.5, damp=0.5, two_sided=two_sided)
    cases = {  # H: (strength, direction), worked out by hand from the band [0.3, 0.45], target 0.45, gain 1
        0.45: (0.0, 1),  # the top (= the target): nothing
        0.45 + EPS: (1.0, -1) if two_sided else (0.0, 1),  # just above: full push down, or off
        0.45 - EPS: (EPS / 0.15, 1),  # just below: the push up starts from 0
        0.3 + EPS: (1 - EPS / 0.15, 1),  # just above low: almost full
        0.3: (1.0, 1),  # low: full strength
        0.3 - EPS: (1.0, 1),  # below: capped
    }
    for h, (strength, direction) in cases.items():
        st = gate.update(h)
        assert st.strength == pytest.approx(strength, rel=1e-9, abs=1e-15), h
        assert st.direction == direction and st.gate_on == (strength > 0), h
        assert (st.w, st.m, st.damp) == pytest.approx((1 + 0.5 * strength, 1 - 0.5 * strength, 1 - 0.5 * strength),
                                                      rel=1e-12, abs=1e-15), h


@pytest.mark.parametrize("make", [
    lambda: PaperGate(0.3, adaptive=True, alpha=0.05),
    lambda: BandGate(0.2, 0.5, two_sided=True, **FULL),
])
def test_state_round_trip_resumes_identically(make):
    seq = [0.6, 0.25, 0.1, 0.35, 0.45, 0.7, 0.2, 0.15, 0.5, 0.28]
    straight = make()
    expected = [straight.update(h) for h in seq]
    first = make()
    for h in seq[:4]:
        first.update(h)
    saved = first.state_dict()
    resumed = make()
    resumed.load_state_dict(saved)
    assert resumed.last == expected[3]
    assert [resumed.update(h) for h in seq[4:]] == expected[4:]
    assert resumed.steps == len(seq)


def test_state_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="kind 'band'"):
        PaperGate().load_state_dict(BandGate(**FULL).state_dict())


@pytest.mark.parametrize("make, pattern", [
    (lambda: PaperGate(target_entropy=0.0), "target_entropy must be in \\(0"),
    (lambda: PaperGate(w=0.0), "w must be in \\(0"),
    (lambda: PaperGate(m=-0.5), "m must be in \\(0"),
    (lambda: PaperGate(adaptive=True, w=2.0, w_max=1.5), "w must be in \\[1, 1.5\\]"),
    (lambda: BandGate(0.5, 0.3, **FULL), "band low must be <= band high"),
    (lambda: BandGate(0.0, 0.3, **FULL), "band low must be in \\(0"),
    (lambda: BandGate(0.3, 0.4, target=0.5, **FULL), "target must be in \\[0.3, 0.4\\]"),
    (lambda: BandGate(w=1.5, m=1.5, damp=0.5), "m must be in \\(0, 1\\]"),
])
def test_bad_parameters(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_bad_entropy_values():
    for bad in (float("nan"), float("inf"), -0.1):
        with pytest.raises(ValueError, match="batch_entropy"):
            PaperGate().update(bad)


def test_the_band_gate_takes_its_weights_from_the_algorithm():
    """BandGate has no weights of its own: without w, m and damp it is refused, and an algorithm's gate carries the
    algorithm's (stare-phi: W 2, M 0.05, damp 0.2 in the registry)."""
    from stare.algorithms import get_algorithm

    with pytest.raises(TypeError):
        BandGate(0.3, 0.45)
    gate = get_algorithm("stare-phi").make_controller()
    st = gate.update(0.0)  # far below the band: full strength
    assert st.strength == 1.0 and (st.w, st.m, st.damp) == pytest.approx((2.0, 0.05, 0.2))
