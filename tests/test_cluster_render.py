"""Slurm node lists, rendering of the cluster YAMLs, and Ray's own validation of every YAML in cluster_yamls/."""

import getpass
import re
import shutil
from pathlib import Path

import pytest
import yaml

from huginn_ray.cluster.__main__ import main
from huginn_ray.cluster.render import RenderError, load_template, render, validate
from huginn_ray.cluster.slurm import NodeListError, expand_nodelist

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAMLS = sorted((REPO / "cluster_yamls").glob("*.yaml"))


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("frontier[00001-00004,00010]",
         ["frontier00001", "frontier00002", "frontier00003", "frontier00004", "frontier00010"]),
        ("frontier00007", ["frontier00007"]),
        ("nid[008-010]", ["nid008", "nid009", "nid010"]),
        ("rack[1-2]-node[07,9]", ["rack1-node07", "rack1-node9", "rack2-node07", "rack2-node9"]),
        ("login1,frontier[00001-00002],batch7", ["login1", "frontier00001", "frontier00002", "batch7"]),
        ("a[1-3],a2", ["a1", "a2", "a3"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist,message",
    [("", "empty host name"), ("frontier[00001-", "unclosed '['"), ("frontier]1[", "unmatched ']'"),
     ("n[1-[2]]", "nested '['"), ("n[]", "empty bracket group"), ("n[5-3]", "descending range '5-3'"),
     ("n[1-x]", "bad range '1-x'"), ("a,,b", "empty host name"), ("a b", "whitespace")],
)
def test_expand_nodelist_rejects(nodelist, message):
    with pytest.raises(NodeListError, match=re.escape(message)):
        expand_nodelist(nodelist)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=[p.name for p in CLUSTER_YAMLS])
def test_every_cluster_yaml_passes_rays_validation(path):
    template = load_template(path)
    prepared = validate(template)  # ray.autoscaler._private.util.prepare_config + validate_config
    assert prepared["provider"]["type"] == "local"
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_validation_catches_a_broken_config():
    broken = load_template(REPO / "cluster_yamls" / "frontier.yaml")
    broken["head_start_ray_commands"] = "ray start --head"  # a string where Ray's schema wants a list
    with pytest.raises(Exception, match="is not of type 'array'"):
        validate(broken)


@pytest.fixture
def yamls_with_site_env(tmp_path):
    """A copy of cluster_yamls/ with a filled-in site.env, as a user's checkout would have it."""
    copy = tmp_path / "cluster_yamls"
    shutil.copytree(REPO / "cluster_yamls", copy)
    (copy / "site.env").write_text((copy / "site.env.example").read_text())
    return copy


