"""Token budget admission control as plain logic."""

from tasks.generate.budget import MIN_SAMPLES, TokenBudget


def test_unlimited_budget_always_admits():
    budget = TokenBudget(None, max_new_tokens=100)
    for _ in range(1000):
        assert budget.can_admit()
        budget.admit()
    assert not budget.exhausted


def test_conservative_until_enough_samples_then_mean():
    budget = TokenBudget(10_000, max_new_tokens=1000)
    admitted = 0
    while budget.can_admit():
        budget.admit()
        admitted += 1
    assert admitted == 10  # 10 * max_new_tokens fits before any response is known
    for _ in range(admitted):
        budget.finish(100)
    assert budget.expected_length() == 1000.0  # 10 samples are too few to trust
    for _ in range(MIN_SAMPLES - admitted):
        budget.admit()
        budget.finish(100)
    assert budget.spent == 100 * MIN_SAMPLES
    assert budget.expected_length() == 100.0
    assert budget.in_flight == 0


def test_admission_keeps_spent_plus_expected_under_limit():
    budget = TokenBudget(5_000, max_new_tokens=50)
    budget.seed([50] * MIN_SAMPLES)  # a resumed run: every length 50 known
    budget.spent = 4_000
    n = 0
    while budget.can_admit():
        budget.admit()
        n += 1
    assert n == 20  # 4000 + 20 * 50 == 5000
    assert budget.spent + budget.in_flight * budget.expected_length() <= budget.limit


def test_one_request_is_admitted_when_nothing_runs():
    budget = TokenBudget(100, max_new_tokens=1000)
    assert budget.can_admit()  # expected 1000 > 100, but nothing is in flight: never stall
    budget.admit()
    assert not budget.can_admit()


def test_exhaustion_and_waste():
    budget = TokenBudget(300, max_new_tokens=200)
    budget.admit()
    budget.admit()
    budget.finish(310)
    assert budget.exhausted and not budget.can_admit()
    budget.discard(wasted_tokens=42)
    assert budget.wasted == 42 and budget.in_flight == 0
    assert budget.fraction == 310 / 300


def test_in_flight_estimate_is_length_biased():
    # long-tailed lengths: the requests still running are the long ones
    budget = TokenBudget(10**6, max_new_tokens=10_000)
    budget.seed([10] * 90 + [1000] * 10)
    plain_mean = (90 * 10 + 10 * 1000) / 100
    assert budget.expected_length() == (90 * 100 + 10 * 1000**2) / (90 * 10 + 10 * 1000)
    assert budget.expected_length() > 8 * plain_mean
    budget.seed([10**6])  # never above max_new_tokens
    assert budget.expected_length() == 10_000
