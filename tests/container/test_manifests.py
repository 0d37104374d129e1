"""``deploy/kubernetes/epd-trio.yml`` runs the image as the image expects, and stops it as
``epd-trio serve`` stops (main suite: nothing is built; ``test_image.py`` holds the image to the
same facts, ``tests/image_facts.py``).

Each object goes through the official ``kubernetes`` client's models (a misspelt field fails),
and the proxy's Deployment is checked fact by fact: the image's tag and entrypoint, its user,
its port and probes, the grace period against ``EPD_SHUTDOWN_GRACE``, the volume where the
image's temporary directory is, the workers ``--workers auto`` starts under the CPU limit, and
the Service the ServiceMonitor of ``epd-trio-observability.yml`` finds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from typing import Any

import kubernetes.client
import orjson
import pytest
import yaml

from epd_trio import settings_from
from epd_trio.__main__ import build_parser, serve_flags
from epd_trio._core.config import SETTING_DEFAULTS
from epd_trio._serve.cpu_quota import CpuLimit, workers_for
from epd_trio._serve.runner import WATCHDOG_MARGIN

from image_facts import MANIFESTS, ROOT, ImageFacts, containerfile_facts, cpu_quantity

GENERATOR = ROOT / "deploy" / "kubernetes" / "generate.py"
REQUIREMENTS = ROOT / "deploy" / "container" / "requirements.py"
#: How long after SIGTERM ``epd-trio serve`` has exited at the latest: the grace, then each
#: worker's watchdog (``WATCHDOG_MARGIN``), then the parent's kill 1 s later (``_serve/runner``).
EXIT_BOUND_PAST_GRACE = WATCHDOG_MARGIN + 1.0


def model(document: dict[str, Any]) -> Any:
    """The ``kubernetes`` client's model of ``document``; a field it does not know fails."""
    version = document["apiVersion"].rpartition("/")[2]
    name = version[:1].upper() + version[1:] + document["kind"]
    client = kubernetes.client.ApiClient()
    parsed = client.deserialize(orjson.dumps(document).decode(), name, "application/json")
    assert client.sanitize_for_serialization(parsed) == document, f"{name}: unknown fields"
    return parsed


def objects() -> dict[tuple[str, str], Any]:
    documents = [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d is not None]
    return {(d["kind"], d["metadata"]["name"]): model(d) for d in documents}


@pytest.fixture(scope="module")
def facts() -> ImageFacts:
    return containerfile_facts()


@pytest.fixture(scope="module")
def deployment() -> Any:
    return objects()["Deployment", "epd-trio"]


def proxy_container(deployment: Any) -> Any:
    (container,) = deployment.spec.template.spec.containers
    return container


def test_every_object_is_a_kubernetes_object_in_one_namespace() -> None:
    found = objects()
    assert set(found) == {("ServiceAccount", "epd-trio"), ("Role", "epd-trio-pod-reader"),
                          ("RoleBinding", "epd-trio-pod-reader"), ("Deployment", "epd-trio"),
                          ("Service", "epd-trio")}
    assert {o.metadata.namespace for o in found.values()} == {"serving"}


def test_the_deployment_runs_the_images_entrypoint_with_its_arguments(
    deployment: Any, facts: ImageFacts
) -> None:
    container = proxy_container(deployment)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container.image.rpartition(":")[2] == version
    assert container.image.rpartition(":")[0].endswith("/epd-trio")
    # No command: a command would replace the entrypoint, and tini with it (PID 1 would then
    # be the proxy, which ignores SIGTERM while it imports).
    assert container.command is None
    assert facts.command[:2] == ("epd-trio", "serve")
    args = build_parser().parse_args([*facts.command[1:], *container.args])
    assert (args.host, args.workers) == ("0.0.0.0", "auto")
    settings = settings_from({e.name: e.value for e in container.env}, flags=serve_flags(args))
    assert settings.service_discovery and settings.layout == "P+D"
    assert dict(settings.selectors()) == {"prefill": "app=vllm,role=prefill",
                                          "decode": "app=vllm,role=decode"}


