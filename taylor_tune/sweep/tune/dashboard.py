"""Where to watch a running sweep: the Ray dashboard, TensorBoard, Prometheus and Grafana.

The Ray dashboard's address comes from the running cluster (RAY_ADDRESS, or the local one `ray start`
made); the others are the defaults of `tensorboard`, `ray metrics launch-prometheus` and Grafana, or
what TENSORBOARD_URL / PROMETHEUS_URL / GRAFANA_URL say.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from urllib.parse import quote


def ray_dashboard_url() -> str | None:
    """The running cluster's dashboard URL, or None when no cluster can be reached."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address.startswith("http"):
        return address.rstrip("/")
    import ray

    try:
        context = ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError):
        return None
    try:
        url = context.dashboard_url
    finally:
        ray.shutdown()
    return f"http://{url}" if url and not url.startswith("http") else url or None


def dashboard_urls(path: str, ray_dashboard: str | None = None) -> dict[str, str]:
    name = Path(path.rstrip("/")).name
    tensorboard = os.environ.get("TENSORBOARD_URL", "http://127.0.0.1:6006")
    grafana = os.environ.get("GRAFANA_URL", "http://127.0.0.1:3000").rstrip("/")
    urls = {
        "ray dashboard": (ray_dashboard + "/#/jobs")
        if ray_dashboard
        else "no running Ray cluster found (ray start --head ...)",
        "tensorboard": f"{tensorboard}   "
        f"(start: tensorboard --logdir {shlex.quote(path)} --host 127.0.0.1 --port 6006)",
        "prometheus": os.environ.get("PROMETHEUS_URL", "http://127.0.0.1:9090")
        + "   (start: ray metrics launch-prometheus)",
        "grafana": f"{grafana}/d/taylor-tune-sweep/taylor-tune-sweep?var-experiment={quote(name)}",
    }
    return urls
