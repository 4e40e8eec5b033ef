"""The OS sandbox of `run_command` (workers/runtime/sandbox.py): real bubblewrap, real processes.

Every command here would succeed unconfined (each test shows it where it matters), so
what fails inside is the sandbox's doing, not the command's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator import ConfigError, Profile, RunCommand, Settings, TaskStatus, load_settings
from tests.agents import agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import assert_worker_refuses, connections_counted, counting_listener, subq_tools
from workers.runtime import commands
from workers.runtime.sandbox import NEEDS, Sandbox, SandboxUnavailable, probe


def _run(command: str, cwd: Path, hiding: Sandbox | None = None, **config: Any) -> commands.CommandResult:
    return asyncio.run(commands.run(command, RunCommand(cwd=cwd, **config), sandbox=hiding))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def test_the_sandbox_starts_here() -> None:
    probe()  # scripts/os-packages installs bubblewrap and passt; without them every test below would fail
    probe(network=True)
    probe(network=["packages.example.net"])


def test_a_command_writes_in_its_cwd_and_nowhere_else(tmp_path: Path, workdir: Path) -> None:
    outside = tmp_path / "outside.txt"
    assert _run("sh -c 'echo made > inside.txt'", workdir).text() == "exit 0\n"
    assert (workdir / "inside.txt").read_text() == "made\n"
    # tmp_path is under /tmp: the sandbox's /tmp is its own, so the file lands there, never here.
    _run(f"sh -c 'echo x > {outside}'", workdir)
    assert not outside.exists()
    home = Path.home() / "subq-sandbox-canary"
    refused = _run(f"touch {home}", workdir)
    assert refused.exit_code != 0 and "Read-only file system" in refused.output
    assert not home.exists()
    unconfined = _run(f"sh -c 'echo x > {outside}'", workdir, sandbox=False)
    assert unconfined.exit_code == 0 and outside.exists(), "the same command outside the sandbox writes it"


def test_tmp_is_private_and_writable(workdir: Path) -> None:
    mine = Path("/tmp/subq-sandbox-private")
    assert _run(f"sh -c 'echo x > {mine} && cat {mine}'", workdir).text() == "exit 0\nx\n"
    assert not mine.exists(), "the command's /tmp is its own"


def test_subqs_files_are_hidden(tmp_path: Path, workdir: Path) -> None:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('[profiles.x]\napi_key = "sk-secret-profile"\n')
    keys = tmp_path / "keys.json"
    keys.write_text('{"secret-ops": {"token_sha256": "' + "0" * 64 + '", "scopes": ["admin"]}}')
    stack_logs = tmp_path / "up-logs"
    stack_logs.mkdir()
    (stack_logs / "credentials.env").write_text("SUBQ_API_TOKEN=secret-token\n")
    inside = workdir / ".subq-profiles.toml"  # a hidden file inside the writable folder stays hidden
    inside.write_text("secret-inside")
    settings = Settings(profiles_file=profiles, api_keys_file=keys, sandbox_hidden_paths=[stack_logs, inside])
    sandbox = Sandbox.of(settings)
    for secret in (profiles, keys, stack_logs / "credentials.env", inside):
        assert "secret" not in _run(f"cat {secret}", workdir, sandbox).output, secret
        assert "secret" in _run(f"cat {secret}", workdir, sandbox, sandbox=False).output, "readable unconfined"


def test_a_client_tls_key_named_in_the_redis_url_is_hidden(tmp_path: Path, workdir: Path) -> None:
    """With one Redis, TLS is set in its URL (SUBQ_REDIS_TLS_KEY_FILE is Sentinel's): the key it names is hidden."""
    key = tmp_path / "client.key"
    key.write_text("secret-key")
    for query in (f"ssl_keyfile={key}", f"ssl_certfile={tmp_path / 'client.crt'}&ssl_keyfile={key}&ssl_cert_reqs=none"):
        sandbox = Sandbox.of(Settings(redis_url=f"rediss://:pw@127.0.0.1:6380/0?{query}"))
        assert key in sandbox.hidden, query
        assert "secret" not in _run(f"cat {key}", workdir, sandbox).output, query
    assert "secret" in _run(f"cat {key}", workdir, Sandbox.of(Settings()), sandbox=False).output, "readable unconfined"


def test_subq_ups_embedded_redis_folder_is_hidden_wherever_tmpdir_points(workdir: Path) -> None:
    """`subq up`'s embedded Redis keeps its password (redis.conf) and every tree's state (its append-only file) in
    a folder of its own. Under TMPDIR=/var/tmp (or any folder but /tmp, which the sandbox replaces with its own)
    a sandboxed command read both: the stack hid only its log folder."""
    from coordinator.local.embedded_redis import local_redis
    from coordinator.local.up import hiding

    parent = Path(tempfile.mkdtemp(prefix="subq-up-redis-", dir="/var/tmp"))  # as `subq up` makes it, not in /tmp
    try:
        with local_redis(parent=parent) as url:
            (folder,) = parent.iterdir()
            password = url.split(":")[2].split("@")[0]
            config = folder / "redis.conf"
            assert password in _run(f"cat {config}", workdir, sandbox=False).output, "readable unconfined"
            assert password in _run(f"cat {config}", workdir, Sandbox.of(Settings())).output, "and by default"
            hidden = Sandbox.of(hiding(Settings(), workdir.parent / "logs", parent))
            for path in (config, folder):
                assert password not in _run(f"sh -c 'cat {path} {path}/*'", workdir, hidden).output, path
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def release() -> Iterator[tuple[Path, Path]]:
    """A deploy's layout: a release folder holding a profiles file, and `current`, a relative symlink to it.
    Outside /tmp: the sandbox's /tmp is its own, and the links must be there inside as on the host."""
    base = Path(tempfile.mkdtemp(prefix="subq-release-", dir="/var/tmp"))
    real = base / "releases" / "42"
    real.mkdir(parents=True)
    (real / ".subq-profiles.toml").write_text('[profiles.x]\napi_key = "sk-secret-profile"\n')
    current = base / "current"
    current.symlink_to("releases/42")
    try:
        yield real, current
    finally:
        shutil.rmtree(base)


def test_a_hidden_file_stays_hidden_when_a_symlink_names_it_or_the_cwd(release: tuple[Path, Path]) -> None:
    """The cwd's bind mounted the host's folder over the hidden file, which was not hidden again: its path
    and the cwd's, one through the symlink and one not, did not compare as inside each other."""
    real, current = release
    for hidden, cwd in ((real, current), (current, real)):
        sandbox = Sandbox.of(Settings(profiles_file=hidden / ".subq-profiles.toml"))
        read = _run("cat .subq-profiles.toml", cwd, sandbox)
        assert "secret" not in read.output, (hidden, cwd, read.text())
        assert "secret" in _run("cat .subq-profiles.toml", cwd, sandbox, sandbox=False).output, "readable unconfined"


def test_a_cwd_named_through_an_absolute_symlink_runs_commands(release: tuple[Path, Path]) -> None:
    real, current = release
    current.unlink()
    current.symlink_to(real)  # as `ln -s /srv/app/releases/42 /srv/app/current` makes it
    ran = _run("sh -c 'echo made > made.txt && echo ran'", current)
    assert ran.text() == "exit 0\nran\n", ran.text()
    assert (real / "made.txt").read_text() == "made\n", "it writes in its cwd"


def test_a_hidden_path_cannot_be_moved_from_under_what_hides_it(workdir: Path) -> None:
    """The hiding is by path, looked up at each command: a command renamed the folder above a hidden file (`mv conf
    moved`), and its next command read the file at its new path. The folders between the writable folder and the
    hidden path are mount points now, which cannot be renamed; they stay writable."""
    conf = workdir / "conf"
    (conf / "secrets").mkdir(parents=True)
    (conf / "profiles.toml").write_text("sk-S3CRET-profile")
    (conf / "secrets" / "credentials.env").write_text("SUBQ_API_TOKEN=S3CRET-token")
    sandbox = Sandbox.of(Settings(sandbox_hidden_paths=[conf / "profiles.toml", conf / "secrets"]))
    moved = _run("mv conf moved", workdir, sandbox)
    assert moved.exit_code != 0 and "busy" in moved.output.lower(), moved.text()
    read = _run("sh -c 'cat moved/profiles.toml moved/secrets/credentials.env conf/profiles.toml conf/secrets/*'",
                workdir, sandbox)  # fmt: skip
    assert "S3CRET" not in read.output, read.text()
    assert (conf / "profiles.toml").read_text() == "sk-S3CRET-profile", "the file is where it was"
    assert _run("sh -c 'echo kept > conf/notes.txt'", workdir, sandbox).exit_code == 0, "the folder stays writable"
    assert (conf / "notes.txt").read_text() == "kept\n"
    written = _run("sh -c 'echo x > conf/secrets/planted'", workdir, sandbox)
    assert written.exit_code != 0 and not (conf / "secrets" / "planted").exists(), "a hidden folder is read-only"
    assert _run("mv conf moved", workdir, sandbox, sandbox=False).exit_code == 0, "unconfined, the move succeeds"


def test_a_writable_folder_or_a_hidden_path_inside_a_hidden_folder_still_starts(tmp_path: Path) -> None:
    """A hidden folder made read-only at once refused the mount points bwrap then made inside it: a cwd under a
    hidden folder (`SUBQ_SANDBOX_HIDDEN_PATHS=/srv/app`, cwd `/srv/app/work`), or a socket hidden inside a folder
    hidden before it, and every command failed to start. The folder is made read-only last."""
    base = Path(tempfile.mkdtemp(prefix="subq-hidden-", dir="/var/tmp"))  # outside the sandbox's own /tmp
    try:
        app, work = base / "app", base / "app" / "work"
        work.mkdir(parents=True)
        (app / "secret.env").write_text("S3CRET")
        (app / "conf").mkdir()
        (app / "conf" / "key.pem").write_text("S3CRET")
        sandbox = Sandbox(hidden=(app, app / "conf" / "key.pem"))
        ran = _run("sh -c 'echo made > made.txt; cat ../secret.env ../conf/key.pem; touch ../planted'", work, sandbox)
        assert ran.exit_code != 0 and "S3CRET" not in ran.output, ran.text()
        assert (work / "made.txt").read_text() == "made\n", "it writes in its cwd"
        assert not (app / "planted").exists() and "Read-only file system" in ran.output, ran.text()
    finally:
        shutil.rmtree(base)


def test_tmp_holds_at_most_the_commands_memory(workdir: Path) -> None:
    """The private /tmp is a tmpfs, memory: it took half the host's RAM whatever `memory_mb` said."""
    fill = "dd if=/dev/zero of=/tmp/fill bs=1M count=64"
    bounded = _run(fill, workdir, memory_mb=16)
    assert bounded.exit_code != 0 and "No space left" in bounded.output, bounded.text()
    assert _run(fill, workdir, memory_mb=256).exit_code == 0


def test_dev_shm_holds_at_most_the_commands_memory_and_the_rest_of_dev_is_read_only(workdir: Path) -> None:
    """bwrap's /dev is a tmpfs of its own, /dev/shm in it: a command wrote files there (or in /dev itself) as large
    as half the host's memory, whatever `memory_mb` said. /dev/shm is a tmpfs of `memory_mb` now, /dev read-only."""
    fill = "dd if=/dev/zero of=/dev/shm/fill bs=1M count=64"
    bounded = _run(fill, workdir, memory_mb=16)
    assert bounded.exit_code != 0 and "No space left" in bounded.output, bounded.text()
    assert _run(fill, workdir, memory_mb=256).exit_code == 0
    planted = _run("dd if=/dev/zero of=/dev/planted bs=1M count=1", workdir)
    assert planted.exit_code != 0 and "Read-only file system" in planted.output, planted.text()
    # What /dev is for still works: POSIX semaphores in /dev/shm, a pseudo-terminal, writing /dev/null.
    used = "python3 -c 'import multiprocessing, os; multiprocessing.Lock(); os.openpty(); os.open(os.devnull, os.O_WRONLY)'"
    assert _run(used, workdir).text() == "exit 0\n"


def test_a_file_holds_at_most_max_file_mb(workdir: Path) -> None:
    """A command's files in its `cwd` are on the worker's disk, and one runaway writer had no bound at all."""
    big = "dd if=/dev/zero of=big bs=1M count=4"
    capped = _run(big, workdir, max_file_mb=1)
    assert capped.status == "killed by SIGXFSZ", capped.text()
    assert (workdir / "big").stat().st_size <= 1024 * 1024
    assert _run(big, workdir).exit_code == 0 and (workdir / "big").stat().st_size == 4 * 1024 * 1024


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A worker's home outside /tmp (the sandbox's /tmp is its own), holding the usual credentials and a file that
    is none of them."""
    base = Path(tempfile.mkdtemp(prefix="subq-home-", dir="/var/tmp"))
    for name in (".ssh/id_ed25519", ".aws/credentials", ".azure/msal_token_cache.json",
                 ".config/gcloud/credentials.db", ".kube/config", ".docker/config.json", ".config/gh/hosts.yml",
                 ".netrc", ".npmrc", ".pypirc", ".git-credentials"):  # fmt: skip
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(f"S3CRET {name}\n")
    (base / ".config" / "tool.toml").write_text("plain setting\n")
    monkeypatch.setenv("HOME", str(base))
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_the_machines_credentials_are_hidden_not_the_home(home: Path, workdir: Path) -> None:
    """The whole filesystem is readable, read-only: a command read the worker's SSH keys and cloud logins (a
    developer's, under `subq up`) and, as root, the password hashes. They are hidden; the rest of the home is not
    (the worker's Python may live there)."""
    sandbox = Sandbox.of(Settings())
    every = "sh -c 'cat ~/.ssh/* ~/.aws/* ~/.azure/* ~/.config/gcloud/* ~/.kube/* ~/.docker/* ~/.config/gh/* " \
        "~/.netrc ~/.npmrc ~/.pypirc ~/.git-credentials; cat ~/.config/tool.toml'"  # fmt: skip
    read = _run(every, workdir, sandbox)
    assert read.output.count("S3CRET") == 0 and "plain setting" in read.output, read.text()
    assert _run(every, workdir, sandbox, sandbox=False).output.count("S3CRET") == 11, "readable unconfined"
    # An MCP server the operator configured may work with them (a kubeconfig, gh's token): shown to it.
    argv = sandbox.wrap(["sh", "-c", every.removeprefix("sh -c '").removesuffix("'")], workdir, network=False,
                        home_credentials=True)  # fmt: skip
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert shown.stdout.count("S3CRET") == 11, shown.stdout + shown.stderr
    if os.access("/etc/shadow", os.R_OK):  # as root, as this suite runs in CI
        files = [name for name in ("/etc/shadow", "/etc/gshadow") if os.path.exists(name)]
        shadow = f"cat {' '.join(files)}"
        hidden = _run(shadow, workdir, sandbox)  # /dev/null in their place, on a mount without devices
        assert "root:" not in hidden.output and hidden.output.count("Permission denied") == len(files), hidden.text()
        assert "root:" in _run(shadow, workdir, sandbox, sandbox=False).output, "readable unconfined"


def test_a_home_the_worker_cannot_enter_hides_nothing_and_breaks_no_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, workdir: Path
) -> None:
    """An inherited HOME in a folder the worker may not enter (`sudo -E`): checking its credentials raised
    PermissionError, and every sandboxed command failed with a traceback. (Root enters any folder: for root, the
    stat of a path in it fails as it does for any other user.)"""
    closed = tmp_path / "closed"
    (closed / "home").mkdir(parents=True)
    closed.chmod(0)
    monkeypatch.setenv("HOME", str(closed / "home"))
    if os.geteuid() == 0:
        stat = Path.stat

        def refused(self: Path, *args: Any, **kwargs: Any) -> os.stat_result:
            if self.is_relative_to(closed) and self != closed:
                raise PermissionError(13, "Permission denied", str(self))
            return stat(self, *args, **kwargs)

        monkeypatch.setattr(Path, "stat", refused)
    try:
        said = _run("echo fine", workdir, Sandbox.of(Settings()))
        assert said.exit_code == 0 and "fine" in said.output, said.text()
    finally:
        closed.chmod(0o700)