def test_render_slurm_allocation(yamls_with_site_env, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "frontier[00001-00004,00010]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert main(["render", "--slurm", str(yamls_with_site_env / "frontier.yaml")]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)

    assert rendered["provider"]["head_ip"] == "frontier00001"
    assert rendered["provider"]["worker_ips"] == ["frontier00002", "frontier00003", "frontier00004", "frontier00010"]
    assert rendered["max_workers"] == 4
    assert rendered["cluster_name"] == "huginn-frontier-123456"
    assert rendered["auth"]["ssh_user"] == getpass.getuser()
    assert rendered["file_mounts"] == {
        "~/.huginn_ray/frontier_env.sh": str(yamls_with_site_env / "frontier_env.sh"),
        "~/.huginn_ray/site.env": str(yamls_with_site_env / "site.env"),
    }
    template = load_template(yamls_with_site_env / "frontier.yaml")
    for key in ("setup_commands", "head_setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert rendered[key] == template[key]
    # What `ray up` makes of it: one node type whose min and max are the four workers.
    node_type = validate(rendered)["available_node_types"]["local.cluster.node"]
    assert (node_type["min_workers"], node_type["max_workers"]) == (4, 4)


def test_render_nodelist_and_local(yamls_with_site_env, capsys):
    assert main(["render", "--nodelist", "gpu[1-2]", str(yamls_with_site_env / "local.yaml")]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)
    assert (rendered["provider"]["head_ip"], rendered["provider"]["worker_ips"]) == ("gpu1", ["gpu2"])
    assert main(["render", str(yamls_with_site_env / "local.yaml")]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)
    assert (rendered["provider"]["head_ip"], rendered["provider"]["worker_ips"]) == ("127.0.0.1", [])
    assert rendered["max_workers"] == 0 and rendered["cluster_name"] == "huginn-local"


def test_render_errors_name_the_problem(tmp_path, yamls_with_site_env, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    assert main(["render", "--slurm", str(yamls_with_site_env / "frontier.yaml")]) == 2
    assert "SLURM_JOB_NODELIST is not set" in capsys.readouterr().err

    (yamls_with_site_env / "site.env").unlink()
    assert main(["render", "--nodelist", "n[1-2]", str(yamls_with_site_env / "frontier.yaml")]) == 2
    err = capsys.readouterr().err
    assert "site.env does not exist" in err and "copy site.env.example" in err

    assert main(["render", "--nodelist", "n[1-", str(REPO / "cluster_yamls" / "frontier.yaml")]) == 2
    assert "unclosed '['" in capsys.readouterr().err

    not_local = tmp_path / "aws.yaml"
    not_local.write_text("cluster_name: x\nprovider: {type: aws, region: us-east-1}\n")
    with pytest.raises(RenderError, match="provider.type must be 'local'"):
        load_template(not_local)
    with pytest.raises(RenderError, match="head_ip is empty"):
        render(load_template(REPO / "cluster_yamls" / "frontier.yaml"), REPO / "cluster_yamls")


def _ray_start_flags(command: str) -> set[str]:
    return {flag for flag in command.split() if flag.startswith("--") and not flag.startswith("--address")}


def test_frontier_yaml_and_sbatch_start_ray_the_same_way():
    """The §5 node layout in both launch paths: 8 GPUs, 56 CPUs, temp and spill dirs on node-local storage."""
    frontier = load_template(REPO / "cluster_yamls" / "frontier.yaml")
    worker_start = frontier["worker_start_ray_commands"][-1]
    head_start = next(c for c in frontier["head_start_ray_commands"] if "ray start" in c)
    expected = {"--num-cpus=56", "--num-gpus=8", '--temp-dir="$HUGINN_NODE_LOCAL_DIR/ray"',
                '--object-spilling-directory="$HUGINN_NODE_LOCAL_DIR/ray_spill"'}
    assert expected <= _ray_start_flags(worker_start)
    assert expected | {"--head", "--dashboard-host=127.0.0.1"} <= _ray_start_flags(head_start)
    sbatch = (REPO / "cluster_yamls" / "frontier.sbatch").read_text()
    ray_flags = re.search(r"ray_flags=\((.*?)\)", sbatch, re.S).group(1)
    assert expected | {"--block"} == set(ray_flags.split())
    assert "--dashboard-host=127.0.0.1" in sbatch
    for command in (*frontier["head_start_ray_commands"], *frontier["worker_start_ray_commands"]):
        assert command.startswith("source ~/.huginn_ray/frontier_env.sh && ")


def test_local_yaml_rehearses_frontiers_head():
    """local.yaml (brought up for real by test_cluster_launcher.py) runs frontier.yaml's head commands, less the
    Frontier-only resource flags, with its own env file."""
    frontier = load_template(REPO / "cluster_yamls" / "frontier.yaml")
    local = load_template(REPO / "cluster_yamls" / "local.yaml")

    def normalized(commands):
        return [" ".join(c.replace("frontier_env.sh", "local_env.sh").replace('ulimit -n "$(ulimit -Hn)" &&', "")
                         .replace("--num-cpus=56 --num-gpus=8", "").split()) for c in commands]

    for key in ("setup_commands", "head_setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert normalized(frontier[key]) == normalized(local[key]), key