def test_the_pod_runs_as_the_images_user(deployment: Any, facts: ImageFacts) -> None:
    pod = deployment.spec.template.spec.security_context
    assert facts.uid != 0 and facts.user == f"{facts.uid}:{facts.gid}"  # numeric: checkable
    assert pod.run_as_non_root is True
    assert (pod.run_as_user, pod.run_as_group) == (facts.uid, facts.gid)
    container = proxy_container(deployment).security_context
    assert container.allow_privilege_escalation is False
    assert container.capabilities.drop == ["ALL"]


def test_the_port_and_the_probes_are_the_images(deployment: Any, facts: ImageFacts) -> None:
    container = proxy_container(deployment)
    args = build_parser().parse_args([*facts.command[1:], *container.args])
    (port,) = container.ports
    assert port.container_port == facts.port == args.port
    assert container.readiness_probe.http_get.path == "/ready"
    assert container.liveness_probe.http_get.path == "/health"
    for probe in (container.readiness_probe, container.liveness_probe):
        assert probe.http_get.port == port.name


def test_the_grace_period_outlasts_the_drain(deployment: Any) -> None:
    """The kubelet's SIGKILL must come after ``epd-trio serve`` has exited on its own: after
    ``EPD_SHUTDOWN_GRACE`` and the watchdogs' margin."""
    env = {e.name: e.value for e in proxy_container(deployment).env}
    grace = settings_from({**env, "EPD_DECODE_URLS": "http://d:1"}).shutdown_grace
    # Set in the manifest, beside the period it needs (not left to the default).
    assert grace != SETTING_DEFAULTS["shutdown_grace"]
    period = deployment.spec.template.spec.termination_grace_period_seconds
    assert period > grace + EXIT_BOUND_PAST_GRACE, (
        f"terminationGracePeriodSeconds {period} must exceed EPD_SHUTDOWN_GRACE {grace:g} + "
        f"{EXIT_BOUND_PAST_GRACE:g} s")


def test_the_root_is_read_only_and_the_temporary_directory_a_volume(
    deployment: Any, facts: ImageFacts
) -> None:
    """The workers' metrics directory is made under the image's ``TMPDIR``: a writable volume
    must be mounted there when the root file system is read-only."""
    container = proxy_container(deployment)
    assert container.security_context.read_only_root_filesystem is True
    (mount,) = [m for m in container.volume_mounts if m.mount_path == facts.env["TMPDIR"]]
    assert not mount.read_only
    (volume,) = [v for v in deployment.spec.template.spec.volumes if v.name == mount.name]
    assert volume.empty_dir is not None


def test_workers_follow_the_cpu_limit_the_node_reserves(deployment: Any) -> None:
    resources = proxy_container(deployment).resources
    limit = cpu_quantity(resources.limits["cpu"])
    assert cpu_quantity(resources.requests["cpu"]) == limit
    assert workers_for(CpuLimit(limit, "limits.cpu"), cpus=64) == 2


def test_the_service_is_the_one_the_service_monitor_scrapes(deployment: Any) -> None:
    generator = load(GENERATOR, "generate")
    service = objects()["Service", "epd-trio"]
    key, value = generator.SERVICE_LABEL
    assert service.metadata.labels[key] == value
    pod_labels = deployment.spec.template.metadata.labels
    assert all(pod_labels.get(k) == v for k, v in service.spec.selector.items())
    assert deployment.spec.selector.match_labels == service.spec.selector
    (port,) = service.spec.ports
    (container_port,) = proxy_container(deployment).ports
    assert port.name == generator.PORT_NAME and port.target_port == container_port.name


def test_the_service_account_may_watch_the_pods() -> None:
    found = objects()
    role, binding = found["Role", "epd-trio-pod-reader"], found["RoleBinding", "epd-trio-pod-reader"]
    assert any(rule.api_groups == [""] and "pods" in rule.resources
               and {"get", "list", "watch"} <= set(rule.verbs) for rule in role.rules)
    assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", role.metadata.name)
    assert [(s.kind, s.name) for s in binding.subjects] == [("ServiceAccount", "epd-trio")]
    assert found["Deployment", "epd-trio"].spec.template.spec.service_account_name == "epd-trio"