def test_a_commands_environment_holds_no_secret_of_subqs(tmp_path: Path) -> None:
    """SUBQ_* and the provider keys were left out by their exact names: a setting given in lower case (the settings
    read names in any case), the trace exporter's headers and an MCP server's `${VAR}` token were passed on."""
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(
        '[profiles.p]\nmodel = "offline"\n[[profiles.p.mcp_servers]]\nname = "search"\nurl = "https://mcp.example.com/"\n'
        'headers = { Authorization = "${SEARCH_TOKEN}" }\n'
    )
    sandbox = Sandbox.of(load_settings(profiles_file=profiles))
    environ = {
        "PATH": "/usr/bin:/bin", "HOME": "/home/worker", "LANG": "C.UTF-8", "SEARCH_TOKEN": "Bearer s3cret",
        "subq_redis_url": "redis://:pw@redis:6379/0", "Openai_Api_Key": "sk-lower",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-honeycomb-team=KEY", "OTEL_SERVICE_NAME": "subq-worker",
    }  # fmt: skip
    assert commands.command_env(environ, sandbox.secrets) == {
        "PATH": "/usr/bin:/bin", "HOME": "/home/worker", "LANG": "C.UTF-8", "OTEL_SERVICE_NAME": "subq-worker",
    }  # fmt: skip
    said = asyncio.run(commands.run("env", RunCommand(cwd=tmp_path), environ, sandbox))
    assert "s3cret" not in said.output and "pw@" not in said.output and "KEY" not in said.output, said.text()


