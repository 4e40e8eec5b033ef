"""The addresses no outbound connection of subq's reaches (coordinator/networks.py): a webhook's and a sandbox's."""

from __future__ import annotations

import ipaddress

import pytest

from coordinator.networks import blocked_address


@pytest.mark.parametrize(
    ("address", "whose"),
    [
        ("169.254.169.254", "AWS's, GCP's (metadata.google.internal), Azure's and Oracle's metadata service"),
        ("fd00:ec2::254", "AWS's metadata service over IPv6"),
        ("fd20:ce::254", "GCP's metadata service over IPv6"),
        ("100.100.100.200", "Alibaba Cloud's metadata service"),
        ("192.0.0.192", "Oracle Cloud's metadata service"),
        ("168.63.129.16", "Azure's WireServer: a public address, the VM's own host"),
        ("::ffff:168.63.129.16", "the WireServer's IPv4-mapped form"),
    ],
)
def test_every_clouds_metadata_address_is_blocked(address: str, whose: str) -> None:
    assert blocked_address(ipaddress.ip_address(address)), whose


def test_the_wireserver_is_blocked_alone_not_its_public_neighbours() -> None:
    """168.63.129.16 is outside every private range: it was reached, by a webhook and by `network = true`."""
    for neighbour in ("168.63.129.15", "168.63.129.17", "168.63.128.16"):
        assert not blocked_address(ipaddress.ip_address(neighbour)), neighbour
