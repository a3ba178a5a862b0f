"""``Engine.text_stream``: the deltas the server streams, per completion, with stop strings held
back (the same :class:`TextStream` that ``Engine.stream`` uses)."""
from __future__ import annotations

import pytest

from corekv.engine.llm_engine import Engine
from corekv.engine.sampling import SamplingParams


def make_engine(loaded) -> Engine:
    return Engine.from_config({"model": "tiny", "engine": {"num_blocks": 64}}, model=loaded)


def drive(engine: Engine, prompt, params: SamplingParams):
    """Run one request through add_request/step, collecting its deltas after every step."""
    request_id = engine.add_request(prompt, params)
    text = engine.text_stream(request_id)
    deltas, outputs = [], []
    while not outputs:
        outputs = [o for o in engine.step() if o.request_id == request_id]
        deltas += text.deltas()
    return deltas, outputs[0], text


def test_the_deltas_of_each_completion_add_up_to_its_text(tiny_llama):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3, ignore_eos=True)
    with make_engine(tiny_llama) as engine:
        deltas, output, text = drive(engine, "several completions", params)
    assert text.is_finished
    for completion in output.outputs:
        assert "".join(d for i, d in deltas if i == completion.index) == completion.text


def test_text_that_could_start_a_stop_string_is_held_back(tiny_llama):
    prompt, free = "Stop strings end a completion early", SamplingParams(max_tokens=24, temperature=0.0,
                                                                         ignore_eos=True)
    with make_engine(tiny_llama) as engine:
        whole = engine.generate(prompt, free)[0].text
        # a 3-character stop string found first where it stands, with text before it
        stop = next(whole[i:i + 3] for i in range(1, len(whole) - 3)
                    if "\ufffd" not in whole[i:i + 3] and whole.index(whole[i:i + 3]) == i)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        deltas, output, text = drive(engine, prompt, params)
    assert text.holdback == 2
    assert output.text == whole[:whole.index(stop)] and output.finish_reason == "stop"
    streamed = ""
    for _, delta in deltas:
        streamed += delta
        assert output.text.startswith(streamed)  # nothing past the stop, ever
    assert streamed == output.text


def test_text_stream_needs_a_request_in_flight(tiny_llama):
    with make_engine(tiny_llama) as engine:
        with pytest.raises(KeyError, match="no request 'nope' is in flight"):
            engine.text_stream("nope")