def test_a_program_the_command_wrote_in_its_folder_never_runs_on_the_host(workdir: Path) -> None:
    """With an empty entry in PATH (`::`, a leading `:`), the sandbox's network helper found `pasta` in the
    command's own folder, where the sandbox started, and ran what the model wrote there outside the sandbox."""
    marker = workdir.parent / "ran-on-the-host"
    planted = workdir / "pasta"
    planted.write_text(f'#!/bin/sh\ntouch {marker}\nexec /usr/bin/pasta "$@"\n')
    planted.chmod(0o755)
    environ = {"PATH": ":/usr/local/bin:/usr/bin:/bin"}
    ran = asyncio.run(commands.run("true", RunCommand(cwd=workdir, network=True), environ))
    assert ran.exit_code == 0, ran.text()
    assert not marker.exists(), "the planted program ran on the host"


def test_the_workers_environment_cannot_be_read(workdir: Path) -> None:
    # The worker's /proc/<pid>/environ holds its SUBQ_* settings; the sandbox has a /proc of its own.
    own = f"/proc/{os.getpid()}/environ"
    assert _run(f"cat {own}", workdir).exit_code != 0
    assert _run(f"cat {own}", workdir, sandbox=False).exit_code == 0
    assert _run("sh -c 'ls /proc | grep -c ^[0-9]'", workdir).output.strip() in ("1", "2", "3", "4")


