"""docs/deploy/llm-d.yaml, the Kubernetes recipe of docs/deploy.md, checked without a cluster.

- Every object is valid against Kubernetes' own schemas (`kubernetes-validate`, strict:
  an unknown field is an error), for the oldest and newest releases it ships.
- Each role's vLLM arguments parse with vLLM's own server parser (in the vLLM venv) into
  a `KvpushConnector` config of that role, whose extra keys are all the connector's.
- The side channel: host from the pod's IP, one port everywhere it is named; the token
  file is a mounted Secret's key; the probes are `kvpush wait-ready` command lines that
  kvpush's own parser takes, watching that port, that token and vLLM's HTTP port.

Nothing here applies the manifests, starts a pod or a server: docs/deploy.md says so.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.vllm_venv import SRC, run_in_vllm_venv
from kvpush.cli import build_parser
from kvpush.errors import ConfigError
from kvpush.integrations.vllm.params import EXTRA_CONFIG_KEYS
from kvpush.procs.readiness import free_port
from kvpush_lab.vllm_servers import KVPUSH_MODULE, vllm_python

MANIFEST = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "llm-d.yaml"
# The oldest and newest Kubernetes releases whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
KV_TRANSFER_FLAG = "--kv-transfer-config="
POD_IP = "10.1.2.3"  # what the downward API would put in $VLLM_NIXL_SIDE_CHANNEL_HOST


def load() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc is not None]


def deployments() -> dict[str, dict[str, Any]]:
    """The manifest's Deployments by role."""
    out = {}
    for doc in load():
        if doc["kind"] == "Deployment":
            out[doc["metadata"]["labels"]["llm-d.ai/role"]] = doc
    return out


def vllm_container(deployment: dict[str, Any]) -> dict[str, Any]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "vllm"
    return container


def kv_transfer_config(container: dict[str, Any]) -> dict[str, Any]:
    [arg] = [a for a in container["args"] if a.startswith(KV_TRANSFER_FLAG)]
    config: dict[str, Any] = json.loads(arg.removeprefix(KV_TRANSFER_FLAG))
    return config


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def port_named(container: dict[str, Any], name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def test_the_manifest_holds_a_prefill_and_a_decode_pool() -> None:
    assert sorted(deployments()) == ["decode", "prefill"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    import kubernetes_validate

    for doc in load():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_reaches_the_containers() -> None:
    """A misspelt field in a container is refused: the check sees that deep."""
    import kubernetes_validate

    doc = copy.deepcopy(deployments()["prefill"])
    vllm_container(doc)["readinesProbe"] = vllm_container(doc)["readinessProbe"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_runs_kvpush_connector_with_keys_it_knows(role: str) -> None:
    config = kv_transfer_config(vllm_container(deployments()[role]))
    assert config["kv_connector"] == "KvpushConnector"
    assert config["kv_connector_module_path"] == KVPUSH_MODULE
    assert config["kv_role"] == ROLES[role]
    assert set(config["kv_connector_extra_config"]) <= EXTRA_CONFIG_KEYS


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_side_channel_is_the_pods_ip_at_one_port(role: str) -> None:
    container = vllm_container(deployments()[role])
    env = env_of(container)
    host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    port = kv_transfer_config(container)["kv_connector_extra_config"]["side_channel_port"]
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == port
    assert port_named(container, "kv-side-channel") == port


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_token_is_a_key_of_a_mounted_secret(role: str) -> None:
    deployment = deployments()[role]
    container = vllm_container(deployment)
    token_file = Path(kv_transfer_config(container)["kv_connector_extra_config"]["token_file"])
    [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == token_file.parent]
    assert mount["readOnly"] is True
    [volume] = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    # No `items`: every key of the Secret is a file named after it.
    assert volume["secret"] == {"secretName": "kvpush-token", "defaultMode": 0o400}
    assert token_file.name == "token"


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe"])
@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_probes_are_kvpush_wait_ready_on_this_pods_server(role: str, probe: str) -> None:
    container = vllm_container(deployments()[role])
    extra = kv_transfer_config(container)["kv_connector_extra_config"]
    shell, flag, line = container[probe]["exec"]["command"]
    assert (shell, flag) == ("sh", "-c")
    # The shell expands the pod's IP; the rest is kvpush's command line.
    argv = shlex.split(line.replace("$VLLM_NIXL_SIDE_CHANNEL_HOST", POD_IP))
    assert argv[:4] == ["exec", "python", "-m", "kvpush"]
    args = build_parser().parse_args(argv[4:])
    assert args.command == "wait-ready"
    assert args.pid == 1  # vLLM is the container's command (see the manifest)
    assert args.http == f"http://127.0.0.1:{port_named(container, 'http')}/health"
    assert args.side_channel == f"{POD_IP}:{extra['side_channel_port']}"
    assert args.token_file == extra["token_file"]
    # Each check's deadline ends before Kubernetes gives up on the probe.
    assert args.timeout < container[probe]["timeoutSeconds"]


@pytest.mark.vllm_venv
@pytest.mark.timeout(120)
def test_the_probe_runs_in_vllms_environment_and_says_what_is_not_ready(tmp_path: Path) -> None:
    """The probe's command line, run with the vLLM venv's Python (kvpush installed as in
    a vLLM image, without its own dependencies), where nothing listens: it exits 1
    naming the check that is not ready, within its deadline, rather than crash."""
    try:
        python = vllm_python()
    except ConfigError as exc:
        pytest.fail(f"cannot run in the vLLM venv: {exc}", pytrace=False)
    container = vllm_container(deployments()["prefill"])
    extra = kv_transfer_config(container)["kv_connector_extra_config"]
    _, _, line = container["readinessProbe"]["exec"]["command"]
    token = tmp_path / "token"
    token.write_text("probe-test-secret\n")
    # Only what would collide on a shared host changes: free ports, a local token file.
    http_port, side_port = free_port(), free_port()
    line = (
        line.replace("$VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        .replace(f":{port_named(container, 'http')}/", f":{http_port}/")
        .replace(f":{extra['side_channel_port']}", f":{side_port}")
        .replace(extra["token_file"], str(token))
    )
    argv = shlex.split(line)
    assert argv[:2] == ["exec", "python"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPUSH_TOKEN")}
    env["PYTHONPATH"] = str(SRC)
    run = subprocess.run(
        [str(python), *argv[2:]], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.startswith("NotReady: http: "), run.stderr[-3000:]
    assert "process 1 still running" in run.stderr


PARSE_AS_VLLM_DOES = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = {}
for role, args in json.loads(sys.argv[1]).items():
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    validate_parsed_serve_args(parsed)
    kv = parsed.kv_transfer_config
    out[role] = {
        "connector": kv.kv_connector,
        "module": kv.kv_connector_module_path,
        "role": kv.kv_role,
        "extra": kv.kv_connector_extra_config,
        "port": parsed.port,
    }
print(json.dumps(out))
"""


@pytest.mark.vllm_venv
@pytest.mark.timeout(300)
def test_vllms_own_parser_takes_each_roles_arguments() -> None:
    containers = {role: vllm_container(d) for role, d in deployments().items()}
    parsed = run_in_vllm_venv(
        PARSE_AS_VLLM_DOES, json.dumps({role: c["args"] for role, c in containers.items()})
    )
    for role, container in containers.items():
        config = kv_transfer_config(container)
        assert parsed[role] == {
            "connector": "KvpushConnector",
            "module": KVPUSH_MODULE,
            "role": ROLES[role],
            "extra": config["kv_connector_extra_config"],
            "port": port_named(container, "http"),
        }
