"""A provider's client over TLS: one TLS context a process (`providers.tls_context`), the certificate still checked.

Each run builds its model; the context that checks the provider's certificate is
made once a process, as httpx makes its default (the CA bundle, or the file
`SSL_CERT_FILE` names). Each check runs in a fresh interpreter, since the
context is read once a process.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from tests.model_server import KEY, ModelServer

TIMEOUT_S = 120
# One run's model built twice, then asked: the two clients share the process's one context (a client left
# to make its own would make a TLS context each: counted as they are made).
ASK = """
import ssl, sys
from pydantic import SecretStr
from pydantic_ai import Agent
from coordinator import Profile
from workers.runtime.providers import build_model
made = []
make = ssl.SSLContext.__new__
ssl.SSLContext.__new__ = lambda cls, *args, **kwargs: made.append(cls) or make(cls, *args, **kwargs)
profile = Profile(model="openai:m", api_key=SecretStr(sys.argv[1]), base_url=sys.argv[2])
first, second = build_model(profile), build_model(profile)
ssl.SSLContext.__new__ = make
assert len(made) == 1, f"{len(made)} TLS contexts for two models"
try:
    print("answer:", Agent(second).run_sync("hi").output)
except Exception as exc:
    print("failed:", exc)
"""


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[ModelServer, Path]]:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = ModelServer()
    server._http.socket = context.wrap_socket(server._http.socket, server_side=True)
    with server:
        yield server, ca_file


def ask(server: ModelServer, **env: str) -> str:
    url = f"https://127.0.0.1:{server.port}/v1"
    environment = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    done = subprocess.run(
        [sys.executable, "-c", ASK, KEY, url], env={**environment, **env},
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_provider_over_tls_is_reached_through_the_one_context_that_trusts_its_ca(
    tls_server: tuple[ModelServer, Path],
) -> None:
    server, ca_file = tls_server
    assert ask(server, SSL_CERT_FILE=str(ca_file)).startswith("answer: ")
    assert len(server.seen) == 1


def test_a_certificate_no_trusted_ca_signed_is_refused(tls_server: tuple[ModelServer, Path]) -> None:
    server, _ = tls_server
    line = ask(server)
    # The same server, the same client: only the CA file differs from the test above.
    assert line.startswith("failed: ModelConnectionError"), line
    assert server.seen == [], "no request got past the handshake"