UNIX_CONNECT = "python3 -c 'import socket,sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])' {path}"


def test_a_unix_redis_socket_is_hidden_whatever_the_network(release: tuple[Path, Path], workdir: Path) -> None:
    """A read-only mount does not stop connect(): a `unix://` Redis's socket was reachable with `network = false`."""
    real, _ = release  # outside /tmp: the sandbox's /tmp is its own, which would hide the socket anyway
    path = real / "redis.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()
        sandbox = Sandbox.of(Settings(redis_url=f"unix://{path}?db=0"))
        for network in (False, True):
            refused = _run(UNIX_CONNECT.format(path=path), workdir, sandbox, network=network)
            assert refused.exit_code != 0 and "ConnectionRefusedError" in refused.output, (network, refused.text())
        assert _run(UNIX_CONNECT.format(path=path), workdir, Sandbox.of(Settings())).text() == "exit 0\n", (
            "a socket subq does not know of stays reachable: the test's command connects"
        )


def test_the_sockets_that_lead_out_of_the_sandbox_are_hidden() -> None:
    """The container engines', the system bus and systemd's own (a worker run as root reaches them as root), and
    the login sessions' folders (the session bus, the user's systemd, rootless Docker and Podman)."""
    hidden = {str(path) for path in Sandbox.of(Settings()).hidden}
    assert {
        "/run/docker.sock", "/var/run/docker.sock", "/run/containerd/containerd.sock", "/run/podman/podman.sock",
        "/run/k3s/containerd/containerd.sock", "/run/crio/crio.sock", "/run/dbus/system_bus_socket",
        "/run/systemd/private", "/run/user",
    } <= hidden  # fmt: skip


