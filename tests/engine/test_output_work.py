"""A step's host work does not grow with the outputs' length: counted, not timed.

At the 10th and at the 1,000th token of a request, one step decodes the same number of token ids
and copies the same number of tokens into its RequestOutput (output_kind DELTA: what is new; a
FINAL_ONLY request not even that until it ends), and the model runner stages the same number of
values to the device. CUMULATIVE outputs (a copy of everything so far, kept for library callers
who ask for it) are counted too: they grow, which shows the counter counts."""

from __future__ import annotations

import pytest

from llmctl.engine.core.output_processor import OutputProcessor
from llmctl.engine.core.scheduler import EngineCoreOutput
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog; 東京は晴れ. " * 40
STEPS = 1000


class WindowTokenizer:
    """The tokenizer seen through encode() and decode() alone: the detokenizer's window method."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _work_per_step(tokenizer, kind: RequestOutputKind, steps: int = STEPS) -> list[tuple]:
    """(token ids decoded, tokens copied into outputs) of each step of one request."""
    ids = tokenizer.encode(TEXT) * 4
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=steps, output_kind=kind)
    processor.add_request("r", None, [1, 2, 3], params, ["r"], 0.0)
    detokenizer = processor.requests["r"].completions[0].detokenizer
    work = []
    for step in range(steps):
        decoded = detokenizer.decoded_tokens
        last = step == steps - 1
        out = EngineCoreOutput("r", [ids[step]], finish_reason="length" if last else None)
        outputs, _ = processor.process_outputs([out])
        copied = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        work.append((detokenizer.decoded_tokens - decoded, copied))
    return work


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "window"])
def test_a_streamed_step_does_the_same_work_at_10_and_1000_tokens(smol_tokenizer, stream):
    tokenizer = smol_tokenizer if stream else WindowTokenizer(smol_tokenizer)
    work = _work_per_step(tokenizer, RequestOutputKind.DELTA)
    assert work[9][1] == work[998][1] == 1  # one new token handed out
    if stream:
        assert work[9][0] == work[998][0] == 1  # one token decoded
    else:  # a short window before the token, decoded twice
        assert work[9][0] <= 16 and work[998][0] <= 16


def test_a_final_only_request_is_decoded_once_when_it_ends(smol_tokenizer):
    work = _work_per_step(smol_tokenizer, RequestOutputKind.FINAL_ONLY)
    assert work[9] == work[998] == (0, 0)  # nothing decoded or copied while it runs
    decoded, copied = work[-1]
    assert copied == STEPS and decoded == STEPS  # each token decoded once, at the end


def test_cumulative_outputs_copy_everything_every_step(smol_tokenizer):
    work = _work_per_step(smol_tokenizer, RequestOutputKind.CUMULATIVE)
    assert (work[9][1], work[998][1]) == (10, 999)


def test_delta_outputs_add_up_to_the_final_text(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)[:300]
    processor = OutputProcessor(smol_tokenizer)
    params = SamplingParams(max_tokens=300, output_kind=RequestOutputKind.DELTA, stop=["lazy cat"])
    processor.add_request("r", None, [1], params, ["r"], 0.0)
    text, tokens = "", []
    for i, token in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        outputs, _ = processor.process_outputs(
            [EngineCoreOutput("r", [token], finish_reason=finish)]
        )
        for output in outputs:
            text += output.outputs[0].text
            tokens += output.outputs[0].token_ids
    assert tokens == ids
    assert text == smol_tokenizer.decode(ids)


def test_a_step_on_the_device_does_the_same_work_at_10_and_1000_tokens(
    tiny_models, monkeypatch, tmp_path
):
    """One engine step on the simulated device (tests/device_check.py): scheduler, model
    runner, output processor. At the 10th and the 1,000th token: the same values copied to the
    device (input ids, positions, slots, new block ids, the step's block-table rows and lengths:
    no table is re-sent), the same tokens decoded and copied into the output. The tiny Llama's
    shape with room for 2,048 positions, random weights (--load-format dummy)."""
    import json
    import shutil

    from device_check import DeviceCheckMode
    from test_device_placement import _runner

    from llmctl.engine.core.scheduler import Scheduler
    from llmctl.engine.worker.input_batch import StagedBuffer

    staged = [0]
    copy = StagedBuffer.copy

    def counting_copy(self, n):
        staged[0] += n
        return copy(self, n)

    monkeypatch.setattr(StagedBuffer, "copy", counting_copy)
    source = tiny_models.path("llama")
    config = json.loads((source / "config.json").read_text()) | {"max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    runner = _runner(tmp_path, load_format="dummy", max_model_len=1100)
    engine_config = runner.config
    scheduler = Scheduler(engine_config.scheduler_config, engine_config.cache_config, 64)
    processor = OutputProcessor(tiny_models.tokenizer)
    # every sampling option that keeps per-request state: a seed, top-k, top-p, penalties
    params = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, seed=3, frequency_penalty=0.5,
        repetition_penalty=1.1, max_tokens=STEPS, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    prompt = list(range(10, 30))
    processor.add_request("r", None, prompt, params, ["r"], 0.0)
    from llmctl.engine.core.request import Request

    scheduler.add_request(Request("r", prompt, params, frozenset(), STEPS, 0.0))
    detokenizer = processor.requests["r"].completions[0].detokenizer
    work = []
    with DeviceCheckMode() as mode:
        while scheduler.has_unfinished_requests():
            staged[0], copies = 0, mode.host_to_device
            decoded = detokenizer.decoded_tokens
            step = scheduler.schedule()
            core = scheduler.update_from_output(step, runner.execute_model(step))
            outputs, _ = processor.process_outputs(core)
            copied = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            work.append(
                (
                    staged[0],
                    mode.host_to_device - copies,
                    detokenizer.decoded_tokens - decoded,
                    copied,
                )
            )
    assert len(work) == STEPS
    assert work[10] == work[998]
    assert work[998][0] <= 16  # a handful of values, however long the sequence
