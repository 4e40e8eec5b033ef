"""Choosing a port for a local server (coordinator/local/ports.py), against the host's real sockets.

A port from the kernel's ephemeral range can be taken, between being chosen and
being bound, as the local port of any process's outgoing connection: a metrics
test's worker failed in CI on 'the port is in use by another process'.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local import ports
from coordinator.local.ports import free_port, port_free


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.parametrize("count", [1, 4])
def test_a_chosen_port_lies_below_the_ephemeral_range_and_binds_with_the_ports_after_it(count: int) -> None:
    for _ in range(20):
        first = free_port(count)
        assert first >= ports.CHOOSE_FROM and first + count <= _ephemeral_low()
        for port in range(first, first + count):
            assert port_free("127.0.0.1", port) and port_free("0.0.0.0", port)


@pytest.fixture
def one_candidate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[int]:
    """A range that leaves free_port(2) one choice: the first of two free ports."""
    first = free_port(2)
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(f"{first + 3}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    monkeypatch.setattr(ports, "CHOOSE_FROM", first)
    monkeypatch.setattr(ports, "MAX_TRIES", 5)
    monkeypatch.setattr(ports, "HOLD_S", 0.0)  # the one candidate may be handed out again at once
    yield first


def test_a_port_something_listens_on_is_never_chosen(one_candidate: int) -> None:
    assert free_port(2) == one_candidate
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", one_candidate + 1))
        listener.listen()
        with pytest.raises(OSError, match="no 2 consecutive free ports found in 5 tries"):
            free_port(2)
    assert free_port(2) == one_candidate


def test_without_the_kernels_range_file_the_default_floor_bounds_the_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    assert ports.CHOOSE_FROM <= free_port() < ports.DEFAULT_EPHEMERAL_LOW


def test_a_port_handed_out_is_not_handed_out_again_before_its_server_binds_it() -> None:
    """Two servers of one test were once given the same port (a sentinel's failed on "address in use"):
    nothing listens on a chosen port until its server starts, so the bind check alone cannot tell."""
    chosen = [free_port() for _ in range(3000)]  # 3,000 of ~22,000: a repeat is all but certain by chance alone
    assert len(set(chosen)) == len(chosen)
    firsts = [free_port(4) for _ in range(200)]
    taken = [port for first in firsts for port in range(first, first + 4)]
    assert len(set(taken)) == len(taken) and not set(taken) & set(chosen)


def test_a_port_is_handed_out_again_once_its_hold_is_over(one_candidate: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert free_port(2) == one_candidate
    monkeypatch.setattr(ports, "HOLD_S", 3600.0)  # the candidate, just handed out, is held again
    with pytest.raises(OSError, match="no 2 consecutive free ports found in 5 tries"):
        free_port(2)
    monkeypatch.setattr(ports, "HOLD_S", 0.0)
    assert free_port(2) == one_candidate
