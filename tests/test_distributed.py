"""Process-group behaviour a user meets: a rank that waits too long for another stops with one actionable line."""

from __future__ import annotations

import functools
import os
import time

import pytest

from qlora_fsdp.distributed import barrier, cleanup, decide_on_main, init_distributed
from tests.helpers import run_ranks
from tests.rank_pool import free_port

pytestmark = pytest.mark.slow  # every test runs gloo ranks

TIMEOUT_MINUTES = 0.05  # 3 s


def wait_for_a_busy_rank_0(info, port: int, where: str) -> tuple[str, str] | None:
    """Rank 0 busy for twice the timeout (tokenizing, or deciding); rank 1 waits for it at `where`."""
    barrier()  # both ranks are here, so the second join below is quick for both (its store has the tiny timeout)
    cleanup()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(timeout_minutes=TIMEOUT_MINUTES)
    busy = functools.partial(time.sleep, 2 * TIMEOUT_MINUTES * 60)
    try:
        if where == "barrier":
            if info.rank == 0:
                busy()
            barrier()
        else:
            decide_on_main(busy)
    except RuntimeError as err:  # on rank 0: rank 1 has given up and left, whatever it reported
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("where", ["barrier", "decide_on_main"])
def test_a_collective_timeout_names_the_key_in_one_line(tmp_path, where):
    waited = run_ranks(wait_for_a_busy_rank_0, 2, free_port(), where, tmp_dir=tmp_path)[1]
    assert waited is not None, "rank 1 should have stopped waiting"
    kind, message = waited
    assert kind == "CollectiveTimeoutError" and "\n" not in message
    assert message.startswith("a collective waited longer than train.collective_timeout_minutes=0.05 ")
    assert "raise it" in message