def load(path: Any, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the image's dependency layer (deploy/container/requirements.py) -----------------------------

def test_the_image_installs_the_packages_own_dependencies_and_the_extras_named() -> None:
    requirements = load(REQUIREMENTS, "requirements")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirements.requirement_lines({"project": project}, []) == project["dependencies"]
    both = requirements.requirement_lines({"project": project},
                                          requirements.parse_extras(" otel, kubeconfig,"))
    extras = project["optional-dependencies"]
    assert both == [*project["dependencies"], *extras["otel"], *extras["kubeconfig"]]
    assert set(requirements.IMAGE_EXTRAS) <= set(extras)


def test_an_extra_the_image_does_not_take_fails_the_build() -> None:
    """pip only warns about an extra a package lacks: the build would give a smaller image
    than asked. The development extras (tests, plots) are not the image's either."""
    for extras in ("otle", "test"):
        done = subprocess.run([sys.executable, str(REQUIREMENTS), str(ROOT / "pyproject.toml"),
                               extras], capture_output=True, text=True, check=False)
        assert done.returncode == 2 and f"unknown extra {extras!r}" in done.stderr
    done = subprocess.run([sys.executable, str(REQUIREMENTS), str(ROOT / "pyproject.toml"),
                           "--build-system"], capture_output=True, text=True, check=True)
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert done.stdout.split("\n")[:-1] == build


# -- the constraints a build may pin its dependencies to (requirements.py --installed) ----------

def test_the_pins_follow_each_requirement_and_its_extras_through_what_is_installed() -> None:
    requirements = load(REQUIREMENTS, "requirements")
    installed = {
        "hypercorn": ("Hypercorn", "0.18.0", ["h11", 'trio; extra == "trio"',
                                              'uvloop; extra == "uvloop"']),
        "h11": ("h11", "0.16.0", []),
        "trio": ("trio", "0.35.0", ["sortedcontainers", 'exceptiongroup; python_version < "3.11"']),
        "sortedcontainers": ("sortedcontainers", "2.4.0", []),
        "quart-trio": ("quart-trio", "0.12.0", ["hypercorn[trio]>=0.12", "Quart>=0.19"]),
        "quart": ("Quart", "0.22.0", ["quart-trio; extra == 'never'", "Hypercorn"]),
        "a": ("a", "1", ["b"]), "b": ("b", "2", ["a"]),  # a cycle
    }
    pins = requirements.pins
    assert pins(["h11>=0.16"], installed) == ["h11==0.16.0"]
    # An extra's requirements only where the extra is asked for; markers are not evaluated,
    # a package not installed (uvloop, exceptiongroup) is skipped.
    assert pins(["hypercorn>=0.18"], installed) == ["Hypercorn==0.18.0", "h11==0.16.0"]
    assert pins(["hypercorn[trio]>=0.18,<0.19"], installed) == [
        "Hypercorn==0.18.0", "h11==0.16.0", "sortedcontainers==2.4.0", "trio==0.35.0"]
    # Met first without the extra, then with it (through quart-trio): the extra still counts.
    assert pins(["quart-trio>=0.12; python_version < '3.13'", "Quart_Trio"], installed) == [
        "Hypercorn==0.18.0", "Quart==0.22.0", "h11==0.16.0", "quart-trio==0.12.0",
        "sortedcontainers==2.4.0", "trio==0.35.0"]
    assert pins(["a"], installed) == ["a==1", "b==2"]
    assert pins(["nosuch>=1"], installed) == []
    assert requirements.parse_requirement("Quart_Trio [A, b] >=1 ; python_version<'3.13'") == (
        "quart-trio", {"a", "b"}, " python_version<'3.13'")


def test_the_test_venvs_pins_hold_every_dependency_within_pyproject() -> None:
    """What the image's suite builds with (``tests/containers.test_venv_pins``): a pin for each
    of the project's dependencies and the image's extras', at the version this venv has, which
    pyproject.toml allows; so the pins never ask pip for what the package refuses."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    done = subprocess.run([sys.executable, str(REQUIREMENTS), str(ROOT / "pyproject.toml"),
                           "otel,kubeconfig", "--installed"], capture_output=True, text=True,
                          check=True)
    pinned = {canonicalize_name(name): version
              for name, version in (line.split("==") for line in done.stdout.split())}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for line in [*project["dependencies"], *extras["otel"], *extras["kubeconfig"]]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # quart 0.23 on Python >= 3.13: not this venv's
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{line}: not pinned"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (line, pinned[name])
    assert all(metadata.version(name) == version for name, version in pinned.items())
    assert "pytest" not in pinned and "epd-trio" not in pinned  # the tests' own, and the proxy