@pytest.fixture
def listener() -> Iterator[tuple[int, list[object]]]:
    """A TCP listener on 127.0.0.1 that counts the connections it accepts."""
    with counting_listener("127.0.0.1") as counted:
        yield counted


CONNECT = "python3 -c 'import socket,sys; socket.create_connection((\"127.0.0.1\", int(sys.argv[1])), 5)' {port}"


def test_no_network_and_not_the_hosts_loopback_with_it(workdir: Path, listener: tuple[int, list[object]]) -> None:
    port, accepted = listener
    refused = _run(CONNECT.format(port=port), workdir)
    assert refused.exit_code != 0 and "ConnectionRefusedError" in refused.output
    # With the network it reaches public hosts (tests/test_sandbox_network.py), never the host's loopback.
    assert _run(CONNECT.format(port=port), workdir, network=True).exit_code != 0
    assert accepted == [], "the listener counted no connection"
    assert _run(CONNECT.format(port=port), workdir, sandbox=False).text() == "exit 0\n"
    # One, the unconfined: none of the two sandboxed ones came before it.
    assert connections_counted(accepted, 1) == 1, "the same command unconfined connects"


def test_cpu_time_and_memory_are_capped(workdir: Path) -> None:
    busy = _run("sh -c 'while :; do :; done'", workdir, cpu_time_s=1, timeout_s=60)
    assert busy.status in ("killed by SIGXCPU", "killed by SIGKILL"), busy.text()
    hog = "python3 -c 'b = bytearray(512 * 1024 * 1024); print(len(b))'"
    starved = _run(hog, workdir, memory_mb=128)
    assert starved.exit_code != 0 and "MemoryError" in starved.output
    assert _run(hog, workdir, memory_mb=2048).text() == "exit 0\n536870912\n"


