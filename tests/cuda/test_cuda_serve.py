"""`llmctl serve --device cuda` as an OpenAI client sees it: a real server process on the GPU,
the official openai client, greedy tokens equal to transformers on the same GPU in float32."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
# The server's and the client's packages (a GPU machine reached through the device tool may lack
# them: the test is then skipped, with the package named).
for _package in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_package)

from e2e.conftest import start_server  # noqa: E402
from support import free_gpu_memory  # noqa: E402

IGNORE_EOS = {"ignore_eos": True}


def test_serve_on_cuda_answers_the_openai_client(tmp_path, tiny_models, hf_greedy, hf_on_gpu):
    path, hf_model = tiny_models.get("llama")
    prompt_ids = tiny_models.tokenizer.encode("The capital of France is")
    free_gpu_memory()  # what this process cached would count against the server's KV cache
    server = start_server(
        tmp_path, str(path), "--device", "cuda", "--dtype", "float32",
        "--gpu-memory-utilization", "0.3", "--served-model-name", "tiny", quiet=False,
    )  # fmt: skip
    try:
        client = server.client()
        raw = client.completions.with_raw_response.create(
            model="tiny",
            prompt=prompt_ids,
            max_tokens=16,
            temperature=0,
            extra_body={**IGNORE_EOS, "return_token_ids": True},
        )
        completion = raw.parse()
        served_ids = raw.http_response.json()["choices"][0]["token_ids"]
        stream = client.completions.create(
            model="tiny", prompt=prompt_ids, max_tokens=16, temperature=0, stream=True,
            extra_body=IGNORE_EOS,
        )  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Name three colors."}],
            max_completion_tokens=8,
            temperature=0,
            extra_body=IGNORE_EOS,
        )
    finally:
        code = server.stop()  # and no process of the server is left
    assert code == 0

    assert served_ids == hf_greedy(hf_on_gpu(hf_model, torch.float32), prompt_ids, 16)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 16
    assert streamed == completion.choices[0].text
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    log = server.output()
    assert "GPU KV cache size: " in log and "Memory profiling (rank 0): 0.3 x " in log
