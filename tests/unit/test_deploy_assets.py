"""``deploy/`` describes the processes as they are: every file parses, every command is a real
module, every ``LOOPWIRE_*`` variable is a settings field with a valid value, every port and
probe matches the port the process serves on, and every metric a query names is one the
processes export (or one RabbitMQ's own exporter does, from the documented list below).

Docker is not needed: the assets are read, the settings classes and metric registries are the
real ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from contracts import topology
from tool_services.mcp.check import list_served
from tool_services.mcp.config import BridgeConfig, ServerConfig
from tool_services.mcp.settings import BridgeSettings
from tool_services.metrics import ToolServiceMetrics
from tool_services.runner import load_factory
from tool_services.settings import Settings as ToolSettings
from worker.profiles.agents import AgentProfiles
from worker.runtime.metrics import WorkerMetrics, build_info, package_version, sample_names
from worker.settings import Settings as WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE = f"loopwire:{package_version()}"

# Metrics of RabbitMQ's rabbitmq_prometheus plugin that the assets may use, with the family
# Prometheus must request from /metrics/detailed (None: the aggregated /metrics endpoint).
# https://www.rabbitmq.com/docs/prometheus
RABBITMQ_METRICS: Mapping[str, str | None] = {
    "rabbitmq_queue_messages": None,
    "rabbitmq_queue_messages_ready": None,
    "rabbitmq_queue_messages_unacked": None,
    "rabbitmq_detailed_queue_messages": "queue_coarse_metrics",
    "rabbitmq_detailed_queue_messages_ready": "queue_coarse_metrics",
    "rabbitmq_detailed_queue_messages_unacked": "queue_coarse_metrics",
    "rabbitmq_detailed_queue_consumers": "queue_consumer_count",
}
PROMETHEUS_OWN = frozenset({"up"})
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool"})
PROMQL_WORDS |= {"and", "or", "unless", "offset", "inf", "nan"}


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def exported_metrics() -> set[str]:
    worker, tools = CollectorRegistry(), CollectorRegistry()
    WorkerMetrics(worker)
    build_info(worker, component="worker", service="worker")
    ToolServiceMetrics(tools, tools=["search"])
    build_info(tools, component="tool_service", service="search")
    return {*sample_names(worker), *sample_names(tools)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels left out)."""
    label_values = re.fullmatch(
        r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*(\{.*\})?\s*,\s*\w+\)", expr
    )
    if label_values:
        return {label_values.group(1)}
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[match.end() :].lstrip().startswith("(") or match.group().lower() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana/dashboards/loopwire.json").read_text())


def dashboard_queries() -> list[str]:
    board = dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def settings_field(settings: type[BaseModel], env: str) -> bool:
    """Whether ``LOOPWIRE_A__B`` names the field ``a.b`` of ``settings``."""
    model: Any = settings
    parts = env.removeprefix("LOOPWIRE_").lower().split("__")
    for i, part in enumerate(parts):
        if part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
        if i < len(parts) - 1 and not (isinstance(model, type) and issubclass(model, BaseModel)):
            return False
    return True


def dockerfile_env() -> dict[str, str]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = [m for line in text.splitlines() if line.startswith("ENV ") for m in line[4:].split()]
    return dict(pair.split("=", 1) for pair in pairs)


def configure(
    command: list[str], env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch
) -> BaseSettings | None:
    """The settings a container with ``command`` and ``env`` (over the image's) would run with."""
    assert command[:2] == ["python", "-m"] and len(command) >= 3, command
    module = command[2]
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"no module {module}"
    if spec.submodule_search_locations is not None:
        assert importlib.util.find_spec(f"{module}.__main__") is not None, (
            f"{module} has no __main__"
        )
    settings_cls: type[BaseSettings] | None = (
        WorkerSettings
        if module == "worker"
        else BridgeSettings
        if module == "tool_services.mcp"
        else ToolSettings
        if module.startswith("tool_services.")
        else None
    )
    full = {**dockerfile_env(), **env}
    own = {k: v for k, v in env.items() if k.startswith("LOOPWIRE_")}
    if settings_cls is None:
        assert not own, f"{module} reads no LOOPWIRE_ settings: {own}"
        return None
    for name in own:
        assert settings_field(settings_cls, name), f"{name} is not a setting of {module}"
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("LOOPWIRE_")]:
            m.delenv(name)
        for name, value in full.items():
            m.setenv(name, value)
        return settings_cls()


def http_port(settings: BaseSettings) -> int:
    if isinstance(settings, WorkerSettings):
        return settings.http_port
    assert isinstance(settings, ToolSettings)
    return settings.tools.http_port


def interpolate(value: str) -> str:
    """A compose value with ``${VAR:-default}`` replaced by its default."""
    assert not re.search(r"\$\{[^}:]*\}", value), f"{value}: interpolation without a default"
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)


