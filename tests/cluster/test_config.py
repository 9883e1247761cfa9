"""Cluster configs: shipped YAMLs load, unknown keys and impossible placements fail naming them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loopserve.cluster.config import ClusterConfig, ConfigError, load_cluster_config
from loopserve.cluster.placement import PlacementError, check_fit, plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_cpu_1p1d_is_the_embedded_default():
    assert load_cluster_config(CONFIGS / "cpu-1p1d.yaml") == ClusterConfig() == load_cluster_config()


@pytest.mark.parametrize("name, roles", [
    ("cpu-1p1d.yaml", {"prefill-0", "decode-0"}),
    ("cpu-2p2d.yaml", {"prefill-0", "prefill-1", "decode-0", "decode-1"}),
    ("colocated.yaml", {"colocated-0"}),
    ("h200-1p1d.yaml", {"prefill-0", "decode-0"}),
])
def test_shipped_configs_plan(name, roles):
    specs = plan(load_cluster_config(CONFIGS / name))
    assert {s.worker_id for s in specs} == roles
    assert {s.engine["model"] for s in specs} and all("role" not in s.engine["scheduler"] for s in specs)


def test_h200_shares_one_gpu_between_roles():
    specs = plan(load_cluster_config(CONFIGS / "h200-1p1d.yaml"))
    assert sum(s.num_gpus for s in specs) == 1.0
    assert all(s.engine["device"] == "cuda" and "UCX_TLS" not in s.env for s in specs)
    check_fit(specs, [{"GPU": 1.0}], resources=("GPU",))


@pytest.mark.parametrize("data, needle", [
    ({"prefil": {}}, "prefil: unknown key"),
    ({"prefill": {"num_gpu": 1}}, "prefill.num_gpu: unknown key"),
    ({"engine": {"blok_size": 4}}, "engine.blok_size: unknown key"),
    ({"decode": {"engine": {"num_blokcs": 3}}}, "decode.engine: num_blokcs: unknown key"),
    ({"decode": {"engine": {"block_size": 0}}}, "decode.engine: block_size"),
    ({"engine": {"role": "prefill"}}, "engine.role"),
    ({"prefill": {"num_workers": 0}}, "prefill.num_workers must be >= 1"),
    ({"mode": "pdd"}, "mode"),
    ({"transfer": {"heartbeat_s": 5, "lease_s": 2}}, "transfer.heartbeat_s"),
])
def test_bad_config_names_the_key(data, needle):
    with pytest.raises(ConfigError) as e:
        load_cluster_config(data)
    assert needle in str(e.value)


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: pd\nsever: {port: 1}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: sever: unknown key"):
        load_cluster_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster_config(tmp_path / "missing.yaml")


def test_check_fit_names_the_group_and_resource():
    specs = plan(load_cluster_config({"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}}))
    with pytest.raises(PlacementError, match=r"placement needs 2 GPU .*prefill: 1 x 1.*decode: 1 x 1.* has 1"):
        check_fit(specs, [{"CPU": 8, "GPU": 1}])
    with pytest.raises(PlacementError, match=r"prefill.num_gpus = 1.0 but the largest node has 0.0 GPU"):
        check_fit(specs, [{"CPU": 8}])
    check_fit(specs, [{"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}])  # fits on two nodes
    many = plan(load_cluster_config({"prefill": {"num_workers": 3, "num_cpus": 2}}))
    with pytest.raises(PlacementError, match=r"needs 7 CPU .* has 4"):
        check_fit(many, [{"CPU": 4}])


def test_impossible_placement_fails_at_start_on_ray(ray_cluster):
    """The session cluster has no GPU; the check runs before any actor is created."""
    from loopserve.cluster.cluster import Cluster

    cfg = load_cluster_config({"prefill": {"num_gpus": 1}})
    with pytest.raises(PlacementError, match="prefill.num_gpus"):
        Cluster(cfg).start()


def test_job_entry_point_reports_bad_config(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("decode: {num_cpu: 1}\n")
    r = subprocess.run([sys.executable, "-m", "loopserve.job", "--config", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "decode.num_cpu: unknown key" in r.stderr


@pytest.mark.parametrize("gpus, visible, expect", [
    ([0.5, 0.5], None, ["0", "0"]),
    ([1, 1], None, ["0", "1"]),
    ([2, 1], None, ["0,1", "2"]),
    ([0.5, 1, 0.5], None, ["0", "1", "2"]),
    ([0, 1], "3,5", [None, "3"]),
    ([1, 1], "3,5", ["3", "5"]),
])
def test_process_launcher_pins_gpus(monkeypatch, gpus, visible, expect):
    from loopserve.cluster.placement import pin_gpus
    from loopserve.cluster.worker_spec import WorkerSpec

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    specs = pin_gpus([WorkerSpec(f"w{i}", "prefill", {}, num_gpus=g) for i, g in enumerate(gpus)])
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in specs] == expect


def test_serve_flags_override_the_server_section_validated_like_yaml(tmp_path, monkeypatch):
    import argparse

    from loopserve.cluster.config import add_server_args, server_overrides

    p = argparse.ArgumentParser()
    add_server_args(p)
    base = load_cluster_config({"server": {"auth_token": "s3cret", "port": 7000}})
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("cert")
    key.write_text("key")
    cfg = server_overrides(base, p.parse_args(["--tls-cert", str(cert), "--tls-key", str(key), "--host", "::1"]))
    assert cfg.server.tls and cfg.server.host == "::1" and cfg.server.port == 7000
    assert cfg.server.auth_token.get_secret_value() == "s3cret"
    assert server_overrides(base, p.parse_args([])) is base
    with pytest.raises(ConfigError, match="command line: .*tls_cert_file and server.tls_key_file go together"):
        server_overrides(base, p.parse_args(["--tls-cert", str(cert)]))
    with pytest.raises(ConfigError, match="tls_key_file"):
        server_overrides(base, p.parse_args(["--tls-cert", str(cert), "--tls-key", str(tmp_path / "none.pem")]))