# The process cap in a worker that is not root, as the image runs it (the kernel applies no
# RLIMIT_NPROC to root): the command runs from a process of the `nobody` user.
CAPPED = """
import asyncio, sys
from pathlib import Path
from coordinator import RunCommand
from workers.runtime import commands
config = RunCommand(cwd=Path(sys.argv[1]), max_processes=int(sys.argv[2]))
print(asyncio.run(commands.run(sys.argv[3], config)).text())
"""
NOBODY = 65534


def test_processes_are_capped() -> None:
    fork = "sh -c 'for i in $(seq 40); do sleep 1 & done; wait; echo all started'"
    workdir = Path(tempfile.mkdtemp(prefix="subq-nproc-"))  # in /tmp itself: pytest's folders are root's only
    workdir.chmod(0o777)
    as_nobody = (
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if os.geteuid() == 0 else []
    )

    def run(max_processes: int) -> str:
        argv = [*as_nobody, sys.executable, "-c", CAPPED, str(workdir), str(max_processes), fork]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        assert "Cannot fork" in run(10)
        assert run(200) == "exit 0\nall started\n\n"
    finally:
        shutil.rmtree(workdir)


def test_an_unavailable_sandbox_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.runtime import sandbox

    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="^bwrap is not installed$"):
        probe()


