"""Tensor and pipeline parallelism through real worker processes (Gloo on the CPU), token-exact
against Hugging Face transformers; worker death and impossible layouts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from support import VOCAB, alive, default_signals, live_pids

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import ConfigError, EngineDeadError

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
LENGTHS = [3, 7, 12, 20, 31, 5, 16, 40]

# (tensor_parallel_size, pipeline_parallel_size, pipeline_layer_partition)
LAYOUTS = {
    "tp2": (2, 1, None),
    "tp4": (4, 1, None),  # the tiny Llama has 2 KV heads: tp=4 replicates them
    "pp2": (1, 2, None),
    "pp3-uneven": (1, 3, "2,1,1"),
    "tp2-pp2": (2, 2, None),
}
# Every layout on Llama. GPT-2 and OPT (their own fused or biased projections, learned
# positions, final norms) on the layouts where their code differs: tp2 (their weight loaders),
# pp3-uneven (first, middle and last stages) and tp2-pp2 (embedding and head in each stage's
# tensor-parallel group). Their tp4 (4 heads, no KV heads to replicate) runs the same code as
# tp2, and their pp2 the first and last stages of pp3-uneven.
CASES = [("llama", layout) for layout in LAYOUTS] + [
    (family, layout) for family in ("gpt2", "opt") for layout in ("tp2", "pp3-uneven", "tp2-pp2")
]


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def child_pids() -> set[int]:
    """Live (not zombie) processes whose parent is this test process."""
    return live_pids(parent=os.getpid())


@pytest.fixture(scope="module")
def expected(tiny_models, hf_greedy):
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            _, hf_model = tiny_models.get(family)
            cache[family] = [hf_greedy(hf_model, p, 32) for p in prompts()]
        return cache[family]

    return get


def run(path, tp, pp, partition=None, backend="mp", **kwargs) -> list[list[int]]:
    before = child_pids()
    with LLM(
        str(path),
        use_tqdm_on_load=False,
        dtype="float32",
        kv_cache_space_gib=0.05,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_layer_partition=partition,
        distributed_executor_backend=backend,
        **kwargs,
    ) as llm:
        info = llm.llm_engine.executor.rank_info()
        assert [r["rank"] for r in info] == list(range(tp * pp))
        outputs = llm.generate(prompts(), GREEDY_32, use_tqdm=False)
    assert child_pids() <= before  # every worker process is gone
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_layouts_on_mp_match_transformers(family, layout, tiny_models, expected):
    tp, pp, partition = LAYOUTS[layout]
    assert run(tiny_models.path(family), tp, pp, partition) == expected(family)


def test_uneven_tensor_parallel_on_9_heads(tiny_models, expected):
    # 9 query heads / 3 KV heads on 2 ranks: 6 + 3 query heads, 2 + 1 KV heads.
    assert run(tiny_models.path("llama-9-heads"), 2, 1) == expected("llama-9-heads")


def test_pipelining_off_gives_the_same_tokens(tiny_models, expected):
    path = tiny_models.path("llama")
    assert run(path, 1, 2, max_concurrent_batches=1) == expected("llama")


def test_ray_backend_pipeline_matches_transformers(tiny_models, expected):
    pytest.importorskip("ray")  # tp=2 on Ray: the test below
    assert run(tiny_models.path("llama"), 1, 2, backend="ray") == expected("llama")


@contextlib.contextmanager
def ray_started_elsewhere(argv: list[str], ray_tmpdir: str, ready):
    """A Ray someone else started on this machine, in its own session; every process of it is
    gone afterwards (killed: a `ray start` head's own exit waits 30 s for its dead GCS).
    `ready(process)` returns its GCS address once it serves, else None."""
    process = subprocess.Popen(
        argv,
        env={**os.environ, "RAY_TMPDIR": ray_tmpdir},
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address, deadline = None, time.monotonic() + 300  # a bound, to fail instead of hanging
        while address is None:
            assert process.poll() is None, f"{argv[:3]} exited with {process.returncode}"
            assert time.monotonic() < deadline, f"{argv[:3]} did not serve within 300 s"
            address = ready(process)
        yield address
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        deadline = time.monotonic() + 60
        while live_pids(session=process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not live_pids(session=process.pid)


BYSTANDER = """import ray, sys
ray.init(num_cpus=1, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


def test_ray_backend_joins_only_the_cluster_ray_start_recorded(tiny_models, expected, monkeypatch):
    """A private Ray of someone else's (a raylet in the process table, as a container's is) is
    never joined: the engine starts its own. A `ray start` cluster (its address in Ray's temp
    directory) is joined, as `ray.init()` does."""
    ray = pytest.importorskip("ray")
    path = str(tiny_models.path("llama"))
    ours, theirs = (tempfile.mkdtemp(prefix="lr", dir="/tmp") for _ in range(2))  # short: sockets
    monkeypatch.setenv("RAY_TMPDIR", ours)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    recorded = os.path.join(ours, "ray", "ray_current_cluster")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = [ray_cli, "start", "--head", "--block", "--port=0", "--num-cpus=2",
            "--include-dashboard=false", "--disable-usage-stats"]  # fmt: skip

    def printed_address(process) -> str:
        address = process.stdout.readline().strip()  # "" once it has exited
        assert address, f"the other Ray exited with {process.wait(timeout=60)} before serving"
        return address

    def recorded_address(process) -> str | None:
        if os.path.exists(recorded):
            return open(recorded).read().strip() or None
        time.sleep(0.2)
        return None

    def address_joined() -> str:
        options = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
        with LLM(path, use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05,
                 **options) as llm:  # fmt: skip
            address = ray.get_runtime_context().gcs_address
            outputs = llm.generate(prompts(), GREEDY_32, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected("llama")
        return address

    try:
        bystander = [sys.executable, "-c", BYSTANDER]
        with ray_started_elsewhere(bystander, theirs, printed_address) as other:
            assert address_joined() != other
            assert not os.path.exists(recorded)  # a private Ray records nothing
            with ray_started_elsewhere(head, ours, recorded_address) as started:
                assert address_joined() == started
    finally:
        for directory in (ours, theirs):
            shutil.rmtree(directory, ignore_errors=True)


def test_ray_address_nobody_answers_at_fails_at_once(tiny_models, monkeypatch):
    pytest.importorskip("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    before = child_pids()
    with pytest.raises(ConfigError, match=f"no Ray cluster answers at 127.0.0.1:{port}, the "
                       "address RAY_ADDRESS names") as caught:  # fmt: skip
        LLM(str(tiny_models.path("llama")), use_tqdm_on_load=False, kv_cache_space_gib=0.05,
            tensor_parallel_size=2, distributed_executor_backend="ray")  # fmt: skip
    assert "unset RAY_ADDRESS" in caught.value.hint
    assert child_pids() <= before


def test_per_rank_weights_shrink_with_tp(tiny_models):
    path = tiny_models.path("llama")
    sizes = {}
    for tp in (1, 2):
        with LLM(
            str(path),
            use_tqdm_on_load=False,
            kv_cache_space_gib=0.01,
            tensor_parallel_size=tp,
            distributed_executor_backend="uni" if tp == 1 else "mp",
        ) as llm:
            sizes[tp] = max(r["weight_bytes"] for r in llm.llm_engine.executor.rank_info())
    # Embedding, LM head, attention and MLP are all split; only the norms are replicated.
    assert sizes[2] <= 0.55 * sizes[1]


def test_killed_worker_fails_the_next_step_naming_it(tiny_models, monkeypatch):
    from llmctl.engine.executor import multiproc

    # The surviving rank waits for the dead one inside the step's all-reduce, where no graceful
    # shutdown reaches it: it must be killed at once, not after the shutdown grace (an hour here,
    # so that waiting on it would fail the deadline below).
    monkeypatch.setattr(multiproc, "_SHUTDOWN_GRACE_S", 3600.0)
    before = child_pids()
    llm = LLM(
        str(tiny_models.path("llama")),
        use_tqdm_on_load=False,
        kv_cache_space_gib=0.05,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    engine = llm.llm_engine
    pids = [r["pid"] for r in engine.executor.rank_info()]
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    # The death is seen from the process itself (its pidfd), not by a timeout: the very step
    # that needs the killed rank fails, however slow the machine is.
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        engine.step()
    # A deadline far past any machine's time for one step, far short of the all-reduce's own
    # 300 s wait or the grace above.
    assert time.monotonic() - started < 120
    assert "rank 1" in err.value.message and "SIGKILL" in err.value.message
    assert child_pids() <= before  # the surviving worker was stopped too
    with pytest.raises(EngineDeadError):
        engine.step()
    llm.shutdown()


@pytest.mark.parametrize(
    "model, kwargs, message, hint",
    [
        (
            "llama-9-heads",
            {"tensor_parallel_size": 16},
            "tensor_parallel_size=16 cannot split 9 attention heads",
            "--pipeline-parallel-size",
        ),
        (
            "llama",
            {"pipeline_parallel_size": 5},
            "pipeline_parallel_size=5 exceeds the model's 4 layers",
            "4 or less",
        ),
        (
            "llama",
            {"pipeline_parallel_size": 2, "pipeline_layer_partition": "1,2"},
            "summing to 3",
            "sum to 4",
        ),
        (
            "llama",
            {"pipeline_parallel_size": 2, "pipeline_layer_partition": "4,0"},
            "gives a stage no layers",
            "at least one layer",
        ),
    ],
)
def test_impossible_layouts_refused_before_any_process(tiny_models, model, kwargs, message, hint):
    before = child_pids()
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_models.path(model)), use_tqdm_on_load=False, **kwargs)
    assert message in err.value.message
    assert hint in err.value.hint
    assert child_pids() == before


def session_pids(session: int) -> set[int]:
    """Live processes of a session (a shell's Ctrl-C reaches its whole foreground group)."""
    return live_pids(session=session)


_SCRIPT_HEAD = """
import gc, os, sys
sys.modules["ray"] = None  # any `import ray` now raises ImportError: mp must not need Ray
from llmctl.engine import LLM, SamplingParams
MODEL = {path!r}
def start():
    # No backend named: with LLMCTL_CPU_DEVICES=2 (enough local devices) the rule picks mp.
    return LLM(MODEL, use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.02,
               tensor_parallel_size=2)
llm = start()
pids = [r["pid"] for r in llm.llm_engine.executor.rank_info()]
print("workers", *pids, flush=True)
"""


def _run_script(body: str, path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT_HEAD.format(path=str(path)) + body],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LLMCTL_CPU_DEVICES": "2"},
        start_new_session=True,  # its own session, like a program started from a shell
        preexec_fn=default_signals,  # Ctrl-C reaches it even if this suite runs under nohup
    )


@pytest.fixture(scope="module")
def script_without_ray(tiny_models):
    """One script for two tests: mp generates with Ray unimportable, then garbage collection
    stops the first engine's workers and the interpreter's exit those of a second."""
    body = f"""
out = llm.generate([{prompts()[0]!r}], SamplingParams(temperature=0, max_tokens=32,
                   ignore_eos=True), use_tqdm=False)
print("tokens", *out[0].outputs[0].token_ids, flush=True)
print("executor", type(llm.llm_engine.executor).__name__, flush=True)
del llm
gc.collect()
print("collected", *[pid for pid in pids if os.path.exists(f"/proc/{{pid}}")], flush=True)
second = start()
print("second", *[r["pid"] for r in second.llm_engine.executor.rank_info()], flush=True)
# Exits without shutdown(): the interpreter's exit must stop these workers too.
"""
    proc = _run_script(body, tiny_models.path("llama"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return proc, {line.split()[0]: line.split()[1:] for line in out.strip().splitlines()}


def test_mp_backend_works_without_ray(script_without_ray, expected):
    """Ray is imported only by the Ray backend: with `import ray` failing, mp still runs."""
    _, lines = script_without_ray
    assert lines["executor"] == ["MultiprocExecutor"]
    assert [int(t) for t in lines["tokens"]] == expected("llama")[0]


def test_garbage_collection_and_exit_stop_the_workers(script_without_ray):
    proc, lines = script_without_ray
    assert lines["collected"] == []  # garbage collection stopped the first workers
    assert len(lines["second"]) == 2
    for pid in map(int, lines["second"]):
        assert not alive(pid)
    assert not session_pids(proc.pid)


def test_ctrl_c_leaves_no_process(tiny_models):
    # Generates until interrupted: a bounded generate could end before the signal arrives, and
    # the script would then exit normally. Once one batch is done, the next is under way.
    body = """
params = SamplingParams(max_tokens=64, ignore_eos=True)
llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)
print("generated", flush=True)
while True:
    llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)
"""
    proc = _run_script(body, tiny_models.path("llama"))
    try:
        pids = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert proc.stdout.readline().strip() == "generated"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=120)
        assert "KeyboardInterrupt" in err
        deadline = time.monotonic() + 60
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_pids(proc.pid)
        assert not any(alive(pid) for pid in pids)
    finally:  # whatever failed above, leave nothing generating on the machine
        for pid in session_pids(proc.pid) | {proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_layer_partition_from_the_environment(tiny_models, monkeypatch):
    from llmctl.engine.config.engine_args import EngineArgs

    monkeypatch.setenv("LLMCTL_PP_LAYER_PARTITION", "1,3")
    args = EngineArgs(model=str(tiny_models.path("llama")), pipeline_parallel_size=2)
    assert args.create_engine_config().parallel_config.pipeline_layer_partition == (1, 3)
    explicit = EngineArgs(
        model=str(tiny_models.path("llama")),
        pipeline_parallel_size=2,
        pipeline_layer_partition="3,1",
    )
    assert explicit.create_engine_config().parallel_config.pipeline_layer_partition == (3, 1)
