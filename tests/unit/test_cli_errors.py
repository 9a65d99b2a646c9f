"""What the ``loopwire`` command says when something is wrong: one line on stderr naming the
argument or the setting, a documented exit code (worker.cli.exits), never a traceback. None of
these needs a broker: each is refused before anything is sent, or names what it cannot reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNREACHABLE_AMQP = "amqp://guest:guest@127.0.0.1:1/"


def run(
    *args: str, env: dict[str, str] | None = None, module: str = "worker.cli"
) -> subprocess.CompletedProcess[str]:
    """The command with no LOOPWIRE_ variable but ``env``'s (by default an unreachable
    broker: nothing here may reach one)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWIRE_")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**base, **(env if env is not None else {"LOOPWIRE_AMQP_URL": UNREACHABLE_AMQP})},
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("turn", "hi", "--session", "bad id!"), "error: --session 'bad id!': must start with"),
        (("turn", "hi", "--agent", "no/such"), "error: --agent 'no/such': must start with"),
        (("turn", "hi", "--max-iterations", "0"), "error: --max-iterations 0: input should be"),
        (("session", "show", "bad id!"), "error: SESSION_ID 'bad id!': must start with"),
        (("result", "bad id!"), "error: TURN_ID 'bad id!': must start with"),
        (("cancel", "bad id!"), "error: TURN_ID 'bad id!': must start with"),
        (("approve", "bad id!", "c1"), "error: TURN_ID 'bad id!': must start with"),
        (("session", "delete", "s1"), "error: this deletes session s1 for good: add --yes"),
    ],
)
def test_a_bad_argument_is_named_with_exit_2(args: tuple[str, ...], expected: str) -> None:
    out = run(*args)
    assert out.returncode == 2
    assert one_line(out).startswith(expected)


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_amqp_url_that_is_no_url_is_refused_before_or_after_the_command(where: str) -> None:
    args = ["--amqp-url", "notaurl"]
    out = run(*args, "turn", "hi") if where == "before" else run("turn", "hi", *args)
    assert out.returncode == 2
    assert one_line(out) == (
        "error: --amqp-url: not an AMQP URL: give amqp://user:password@host:5672/vhost (or amqps://)"
    )


@pytest.mark.parametrize(
    "command", [("worker",), ("tools", "serve", "calculator"), ("demo",), ("gateway", "serve")]
)
@pytest.mark.parametrize("option", ["--amqp-url", "--redis-url"])
def test_a_started_process_names_the_option_it_cannot_use(
    command: tuple[str, ...], option: str
) -> None:
    out = run(*command, option, "notaurl")
    assert out.returncode == 2
    assert one_line(out).startswith(f"error: {option}: not a")


def test_the_gateway_uses_the_redis_given_on_the_command_line(tmp_path: Path) -> None:
    keys, agents = tmp_path / "keys.json", tmp_path / "agents.json"
    keys.write_text(json.dumps({"keys": [{"name": "ops", "sha256": "0" * 64}]}))
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    out = run(
        "gateway", "serve", "--keys-file", str(keys), "--agents-file", str(agents),
        "--redis-url", "redis://127.0.0.1:1/0",
    )  # fmt: skip
    assert out.returncode == 1
    assert "127.0.0.1:1" in one_line(out)


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("command", [("turn", "hi"), ("approvals",), ("tail",), ("dlq", "list")])
def test_a_tenant_that_is_no_tenant_name_is_refused_before_or_after_the_command(
    where: str, command: tuple[str, ...]
) -> None:
    option = ["--tenant", "acme.eu"]
    out = run(*option, *command) if where == "before" else run(*command, *option)
    assert out.returncode == 2
    assert one_line(out).startswith("error: --tenant 'acme.eu': must start with a letter or digit")


def test_a_tenant_setting_that_is_no_tenant_name_is_named_not_shown(tmp_path: Path) -> None:
    env = {"LOOPWIRE_AMQP_URL": UNREACHABLE_AMQP, "LOOPWIRE_TENANT": "acme/eu"}
    out = run("session", "show", "s1", env=env)
    assert out.returncode == 2
    assert one_line(out) == (
        "error: LOOPWIRE_TENANT: must start with a letter or digit and hold only letters, "
        "digits, '-' and '_' (at most 128)"
    )
    named = tmp_path / "tenant"
    named.write_text("acme\n")
    env = {"LOOPWIRE_AMQP_URL": UNREACHABLE_AMQP, "LOOPWIRE_TENANT_FILE": str(named)}
    out = run("result", "t1", env=env)  # read from the file, then the broker is the problem
    assert out.returncode == 1
    assert one_line(out).startswith("error: cannot reach RabbitMQ at 127.0.0.1:1/ (")


@pytest.mark.parametrize(
    "args", [("worker",), ("agents", "list", "deploy/agents.json"), ("schema", "--out", "-")]
)
def test_a_tenant_is_refused_by_the_commands_that_act_for_none(args: tuple[str, ...]) -> None:
    out = run(*args, "--tenant", "acme")
    assert out.returncode == 2
    assert one_line(out) == f"error: --tenant: 'loopwire {args[0]}' acts for no tenant"


def test_an_unreachable_broker_is_named_once() -> None:
    out = run("dlq", "list")
    assert out.returncode == 1
    line = one_line(out)
    assert line.startswith("error: cannot reach RabbitMQ at 127.0.0.1:1/ (")
    assert line.count("cannot reach") == 1
    assert "guest" not in line