def seconds(duration: str | int) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return (
        float(duration)
        if isinstance(duration, int)
        else sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))
    )


async def tools_of(service: str) -> set[str]:
    if service == "mcp":  # its tools are those its MCP servers list: start them and ask
        config = BridgeConfig.load(DEPLOY / "mcp.json")
        servers = [_here(server) for server in config.servers]
        served, problems = await list_served(config.model_copy(update={"servers": servers}))
        assert not problems, problems
        return {name for names in served.values() for name in names}
    built = load_factory(service)()
    try:
        return set(built.tools)
    finally:
        await built.shutdown()


def _here(server: ServerConfig) -> ServerConfig:
    """The server, its ``python`` this interpreter (the image's ``python`` has the package)."""
    if server.stdio is None or server.stdio.command != "python":
        return server
    stdio = server.stdio.model_copy(update={"command": sys.executable})
    return server.model_copy(update={"stdio": stdio})


# -- metrics in queries --------------------------------------------------------------------------


def test_promql_names_are_read_from_expressions() -> None:
    assert metric_names(
        'histogram_quantile(0.95, sum by (le, tool) (rate(a_bucket{x=~"$y"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert metric_names("sum(rate(a_total[5m])) by (x) / on (x) group_left sum(b)") == {
        "a_total",
        "b",
    }
    assert metric_names("label_values(c_total, agent)") == {"c_total"}


def test_dashboard_queries_name_only_exported_metrics() -> None:
    exported = exported_metrics()
    used = set().union(*(metric_names(q) for q in dashboard_queries()))
    unknown = used - exported - set(RABBITMQ_METRICS) - PROMETHEUS_OWN
    assert not unknown, f"the dashboard queries metrics nothing exports: {sorted(unknown)}"
    required = {
        "loopwire_turns_finished_total",  # turns/s by outcome
        "loopwire_turn_duration_seconds_bucket",
        "loopwire_step_duration_seconds_bucket",
        "gen_ai_client_operation_duration_seconds_bucket",
        "gen_ai_client_token_usage_sum",
        "loopwire_tool_call_duration_seconds_bucket",
        "loopwire_empty_streak_hints_total",
        "loopwire_iteration_caps_total",
        "loopwire_steps_in_progress",  # in-flight
        "rabbitmq_detailed_queue_messages",  # dead-letter depth
    }
    assert required <= used
    assert any("loopwire.turns.dead" in q for q in dashboard_queries())


def test_dashboard_is_provisioned_against_the_provisioned_datasource() -> None:
    board = dashboard()
    (source,) = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"]
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == source["uid"]
    (provider,) = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/loopwire.yaml").read_text()
    )["providers"]
    grafana = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1)[::-1] for v in grafana["volumes"])
    assert (DEPLOY / mounts[provider["options"]["path"]] / "loopwire.json").is_file()


# -- compose, Prometheus, Dockerfile -------------------------------------------------------------


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())[
        "services"
    ]
    return services


def loopwire_services() -> Iterator[tuple[str, dict[str, Any]]]:
    return ((n, s) for n, s in compose_services().items() if s.get("image") == IMAGE)


def test_compose_runs_real_modules_with_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose_services()
    modules = {name: s["command"][2] for name, s in loopwire_services()}
    assert sorted(modules.values()) == sorted(
        [
            "worker",
            "worker",
            "worker.testing.scripted_model",
            *(f"tool_services.{n}" for n in ("search", "calculator", "notes", "mcp")),
        ]
    )
    for name, service in loopwire_services():
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        env = {k: interpolate(str(v)) for k, v in service.get("environment", {}).items()}
        settings = configure(service["command"], env, monkeypatch)
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), f"{name}: {volume}"
        for dependency, condition in service.get("depends_on", {}).items():
            assert (
                condition["condition"] == "service_healthy"
                and "healthcheck" in services[dependency]
            )
        if settings is None:
            continue
        probe = " ".join(service["healthcheck"]["test"])
        assert f"127.0.0.1:{http_port(settings)}/readyz" in probe, name
        if isinstance(settings, WorkerSettings):
            assert (
                seconds(service["stop_grace_period"]) > settings.grace_s + settings.model.timeout_s
            )
            assert settings.agents_file is not None and any(
                v.endswith(f":{settings.agents_file}:ro") for v in service["volumes"]
            )
        else:
            assert isinstance(settings, ToolSettings)
            assert seconds(service["stop_grace_period"]) > settings.tools.grace_s
    for image in (s["image"] for s in services.values() if s.get("image") != IMAGE):
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    assert "rabbitmq_prometheus" in (DEPLOY / "rabbitmq/enabled_plugins").read_text()
    assert "healthcheck" in services["rabbitmq"] and "healthcheck" in services["redis"]