def test_a_worker_refuses_a_sandbox_it_cannot_start_unless_the_profile_opts_out(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine without bubblewrap: the workers' PATH holds only the virtual environment.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    builder = Profile(run_command=RunCommand(cwd=tmp_path))
    own = settings.model_copy(update={"profiles": {"builder": builder}})
    line = (
        "Invalid profile 'builder': run_command: its OS sandbox cannot start here (bwrap is not installed); "
        f"the worker needs {NEEDS}, or set sandbox = false"
    )
    assert_worker_refuses(own, tmp_path / "refused", line)
    opted_out = own.model_copy(
        update={
            "profiles": {"builder": builder.model_copy(update={"run_command": RunCommand(cwd=tmp_path, sandbox=False)})}
        }
    )
    listed = subq_tools(opted_out)
    assert listed.returncode == 0, listed.stderr
    assert (
        "subq: warning: profile 'builder' runs its commands without the OS sandbox (sandbox = false)" in listed.stderr
    )


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({"sandbox": "maybe"}, "run_command.sandbox"),
        ({"network": "sometimes"}, "run_command.network"),
        ({"memory_mb": 0}, "run_command.memory_mb"),
        ({"max_processes": 0}, "run_command.max_processes"),
        ({"cpu_time_s": -1}, "run_command.cpu_time_s"),
        ({"max_file_mb": 0}, "run_command.max_file_mb"),
        ({"writable": ["/srv"]}, "run_command.writable"),
    ],
)
def test_a_bad_sandbox_setting_names_its_field(tmp_path: Path, table: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(profiles={"builder": {"run_command": {"cwd": str(tmp_path), **table}}})
    assert f"SUBQ_PROFILES (builder.{error})" in str(caught.value)


def test_hidden_paths_must_be_absolute() -> None:
    with pytest.raises(ConfigError, match="^Invalid setting SUBQ_SANDBOX_HIDDEN_PATHS: every path must be absolute$"):
        load_settings(sandbox_hidden_paths="relative/secrets:/abs")
    assert load_settings(sandbox_hidden_paths="/a:/b").sandbox_hidden_paths == [Path("/a"), Path("/b")]


def test_a_workers_commands_run_confined_under_an_allow_everything_policy(
    settings: Settings, tmp_path: Path, listener: tuple[int, list[object]]
) -> None:
    """The acceptance run: a real worker, a profile that allows every command, and what the sandbox still stops."""
    port, accepted = listener
    work = tmp_path / "work"
    work.mkdir()
    secret = tmp_path / "profiles-secret.toml"  # as the worker's own settings file would be
    secret.write_text("api_key = 'sk-do-not-read'\n")
    outside = Path(tempfile.mkdtemp(prefix="subq-outside-", dir="/var/tmp"))
    anything = Profile(run_command=RunCommand(cwd=work), approval_tools=[])  # no rule, no decision: all runs
    own = settings.model_copy(
        update={"profiles": {**settings.profiles, "anything": anything}, "sandbox_hidden_paths": [secret]}
    )
    commands_run = [
        "sh -c 'echo made > inside.txt'",
        f"touch {outside / 'escaped'}",
        f"cat {secret}",
        CONNECT.format(port=port),
    ]
    steps = [call("run_command", command=command) for command in commands_run]
    try:
        with dedicated_fleet(own, tmp_path / "logs", 1, queue="subq-sandbox") as (coord, _fleet):
            task = coord.create_task(agent(*steps, reply("tried")), profile="anything", run=True)
            assert coord.wait(task.id, 90).status == TaskStatus.COMPLETED
            returns = [p["content"] for m in coord.messages(task.id, kind="api") for p in m["parts"]
                       if p.get("part_kind") == "tool-return"]  # fmt: skip
    finally:
        escaped = (outside / "escaped").exists()
        shutil.rmtree(outside)
    wrote, touched, read, connected = returns
    assert wrote == "exit 0\n" and (work / "inside.txt").read_text() == "made\n", "it writes in its cwd"
    assert touched.startswith("exit 1\n") and "Read-only file system" in touched and not escaped
    assert "sk-do-not-read" not in read, "the hidden file cannot be read"
    assert connected.startswith("exit 1\n") and "ConnectionRefusedError" in connected and accepted == []