def test_approvals_with_redis_down_is_one_line_naming_it() -> None:
    out = run("approvals", "--redis-url", "redis://:secret@127.0.0.1:1/0")
    assert out.returncode == 1
    line = one_line(out)
    assert line.startswith("error: cannot reach Redis at 127.0.0.1:1: ")
    assert line.count("cannot reach") == 1 and "secret" not in line


def test_the_cli_reads_the_url_files_and_refuses_one_it_cannot_read(tmp_path: Path) -> None:
    missing = tmp_path / "amqp-url"
    out = run("turn", "hi", env={"LOOPWIRE_AMQP_URL_FILE": str(missing)})
    assert out.returncode == 2
    assert one_line(out) == (
        f"error: LOOPWIRE_AMQP_URL_FILE: cannot read {missing}: No such file or directory"
    )
    # a file it can read names the broker: not the default one (which is running here)
    secret = tmp_path / "url"
    secret.write_text("amqp://someone:pw@127.0.0.1:2/\n")
    out = run("dlq", "list", env={"LOOPWIRE_AMQP_URL_FILE": str(secret)})
    assert out.returncode == 1
    assert one_line(out).startswith("error: cannot reach RabbitMQ at 127.0.0.1:2/ (")
    both = {"LOOPWIRE_AMQP_URL_FILE": str(secret), "LOOPWIRE_AMQP_URL": UNREACHABLE_AMQP}
    out = run("dlq", "list", env=both)
    assert out.returncode == 2
    assert one_line(out) == "error: give LOOPWIRE_AMQP_URL or LOOPWIRE_AMQP_URL_FILE, not both"


def test_a_redis_url_file_is_read_by_the_commands_that_read_redis(tmp_path: Path) -> None:
    secret = tmp_path / "url"
    secret.write_text("redis://:pw@127.0.0.1:3/0\n")
    out = run("approvals", env={"LOOPWIRE_REDIS_URL_FILE": str(secret)})
    assert out.returncode == 1
    assert one_line(out).startswith("error: cannot reach Redis at 127.0.0.1:3: ")


@pytest.mark.parametrize("module", ["worker", "tool_services"])
def test_a_process_names_the_variable_it_cannot_use(module: str) -> None:
    args = ("calculator",) if module == "tool_services" else ()
    env = {"LOOPWIRE_PREFETCH": "abc", "LOOPWIRE_TOOLS__CONCURRENCY": "abc"}
    out = run(*args, env=env, module=module)
    assert out.returncode == 2
    variable = "LOOPWIRE_TOOLS__CONCURRENCY" if module == "tool_services" else "LOOPWIRE_PREFETCH"
    assert (
        one_line(out)
        == f"error: {variable}: input should be a valid integer, unable to parse string as an integer"
    )


def test_the_worker_names_an_unreadable_url_file(tmp_path: Path) -> None:
    out = run(env={"LOOPWIRE_REDIS_URL_FILE": str(tmp_path / "nope")}, module="worker")
    assert out.returncode == 2
    assert one_line(out).startswith("error: LOOPWIRE_REDIS_URL_FILE: cannot read ")


@pytest.mark.parametrize(
    "args", [("agents", "list", "deploy/agents.json", "--json"), ("schema", "--out", "-")]
)
def test_output_cut_short_by_a_closed_pipe_is_quiet(args: tuple[str, ...]) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader goes before the first line, as `| head -0` does
        code = proc.wait(60)
        assert proc.stderr.read() == ""
    assert code == 141


def test_a_misspelt_setting_hides_no_other_problem_of_its_agent_or_workflow(
    tmp_path: Path,
) -> None:
    path = tmp_path / "agents.json"
    agent = {"name": "a", "colour": "red", "provider": "ghost", "agents": [{"agent": "nobody"}]}
    flow = {"name": "w", "kind": "sequential", "colour": 1, "nodes": [{"run": "gone"}]}
    calls_a = {"name": "b", "agents": [{"agent": "a"}]}
    path.write_text(json.dumps({"agents": [agent, calls_a], "workflows": [flow]}))
    out = run("agents", "check", str(path))
    assert out.returncode == 2
    problems = [line.strip() for line in out.stderr.splitlines()[1:]]
    assert problems == [
        "- agent 'a': colour: unknown setting (a misspelling?)",
        "- workflow 'w': colour: unknown setting (a misspelling?)",
        "- agent 'a' calls 'nobody', which is not defined",
        "- workflow 'w': node 'gone' runs 'gone', which is neither an agent nor a workflow",
        "- agent 'a' names provider 'ghost', which is not configured (configured: default)",
    ]


def test_agents_check_lists_every_problem_of_a_file_in_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "agents.json"
    path.write_text(
        json.dumps(
            {
                "agents": [
                    {"name": "a", "provider": "ghost", "agents": [{"agent": "nobody"}]},
                    {"name": "b", "hooks": ["nowhere.at_all:Hook"]},
                    {"name": "b"},
                    {"name": "c", "max_tool_iterations": 3},
                ]
            }
        )
    )
    out = run("agents", "check", str(path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "pydantic" not in out.stderr
    problems = [line.strip() for line in out.stderr.splitlines()[1:]]
    assert problems == [
        "- agent 'c': max_tool_iterations: unknown setting (a misspelling?)",
        "- 2 agents are named 'b'; names must be unique",
        "- agent 'a' calls 'nobody', which is not defined",
        "- agent 'a' names provider 'ghost', which is not configured (configured: default)",
        "- agent 'b', hook set 'nowhere.at_all:Hook': cannot import 'nowhere.at_all': "
        "No module named 'nowhere'",
    ]
