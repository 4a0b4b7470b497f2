"""The board on which the vLLM engines of one host share their cores, with real processes on it."""

from __future__ import annotations

import os

import pytest
from distributed.utils_test import poll_for

from dask_kvstate.backends.vllm_cores import SLOTS, CoreShare, count_cores, parse_cores, share
from dask_kvstate.testing.core_peer import start, stop


def _using(board: CoreShare, pid: int) -> int:
    rows = board._rows
    return next(int(rows[s, 3]) for s in range(SLOTS) if rows[s, 0] == pid)


def test_an_engine_alone_takes_every_core(tmp_path):
    board = CoreShare("0-3", tmp_path)
    assert board.threads() == 4
    board.close()


def test_engines_stepping_together_split_the_cores_and_an_idle_one_leaves_them(tmp_path):
    peer = start("0-3", tmp_path, "stepping")
    try:
        board = CoreShare("0-3", tmp_path)
        assert board.threads() == 2  # two stepping on four cores
        poll_for(lambda: _using(board, peer.pid) == 2, timeout=10)  # and the peer's next steps on its share
        other = start("0-3", tmp_path, "idle")  # on the board, not stepping: takes nothing
        try:
            assert board.threads() == 2
        finally:
            stop(other)
        board.idle()
        poll_for(lambda: _using(board, peer.pid) == 4, timeout=10)  # ours idle: the peer's next steps take all four
    finally:
        stop(peer)
    assert board.threads() == 4  # the stepping peer died: its claim ended with it
    board.close()


def test_a_step_begun_alone_delays_a_newcomer_only_so_long(tmp_path):
    peer = start("0,1", tmp_path, "stuck")  # on both cores, and it never posts again
    try:
        board = CoreShare("0,1", tmp_path)
        assert board.threads() == 1  # waited for the step to end, then went ahead on its share
        board.close()
    finally:
        stop(peer)


def test_a_dead_engines_slot_is_taken_again(tmp_path):
    peer = start("0,1", tmp_path, "stepping")
    stop(peer)
    board = CoreShare("0,1", tmp_path)
    assert board.slot == 0  # the dead process's row
    assert board.threads() == 2
    board.close()


def test_only_engines_given_the_same_cores_share(tmp_path):
    peer = start("1,0", tmp_path, "stepping")  # the same set, written another way
    other = None
    try:
        other = start("2-3", tmp_path, "stepping")
        board = CoreShare("0-1", tmp_path)
        assert board.threads() == 1
        board.idle()
        board.close()
    finally:
        stop(peer)
        if other is not None:
            stop(other)


def test_more_engines_than_cores_step_at_once_on_a_thread_each(tmp_path):
    peers = [start("0,1", tmp_path, "stepping") for _ in range(2)]
    try:
        board = CoreShare("0,1", tmp_path)
        for _ in range(20):  # one thread each: three on two cores is the least the split can do
            assert board.threads() == 1
        board.close()
    finally:
        for p in peers:
            stop(p)


def test_a_reused_pid_does_not_keep_a_dead_engines_row(tmp_path):
    board = CoreShare("0,1", tmp_path)
    other = board.slot + 1
    board._rows[other] = (os.getpid(), 12345, 1, 2)  # this process's pid, but another start: a reused pid
    assert board.threads() == 2
    board.close()


def test_shares_add_up_to_the_cores_and_never_drop_below_one():
    for cores in range(1, 9):
        for busy in range(1, 12):
            shares = [share(cores, busy, r) for r in range(busy)]
            assert min(shares) >= 1
            assert sum(shares) == max(cores, busy)


def test_a_bad_core_list_is_named():
    assert count_cores("0-1,4") == 3
    with pytest.raises(ValueError, match="'0-x'"):
        parse_cores("0-x")
    assert SLOTS >= 2
