"""CPU to build a run's model for a real provider (`build_model`: each run builds its own).

    python bench/model_build.py [--builds 50]

Reports the process's CPU time per build for an OpenAI and an Anthropic profile
(nothing is sent), and what the SDK client alone costs when left to make its own
TLS context, as it did before `providers.tls_context`.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

from pydantic import SecretStr

from coordinator import Profile
from workers.runtime.providers import build_model

PROFILES = {
    "openai": Profile(model="openai:gpt-4o-mini", api_key=SecretStr("unused"), base_url="https://127.0.0.1:1/v1"),
    "anthropic": Profile(model="anthropic:claude-sonnet-4-5", api_key=SecretStr("unused")),
}


def cpu_ms_each(build: Callable[[], object], builds: int) -> float:
    build()  # imports and first-use caches out of the figure
    start = time.process_time()
    for _ in range(builds):
        build()
    return (time.process_time() - start) / builds * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=50)
    builds = parser.parse_args().builds
    for name, profile in PROFILES.items():
        each = cpu_ms_each(functools.partial(build_model, profile), builds)
        print(f"build_model {name}: {each:.2f} ms CPU a build")
    from openai import AsyncOpenAI  # the SDK's client with its own TLS context, as before

    own = cpu_ms_each(lambda: AsyncOpenAI(api_key="unused", base_url="https://127.0.0.1:1/v1"), builds)
    print(f"AsyncOpenAI with its own TLS context: {own:.2f} ms CPU a build")


if __name__ == "__main__":
    main()
