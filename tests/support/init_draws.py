"""recorded_draws(): the tiles megaframe/model/init_values.py draws, for the tests that count them
(tests/unit/model/test_init_values.py, tests/dist/test_init_draws.py) and tools/bench_init.py."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def recorded_draws() -> Iterator[list[tuple[tuple[int, ...], int, int]]]:
    """While inside, every tile drawn is appended to the list yielded as (lead, row, col); each is
    TILE_ROWS x TILE_COLS draws. draw_tile is looked up at each call, so this reaches every caller."""
    from megaframe.model import init_values

    drawn, original = [], init_values.draw_tile

    def recording(seed, name, lead, row, col, generator=None):
        drawn.append((lead, row, col))
        return original(seed, name, lead, row, col, generator)
    init_values.draw_tile = recording
    try:
        yield drawn
    finally:
        init_values.draw_tile = original
