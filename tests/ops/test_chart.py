"""The Helm chart: lint, render with every CI values file, Kubernetes schemas, and what an SRE checks."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from service.config import Settings
from tests.ops.conftest import ROOT, tool
from tests.ops.helmchart import CHART, VALUES_FILES, by_kind, notes, one, render, values_of

KUBE_VERSION = "1.30.0"
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}  # CRDs: not in the Kubernetes schemas
SECRET_SETTINGS = {"database_url", "oauth_client_secret", "rate_limit_storage"}
# A value for each setting whose chart default is unset (null).
SAMPLES: dict[str, Any] = {
    "data_dir": "/var/lib/mcp-tasks", "public_url": "https://tasks.example.com/mcp", "auth": "oauth",
    "oauth_issuer": "https://id.example.com", "oauth_jwks_url": "https://id.example.com/jwks",
    "oauth_audience": "https://tasks.example.com/mcp", "oauth_introspection_url": "https://id.example.com/introspect",
    "oauth_client_id": "mcp-tasks", "default_ttl_ms": 600_000, "max_ttl_ms": 3_600_000, "metrics_port": 9100,
    "runner_tenant_share": "50%", "request_tenant_share": "50%",
    "audit_retention_days": 400, "upstreams_file": "/etc/mcp-tasks/upstreams.toml",
}  # fmt: skip
MINIMAL = values_of(CHART / "ci" / "minimal-values.yaml")
WORKERS = values_of(CHART / "ci" / "workers-values.yaml")
OPERATOR = values_of(CHART / "ci" / "operator-values.yaml")
EXISTING = values_of(CHART / "ci" / "existing-secret-values.yaml")
UPSTREAMS = values_of(CHART / "ci" / "upstreams-values.yaml")
INGRESS = values_of(CHART / "ci" / "ingress-values.yaml")


def _merged(base: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for dotted, value in overrides.items():
        node = out
        *path, last = dotted.split("__")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def _containers(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    pods = []
    for o in objects:
        if o["kind"] in ("Deployment", "Job"):
            spec = o["spec"]["template"]["spec"]
            pods.extend((spec, c) for c in spec["containers"])
    return pods


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_chart_passes_helm_lint_strict(values_file: Path) -> None:
    report = helm.lint(CHART, values_of(values_file), strict=True, namespace="tasks", kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == [], problems


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_rendered_manifests_are_valid_kubernetes_objects(values_file: Path) -> None:
    objects = render(values_of(values_file))
    assert {"Deployment", "Service", "ConfigMap", "Job"} <= {o["kind"] for o in objects}
    for o in objects:
        if o["kind"] in OPERATOR_KINDS:
            assert o["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(o, KUBE_VERSION, strict=True)


def test_default_values_refuse_to_render_without_a_database() -> None:
    with pytest.raises(helm.HelmError, match=r"secrets\.databaseUrl.*secrets\.existingSecret"):
        render({})


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (_merged(MINIMAL, secrets__databaseUrl=""), r"set secrets\.databaseUrl"),
        (_merged(MINIMAL, config__oauth_issuer=None), r"config\.host=0\.0\.0\.0.*set config\.oauth_issuer"),
        (_merged(MINIMAL, config__oauth_issuer=None, config__host="127.0.0.1"), r"serve\.replicas=1"),
        (_merged(MINIMAL, config__auth="none", config__host="127.0.0.1", serve__autoscaling__enabled=False), r"single-user"),
        (_merged(MINIMAL, config__auth="oauth", config__oauth_issuer=None), r"needs config\.oauth_issuer"),
        (_merged(MINIMAL, networkPolicy__enabled=True, config__metrics_port=None), r"set config\.metrics_port"),
    ],
    ids=["no-database", "auth-none-public-bind", "auth-none-replicas", "auth-none-explicit", "oauth-no-issuer", "netpol-no-metrics-port"],
)  # fmt: skip
def test_values_that_cannot_work_fail_at_template_time_saying_what_to_set(values: dict[str, Any], says: str) -> None:
    with pytest.raises(helm.HelmError, match=says):
        render(values)


def test_workers_with_no_slots_are_refused_by_the_schema() -> None:
    with pytest.raises(helm.HelmValuesError, match=r"/worker/runnerConcurrency"):
        render(_merged(WORKERS, worker__runnerConcurrency=0))


def test_a_misspelt_setting_is_refused_by_the_schema() -> None:
    with pytest.raises(helm.HelmValuesError, match=r"pool_sise"):
        render(_merged(MINIMAL, config__db_pool_sise=5))


def test_every_setting_is_reachable_and_the_rendered_env_names_are_the_settings_fields() -> None:
    """Chart and code cannot drift: a Settings field without a value (or a value without a field) fails."""
    fields = set(Settings.model_fields)
    chart_values = helm.Chart.load(CHART).values
    assert set(chart_values["config"]) | SECRET_SETTINGS == fields
    unset = {name for name, value in chart_values["config"].items() if value is None}
    # set each one: to the service's own default where it has one, else to a sample
    given = {n: SAMPLES.get(n, Settings.model_fields[n].default) for n in unset}
    assert None not in given.values(), f"give {[n for n, v in given.items() if v is None]} a value in SAMPLES"
    everything = _merged(
        MINIMAL,
        config={**chart_values["config"], **given},
        secrets__oauthClientSecret="s3cret",
        secrets__rateLimitStorage="redis://redis:6379/0",
    )
    objects = render(everything)
    configmap = one(objects, "ConfigMap", "rel-mcp-task-service")
    serve = one(objects, "Deployment", "rel-mcp-task-service")["spec"]["template"]["spec"]["containers"][0]
    env_names = set(configmap["data"]) | {e["name"] for e in serve["env"]}
    assert env_names == {f"MCP_TASKS_{name.upper()}" for name in fields}


def test_default_config_renders_the_services_own_defaults() -> None:
    """The ConfigMap of the minimal install, read back by Settings, equals Settings' defaults (but host and port)."""
    configmap = one(render(MINIMAL), "ConfigMap", "rel-mcp-task-service")
    env = {**configmap["data"], "MCP_TASKS_DATABASE_URL": MINIMAL["secrets"]["databaseUrl"]}
    from_chart = Settings(_env_file=None, **{k.removeprefix("MCP_TASKS_").lower(): v for k, v in env.items()})  # type: ignore[call-arg]
    defaults = Settings(
        _env_file=None,  # type: ignore[call-arg]
        database_url=MINIMAL["secrets"]["databaseUrl"], oauth_issuer=MINIMAL["config"]["oauth_issuer"],
        public_url=MINIMAL["config"]["public_url"], host="0.0.0.0", metrics_port=9100,
    )  # fmt: skip
    assert from_chart.model_dump(exclude={"data_dir"}) == defaults.model_dump(exclude={"data_dir"})


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_every_pod_runs_non_root_read_only_without_privileges(values_file: Path) -> None:
    for pod, container in _containers(render(values_of(values_file))):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["privileged"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert "memory" in container["resources"]["limits"]


def test_serve_probes_health_and_readiness_and_drains_before_it_is_killed() -> None:
    objects = render(MINIMAL)
    pod = one(objects, "Deployment", "rel-mcp-task-service")["spec"]["template"]["spec"]
    serve = pod["containers"][0]
    assert serve["args"] == ["serve"]
    assert serve["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert serve["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert serve["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # preStop sleep + uvicorn's 10 s graceful shutdown + closing the runners, with room to spare
    pre_stop = int(serve["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + 10 + 30
    assert {p["name"] for p in serve["ports"]} == {"http", "metrics"}
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {
        "topology.kubernetes.io/zone", "kubernetes.io/hostname",
    }  # fmt: skip
    assert by_kind(objects, "HorizontalPodAutoscaler")[0]["spec"]["scaleTargetRef"]["name"] == "rel-mcp-task-service"
    assert "replicas" not in one(objects, "Deployment", "rel-mcp-task-service")["spec"], "the HPA owns replicas"
    assert by_kind(objects, "PodDisruptionBudget")[0]["spec"]["maxUnavailable"] == 1


def test_workers_get_their_own_deployment_concurrency_and_probes_on_the_metrics_port() -> None:
    objects = render(WORKERS)
    worker = one(objects, "Deployment", "rel-mcp-task-service-worker")["spec"]["template"]["spec"]["containers"][0]
    assert worker["args"] == ["worker"]
    assert {"name": "MCP_TASKS_RUNNER_CONCURRENCY", "value": "64"} in worker["env"]
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    serve = one(objects, "Deployment", "rel-mcp-task-service")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "MCP_TASKS_RUNNER_CONCURRENCY", "value": "0"} in serve["env"]
    assert {h["metadata"]["name"] for h in by_kind(objects, "HorizontalPodAutoscaler")} == {
        "rel-mcp-task-service", "rel-mcp-task-service-worker",
    }  # fmt: skip


def test_migration_hook_runs_as_the_schema_owner_and_the_pods_as_the_app_role() -> None:
    objects = render(MINIMAL)
    job = one(objects, "Job", "rel-mcp-task-service-migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["migrate"]
    ref = next(e for e in container["env"] if e["name"] == "MCP_TASKS_DATABASE_URL")["valueFrom"]["secretKeyRef"]
    hook_secret = one(objects, "Secret", ref["name"])
    assert (
        hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"]
        < job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    assert hook_secret["stringData"][ref["key"]] == MINIMAL["secrets"]["migrationDatabaseUrl"]
    assert [e["name"] for e in container["env"]] == ["MCP_TASKS_DATABASE_URL"], "nothing unset rendered as ''"
    pod_secret = one(objects, "Secret", "rel-mcp-task-service")
    assert MINIMAL["secrets"]["migrationDatabaseUrl"] not in pod_secret["stringData"].values()
    assert pod_secret["stringData"]["database-url"] == MINIMAL["secrets"]["databaseUrl"]


def test_an_existing_secret_is_used_by_name_and_the_chart_creates_none() -> None:
    objects = render(EXISTING)
    assert by_kind(objects, "Secret") == []
    for _pod, container in _containers(objects):
        for e in container.get("env", []):
            if "valueFrom" in e:
                assert e["valueFrom"]["secretKeyRef"]["name"] == "mcp-tasks-credentials"
    job = one(objects, "Job", "rel-mcp-task-service-migrate")["spec"]["template"]["spec"]["containers"][0]
    assert job["env"][0]["valueFrom"]["secretKeyRef"]["key"] == "owner-database-url"
    assert job["image"].endswith("@" + EXISTING["image"]["digest"])


def test_network_policy_lets_metrics_in_only_from_the_monitoring_namespace() -> None:
    objects = render(OPERATOR)
    (policy,) = by_kind(objects, "NetworkPolicy")
    metrics_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "metrics")
    assert metrics_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    mcp_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "http")
    assert mcp_rule["from"] == OPERATOR["networkPolicy"]["mcpFrom"]


def test_prometheus_rule_carries_the_same_rules_promtool_tests(tmp_path: Path) -> None:
    objects = render(OPERATOR)
    (rule,) = by_kind(objects, "PrometheusRule")
    source = yaml.safe_load((ROOT / "grafana" / "alerts" / "mcp-tasks.rules.yaml").read_text())
    assert rule["spec"] == source
    rendered = tmp_path / "rendered.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([tool("promtool"), "check", "rules", str(rendered)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    metrics_service = one(objects, "Service", "rel-mcp-task-service-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()


def test_notes_warn_when_replicas_would_keep_rate_limits_apart() -> None:
    assert "redis://" in notes(MINIMAL)
    assert "WARNING" not in notes(WORKERS)


def test_chart_readme_describes_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    missing = [key for key in _leaf_keys(helm.Chart.load(CHART).values) if f"`{key}`" not in readme]
    assert missing == []


# Values the README describes as one (a Kubernetes object passed through as it is).
WHOLE_VALUES = {
    "serve.resources", "worker.resources", "migration.resources", "probes.startup", "probes.liveness",
    "probes.readiness", "podSecurityContext.seccompProfile", "securityContext.capabilities",
}  # fmt: skip


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in WHOLE_VALUES:
            keys.extend(_leaf_keys(value, path + "."))
        else:
            keys.append(path)
    return keys


def test_the_upstreams_file_and_its_secrets_reach_serve_and_workers(tmp_path: Path) -> None:
    """The file becomes a ConfigMap mounted where MCP_TASKS_UPSTREAMS_FILE points, in serve and in
    the workers; its secrets come from Secrets by name; and what the pods read loads (issue 41)."""
    from service.upstream.config import load

    objects = render(UPSTREAMS)
    toml = one(objects, "ConfigMap", "rel-mcp-task-service-upstreams")["data"]["upstreams.toml"]
    for name in ("rel-mcp-task-service", "rel-mcp-task-service-worker"):
        pod = one(objects, "Deployment", name)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        path = env["MCP_TASKS_UPSTREAMS_FILE"]["value"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts[str(Path(path).parent)]]["configMap"]["name"] == "rel-mcp-task-service-upstreams"
        assert volumes[mounts["/etc/mcp-tasks/secrets/crm-mcp-token"]]["secret"]["secretName"] == "crm-mcp-token"
        assert env["BILLING_CLIENT_SECRET"]["valueFrom"]["secretKeyRef"] == {
            "name": "billing-mcp",
            "key": "client-secret",
        }
    (tmp_path / "token").write_text("t")
    file = tmp_path / "upstreams.toml"
    file.write_text(toml.replace("/etc/mcp-tasks/secrets/crm-mcp-token/token", str(tmp_path / "token")))
    assert [u.name for u in load(file, environ={"BILLING_CLIENT_SECRET": "x"})] == ["crm", "billing"]
    with pytest.raises(helm.HelmError, match="not both"):
        render(_merged(UPSTREAMS, upstreams__existingConfigMap="mine"))


def test_the_ingress_example_limits_each_client_address_and_routes_to_the_mcp_service() -> None:
    """Issue 42 §6: a client that reopens every socket it is refused kept the connection cap full
    from one address; SECURITY.md leaves per-address limits to the proxy, and this is the chart's
    example of one that sets them (ingress-nginx), routed to the serve Service's http port."""
    ingress = one(render(INGRESS), "Ingress", "rel-mcp-task-service")
    notes_ = ingress["metadata"]["annotations"]
    assert int(notes_["nginx.ingress.kubernetes.io/limit-connections"]) > 0
    assert int(notes_["nginx.ingress.kubernetes.io/limit-rps"]) > 0
    assert notes_["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # SSE
    assert notes_["nginx.ingress.kubernetes.io/proxy-body-size"] == "1m"  # = MCP_TASKS_MAX_BODY_BYTES
    rule = ingress["spec"]["rules"][0]
    assert rule["host"] == "tasks.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rel-mcp-task-service", "port": {"name": "http"}}
    assert ingress["spec"]["tls"][0]["secretName"] == "tasks-example-com-tls"
    assert INGRESS["config"]["forwarded_allow_ips"]  # the proxy's address names the client
    assert not by_kind(render(MINIMAL), "Ingress")  # off unless asked for
    with pytest.raises(Exception, match=r"ingress\.host is required"):
        render(_merged(MINIMAL, ingress__enabled=True))


def test_tracing_values_reach_serve_and_workers_as_the_standard_otel_variables() -> None:
    """Issue 44: the chart turns tracing on with the SDK's own variables, in the ConfigMap both
    Deployments read; nothing of it without an endpoint."""
    traced = _merged(WORKERS, tracing={"endpoint": "http://otel-collector.monitoring:4318", "samplerArg": 0.01,
                                       "sampler": "parentbased_traceidratio", "serviceName": "tasks-prod"})  # fmt: skip
    objects = render(traced)
    data = one(objects, "ConfigMap", "rel-mcp-task-service")["data"]
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.monitoring:4318"
    assert (data["OTEL_TRACES_SAMPLER"], data["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.01")
    assert data["OTEL_SERVICE_NAME"] == "tasks-prod"
    for _pod, container in _containers([o for o in objects if o["kind"] == "Deployment"]):
        assert {"configMapRef": {"name": "rel-mcp-task-service"}} in container["envFrom"]
    assert not [k for k in one(render(WORKERS), "ConfigMap", "rel-mcp-task-service")["data"] if k.startswith("OTEL_")]
