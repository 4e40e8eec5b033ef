"""The addresses no outbound connection of subq's may reach: a webhook's POST, and a sandboxed command's.

Both go where a model or a caller says (a URL in a request, a host a command names), so both keep off the
machine's own network by one list: `BLOCKED_NETWORKS`, and the host's own addresses (a public one reaches a
service bound to 0.0.0.0, Redis among them). A webhook's address is checked by `blocked_address` as it is
resolved (coordinator/subscriptions.py); a sandbox's proxy and routes by the same (workers/runtime/egress.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
import time
from pathlib import Path

__all__ = ["BLOCKED_NETWORKS", "IpAddress", "blocked_address", "own_addresses", "own_addresses_lately"]

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# The host's loopback, the private and shared ranges (RFC 1918; RFC 6598, where Alibaba Cloud's metadata address
# 100.100.100.200 is), link-local (the metadata address 169.254.169.254 of AWS, GCP's metadata.google.internal,
# Azure's, Oracle's and most others'), "this network", IETF protocol assignments (Oracle Cloud's metadata address
# 192.0.0.192 is in it; a sandbox's own /30 is more specific: its gateway answers DNS), Azure's WireServer
# 168.63.129.16 (a public address, but each Azure VM's own host: it hands the VM its certificates and extensions'
# settings), benchmarking, multicast and reserved; for IPv6 loopback, the IPv4-compatible form (::/96), NAT64
# (well-known and local-use, RFC 8215), 6to4 and Teredo (each can carry an IPv4 address of the ranges above),
# discard-only (RFC 6666), unique-local (AWS's metadata address fd00:ec2::254 and GCP's fd20:ce::254 are in it),
# link-local and site-local, multicast, and the IPv4-mapped form of the ranges above (`blocked_address` unpacks it).
# Python's `is_global` is not enough: it reads the NAT64, 6to4, IPv4-compatible and site-local forms of a private
# address as global (and which it reads so moves between patch releases).
BLOCKED_NETWORKS = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "168.63.129.16/32", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
        "::/96", "::1/128", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64", "2001::/32", "2002::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
    )
)  # fmt: skip


def blocked_address(address: IpAddress, own: set[IpAddress] | frozenset[IpAddress] | None = None) -> bool:
    """Whether `address` is in a blocked range (its IPv4-mapped form unpacked), or one of `own`."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if own is not None and address in own:
        return True
    return any(address.version == net.version and address in net for net in BLOCKED_NETWORKS)


def own_addresses() -> set[IpAddress]:
    """Every address of this host's interfaces (a public one reaches services bound to 0.0.0.0)."""
    found: set[IpAddress] = set()
    with contextlib.suppress(OSError):  # /proc/net/fib_trie: "|-- 192.0.2.2" then "/32 host LOCAL"
        last = ""
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            text = line.strip()
            if text.startswith("|--"):
                last = text[3:].strip()
            elif text == "/32 host LOCAL" and last:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(last))
    with contextlib.suppress(OSError):  # /proc/net/if_inet6: 32 hex digits, then the interface's fields
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            digits = line.split()[0] if line.split() else ""
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(":".join(digits[i : i + 4] for i in range(0, 32, 4))))
    return found


# How long `own_addresses_lately` keeps what it read: a host's addresses change seldom, and a deliverer checks every
# address of every attempt (a node's routing table, read whole each time, can be thousands of lines).
OWN_ADDRESSES_FOR_S = 30.0
_own: tuple[float, frozenset[IpAddress]] = (float("-inf"), frozenset())
_own_lock = threading.Lock()


def own_addresses_lately() -> frozenset[IpAddress]:
    """`own_addresses`, read again once `OWN_ADDRESSES_FOR_S` old."""
    global _own
    with _own_lock:
        read_at, found = _own
        if time.monotonic() - read_at > OWN_ADDRESSES_FOR_S:
            found = frozenset(own_addresses())
            _own = (time.monotonic(), found)
        return found
