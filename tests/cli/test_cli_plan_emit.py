"""`llmctl plan --emit lws|rayservice|raycluster`: Kubernetes manifests on stdout or in --output."""

from __future__ import annotations

import subprocess
import sys

import yaml
from k8s_schemas import errors


def test_emit_lws_writes_valid_yaml_to_stdout(invoke):
    result = invoke("plan", "Llama-3.1-405B", "--nodes", "2", "--max-model-len", "8192",
                    "--emit", "lws", "--image", "registry.example/llmctl:cuda",
                    "--namespace", "llm", "--master-port", "29600")  # fmt: skip
    assert result.exit_code == 0, result.output
    objects = list(yaml.safe_load_all(result.stdout))  # nothing but YAML on stdout
    assert [o["kind"] for o in objects] == ["LeaderWorkerSet", "Service"]
    for obj in objects:
        assert errors(obj) == []
        assert obj["metadata"]["namespace"] == "llm"
    group = objects[0]["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = group[role]["spec"]["containers"]
        assert container["image"] == "registry.example/llmctl:cuda"
        argv = container["command"]
        assert argv[argv.index("--master-port") + 1] == "29600"
        assert argv[argv.index("-tp") + 1] == "8" and argv[argv.index("-pp") + 1] == "2"


def test_emit_raycluster_to_a_file_prints_the_plan_too(invoke, tmp_path):
    out = tmp_path / "llama.yaml"
    result = invoke("plan", "Llama-3.1-70B", "-tp", "8", "--emit", "raycluster",
                    "--model-pvc", "models", "--port", "9000", "-o", str(out),
                    env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tensor_parallel_size=8" in result.stdout
    assert f"Wrote {out} (RayCluster): kubectl apply -f {out}" in result.stdout
    (cluster,) = yaml.safe_load_all(out.read_text())
    assert errors(cluster) == []
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9000}
    assert "--port 9000" in head["args"][0] and "-tp 8" in head["args"][0]
    assert head["resources"]["limits"] == {"nvidia.com/gpu": 8}


def test_emit_rayservice_deploys_the_plans_replicas(invoke):
    result = invoke("plan", "Llama-3.1-70B", "-tp", "4", "--data-parallel-size", "2",
                    "--max-model-len", "8192", "--emit", "kuberay", "--model-pvc", "models",
                    "--ray-version", "2.60.0")  # fmt: skip
    assert result.exit_code == 0, result.output
    (service,) = yaml.safe_load_all(result.stdout)  # nothing but YAML on stdout
    assert service["kind"] == "RayService" and errors(service) == []
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["args"] == {
        "model": "/models/Llama-3.1-70B", "tensor_parallel_size": 4, "max_model_len": 8192,
        "distributed_executor_backend": "ray",
    }  # fmt: skip
    (deployment,) = app["deployments"]
    assert deployment["num_replicas"] == 2 and len(deployment["placement_group_bundles"]) == 4
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == 1  # the head and one worker: a pod of 4 GPUs per replica


def test_emit_rayservice_imports_neither_ray_nor_torch():
    """Planning is instant: the RayService's deployment options come without Ray."""
    code = (
        "import sys\n"
        "from llmctl.cli.main import main\n"
        "sys.argv = ['llmctl', 'plan', 'Llama-3.1-70B', '-tp', '8', '--emit', 'rayservice']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.rstrip().endswith("[]")
    assert "kind: RayService" in out


def test_emit_errors_name_the_fix(invoke):
    result = invoke("plan", "Llama-3.1-70B", "--emit", "lws", "--ray-version", "2.60.0")
    assert result.exit_code == 1
    assert "error: --ray-version applies to --emit raycluster, not --emit lws" in result.stderr
    assert "hint: drop --ray-version, or use --emit raycluster" in result.stderr
    assert result.stdout == ""
    result = invoke("plan", "Llama-3.1-70B", "--emit", "helm")
    assert result.exit_code == 1
    assert "error: unknown --emit kind 'helm'" in result.stderr
    assert "hint: use --emit lws" in result.stderr
    result = invoke("plan", "Llama-3.1-70B", "--emit", "lws", "--json")
    assert result.exit_code == 1 and "--json and --emit" in result.stderr


def test_emit_lws_across_nodes_says_how_to_make_the_cluster_secret(invoke, tmp_path):
    args = ("plan", "Llama-3.1-405B", "--nodes", "2", "--max-model-len", "8192", "--emit", "lws")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    list(yaml.safe_load_all(result.stdout))  # the note is not on stdout: YAML alone
    assert "The pods prove the cluster secret in the Secret llmctl-llama-3-1-405b-cluster-secret" \
        in result.stderr  # fmt: skip
    assert "kubectl create secret generic llmctl-llama-3-1-405b-cluster-secret" in result.stderr
    out = tmp_path / "lws.yaml"
    result = invoke(*args, "--output", str(out))
    assert "kubectl create secret generic llmctl-llama-3-1-405b-cluster-secret" in result.stdout
    assert "secretKeyRef" in out.read_text()
