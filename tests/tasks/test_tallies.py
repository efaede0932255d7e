from dataclasses import dataclass, field

from tasks.records.build import PartReport
from tasks.responses.checkpoints import PartSummary
from tasks.responses.tallies import add_counts


@dataclass
class Tally:
    n: int = 0
    seen: list[int] = field(default_factory=list)
    by_reason: dict[str, int] = field(default_factory=dict)
    at: float | None = None
    started: int | None = None


def test_counts_add_and_other_fields_are_left_alone():
    into = Tally(2, [1], {"stop": 1}, at=5.0, started=7)
    add_counts(into, Tally(3, [4, 5], {"stop": 2, "length": 1}, at=1.0, started=9))
    assert into == Tally(5, [1, 4, 5], {"stop": 3, "length": 1}, at=5.0, started=7)


def test_part_summary_adds_counts_and_keeps_the_first_and_last_finish():
    # rows, completion and prompt tokens, finish reasons, lengths, first and last finish, later turns
    total = PartSummary(2, 10, 4, {"stop": 2}, [4, 6], 10.0, 20.0, 1)
    total.add(PartSummary(1, 7, 3, {"length": 1}, [7], 5.0, 15.0))
    assert total == PartSummary(3, 17, 7, {"stop": 2, "length": 1}, [4, 6, 7], 5.0, 20.0, 1)


def test_part_report_adds_every_count():
    total = PartReport(records=1, tokens=9, loss_tokens=4, truncated=0, lengths=[9], dropped={"rejected": 1})
    total.add(
        PartReport(records=2, tokens=5, loss_tokens=3, truncated=1, lengths=[2, 3], dropped={"rejected": 2, "empty": 1})
    )
    assert total == PartReport(
        records=3, tokens=14, loss_tokens=7, truncated=1, lengths=[9, 2, 3], dropped={"rejected": 3, "empty": 1}
    )
