"""Planning, pure: no SSH, no torch, so `llmctl plan` is instant. `planner.make_plan` takes a
ModelSpec (`model_spec`: a model's name, dtype and the engine's ModelShape, from a config.json, a
GGUF file or the offline `catalog`) and an Inventory, and returns a Plan: the TP x PP layout and its
data-parallel replicas, each rank's weights (in the bytes of their storage, `weight_format`),
activations and KV cache by the engine's own memory arithmetic, the reasons, the other layouts and
the serve commands. `manifests` writes a Plan as Kubernetes manifests (a LeaderWorkerSet, a KubeRay
RayCluster or RayService).
"""