async def test_agent_profiles_name_tools_the_example_services_serve() -> None:
    served = set().union(*[await tools_of(n) for n in ("search", "calculator", "notes")])
    for agent in AgentProfiles.load(DEPLOY / "agents.json").agents:
        assert set(agent.tools) <= served | {"*"}, agent.name


def test_prometheus_scrapes_every_process_on_its_port(monkeypatch: pytest.MonkeyPatch) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    services = compose_services()
    targets = {
        t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    for name, service in loopwire_services():
        env = {k: interpolate(str(v)) for k, v in service.get("environment", {}).items()}
        settings = configure(service["command"], env, monkeypatch)
        if settings is not None:
            assert f"{name}:{http_port(settings)}" in targets, name
    for target in targets:
        assert target.split(":")[0] in services
    assert "rabbitmq:15692" in targets and "15692:15692" in services["rabbitmq"]["ports"]
    families = {
        f for job in config["scrape_configs"] for f in job.get("params", {}).get("family", [])
    }
    used = set().union(*(metric_names(q) for q in dashboard_queries()))
    for metric in used & set(RABBITMQ_METRICS):
        assert RABBITMQ_METRICS[metric] is None or RABBITMQ_METRICS[metric] in families, metric


def test_dockerfile_builds_one_non_root_image(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [
        line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line and line[0] != "#"
    ]
    assert "FROM python:3.11-slim" in lines
    (cmd,) = [line for line in lines if line.startswith(("CMD", "ENTRYPOINT"))]
    command = json.loads(cmd.split(" ", 1)[1])  # exec form: JSON array, python gets SIGTERM
    settings = configure(command, {}, monkeypatch)
    assert isinstance(settings, WorkerSettings)
    tool_settings = configure(["python", "-m", "tool_services.search"], {}, monkeypatch)
    assert tool_settings is not None
    (expose,) = [line for line in lines if line.startswith("EXPOSE")]
    assert set(expose.split()[1:]) == {str(settings.http_port), str(http_port(tool_settings))}
    for name in dockerfile_env():
        if name.startswith("LOOPWIRE_"):
            assert settings_field(WorkerSettings, name) or settings_field(ToolSettings, name), name
    (user,) = [line for line in lines if line.startswith("USER")]
    assert user.split()[1].split(":")[0] not in {"0", "root"}
    for line in lines:
        if line.startswith("COPY"):
            assert all((ROOT / src).exists() for src in line.split()[1:-1])


# -- Kubernetes ----------------------------------------------------------------------------------


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    return [doc for f in kustomization["resources"] for doc in load_yaml_docs(DEPLOY / "k8s" / f)]


def container_env(
    pod: dict[str, Any], container: dict[str, Any], secrets: Mapping[str, Mapping[str, str]]
) -> dict[str, str]:
    """The container's environment, a ``LOOPWIRE_*_FILE`` that points into a mounted Secret
    read as the process reads it (the setting's value is the Secret's key)."""
    volumes = {
        v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v
    }
    mounts = {
        m["mountPath"]: secrets[volumes[m["name"]]]
        for m in container["volumeMounts"]
        if m["name"] in volumes
    }
    env = {}
    for var in container.get("env", []):
        name, value = var["name"], var["value"]
        folder, _, key = value.rpartition("/")
        if name.endswith("_FILE") and folder in mounts:
            env[name.removesuffix("_FILE")] = mounts[folder][key]
        else:
            env[name] = value
    return env


async def test_kubernetes_manifests_match_the_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = manifests()
    secrets = {
        doc["metadata"]["name"]: doc["stringData"]
        for doc in load_yaml_docs(DEPLOY / "k8s/secret.example.yaml")
    }
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    deployments = by_kind["Deployment"]
    configmap = by_kind["ConfigMap"]["loopwire-agents"]
    mcp = json.loads(by_kind["ConfigMap"]["loopwire-mcp"]["data"]["mcp.json"])
    assert BridgeConfig.model_validate(mcp) == BridgeConfig.load(DEPLOY / "mcp.json")
    agents = AgentProfiles.model_validate(json.loads(configmap["data"]["agents.json"]))
    assert agents == AgentProfiles.load(DEPLOY / "agents.json")
    queues: dict[str, tuple[set[str], int]] = {}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        assert (
            deployment["spec"]["selector"]["matchLabels"].items()
            <= pod["metadata"]["labels"].items()
        )
        (container,) = pod["spec"]["containers"]
        assert container["image"] == IMAGE
        env = container_env(pod, container, secrets)
        assert not any("valueFrom" in var for var in container.get("env", []))  # files only
        role = "loopwire-worker" if name == "loopwire-worker" else "loopwire-tools"
        assert (
            f"//{role}:" in env["LOOPWIRE_AMQP_URLS"] and f"//{role}:" in env["LOOPWIRE_REDIS_URL"]
        )
        settings = configure(container["command"], env, monkeypatch)
        assert settings is not None
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = http_port(settings)
        probes = {
            k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")
        }
        assert {k: (p["path"], ports[p["port"]]) for k, p in probes.items()} == {
            "startupProbe": ("/livez", port),
            "livenessProbe": ("/livez", port),
            "readinessProbe": ("/readyz", port),
        }
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        if isinstance(settings, WorkerSettings):
            assert grace > settings.grace_s + settings.model.timeout_s
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert settings.agents_file is not None and str(settings.agents_file.parent) in mounts
            queues[name] = ({"loopwire.turns"}, settings.prefetch)
        else:
            assert isinstance(settings, ToolSettings)
            assert grace > settings.tools.grace_s
            tools = await tools_of(container["command"][2].split(".", 1)[1])
            queues[name] = ({f"loopwire.tool.{t}" for t in tools}, settings.tools.concurrency)
    budgets = by_kind["PodDisruptionBudget"].values()
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"].items()
        assert any(
            selector <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in deployments.values()
        )
    scaled = by_kind["ScaledObject"]
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == set(deployments)
    for obj in scaled.values():
        target = obj["spec"]["scaleTargetRef"]["name"]
        expected_queues, per_replica = queues[target]
        assert obj["spec"]["minReplicaCount"] >= 1
        triggers = obj["spec"]["triggers"]
        named = {t["metadata"]["queueName"] for t in triggers if "useRegex" not in t["metadata"]}
        patterns = [
            re.compile(t["metadata"]["queueName"])
            for t in triggers
            if t["metadata"].get("useRegex") == "true"
        ]
        if patterns:  # the workers': loopwire.turns and every tenant's intake, summed
            (pattern,) = patterns
            assert triggers[0]["metadata"]["operation"] == "sum"
            work = [*expected_queues, topology.intake_queue("acme")]
            assert all(pattern.fullmatch(q) for q in work)
            others = [topology.DEAD_LETTER_QUEUE, topology.RETRY_QUEUE, topology.wait_queue(16)]
            assert not any(pattern.fullmatch(q) for q in others)
        else:
            assert named == expected_queues
        for trigger in triggers:
            meta = trigger["metadata"]
            assert trigger["type"] == "rabbitmq" and meta["mode"] == "QueueLength"
            assert meta["protocol"] == "http"  # the management API counts ready + unacked
            assert int(meta["value"]) == per_replica
            auth = by_kind["TriggerAuthentication"][trigger["authenticationRef"]["name"]]
            for ref in auth["spec"]["secretTargetRef"]:
                assert ref["key"] in secrets[ref["name"]]
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {
        "kustomization.yaml",
        "secret.example.yaml",
    }
    assert files == set(
        yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())["resources"]
    )


def test_kedas_broker_user_is_shipped_and_may_read_queue_lengths_only() -> None:
    """The user KEDA's Secret names exists in the broker's definitions, with the tag the
    management API asks of a user that reads a queue's length in its vhost (``management``),
    and no AMQP rights beyond logging in to that vhost."""
    definitions = json.loads((DEPLOY / "rabbitmq/definitions.json").read_text())
    (secret,) = (
        doc["stringData"]
        for doc in load_yaml_docs(DEPLOY / "k8s/secret.example.yaml")
        if doc["metadata"]["name"] == "loopwire-keda"
    )
    url = secret["rabbitmq-management-url"]
    user = url.split("//", 1)[1].split(":", 1)[0]
    (shipped,) = (u for u in definitions["users"] if u["name"] == user)
    assert shipped["tags"] == ["management"]
    (grant,) = (g for g in definitions["permissions"] if g["user"] == user)
    assert (grant["configure"], grant["write"], grant["read"]) == ("^$", "^$", "^$")
    vhosts = {
        trigger["metadata"]["vhostName"]
        for doc in manifests()
        if doc["kind"] == "ScaledObject"
        for trigger in doc["spec"]["triggers"]
    }
    assert vhosts == {grant["vhost"]}


def test_compose_reads_the_variables_every_process_reads() -> None:
    """A value compose takes from the caller's environment has the setting's own name
    (LOOPWIRE_MODEL__BASE_URL), not one only compose knows (LOOPWIRE_MODEL_BASE_URL)."""
    text = (DEPLOY / "compose.yaml").read_text()
    taken = re.findall(r"^\s*(LOOPWIRE_\w+):\s*\$\{(LOOPWIRE_\w+)", text, flags=re.MULTILINE)
    assert taken, "compose passes the model's settings through"
    assert [(key, key) for key, _ in taken] == taken
    assert not re.findall(r"LOOPWIRE_MODEL_(?!_)\w+", text)
