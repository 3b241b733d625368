import gc

from adaptmem._common.reporting import live_reports, report


class _Owner:
    pass


class _Figures:
    def __init__(self, n: int) -> None:
        self.n = n

    def as_dict(self) -> dict[str, int]:
        return {"n": self.n}


def test_a_source_is_shown_while_its_owner_lives_and_forgotten_after() -> None:
    owner = _Owner()
    figures = _Figures(3)
    report(owner, "pager", figures)
    assert ("pager", figures) in live_reports()
    del owner
    gc.collect()
    assert all(stats is not figures for _, stats in live_reports())


def test_registering_an_owner_again_replaces_its_entry_and_order_is_oldest_first() -> None:
    first, second = _Owner(), _Owner()
    a, b, c = _Figures(1), _Figures(2), _Figures(3)
    report(first, "chunker", a)
    report(second, "splitter", b)
    report(first, "chunker", c)
    mine = [(s, f) for s, f in live_reports() if f in (a, b, c)]
    assert mine == [("splitter", b), ("chunker", c)]
