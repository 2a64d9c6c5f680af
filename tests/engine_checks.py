"""Checks on an in-process engine that tests share."""


def assert_engine_drained(eng) -> None:
    """Nothing running or waiting, no block in use, every block free or cached; invariants hold."""
    eng.check_invariants()
    assert not eng.has_unfinished() and eng.pool.num_in_use == 0
    assert eng.pool.num_free + eng.pool.num_cached == eng.pool.num_blocks
