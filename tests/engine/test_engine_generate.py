"""The engine end to end on the tiny random Llama: greedy equals transformers' generate, sampling
reproduces, stop conditions, n > 1 with copy-on-write, streaming, rejection, argument errors."""
from __future__ import annotations

import pytest
import torch

from corekv.config import CacheConfig, Config, EngineConfig
from corekv.engine.llm_engine import Engine
from corekv.engine.requests import RequestRejectedError
from corekv.engine.sampling import SamplingParams
from corekv.errors import ConfigError, CoreKVError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world, this is a longer prompt about blocks and caches", "abc",
           [5, 6, 7, 8] * 9, [{"role": "user", "content": "What is a KV cache?"}]]


def make_engine(loaded, *, backend="hash_blocks", num_blocks=64, block_size=16, budget=64, **kwargs):
    cfg = Config(model="tiny", engine=EngineConfig(num_blocks=num_blocks, block_size=block_size,
                                                   max_num_batched_tokens=budget, **kwargs),
                 cache=CacheConfig(backend=backend))
    return Engine(cfg, model=loaded)


def hf_greedy(loaded, hf_attention, token_ids, max_new_tokens):
    with hf_attention(loaded) as model, torch.no_grad():
        x = torch.tensor([token_ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def printable_stop(text: str) -> str:
    """A two-character stop string of plain letters/digits from the middle of ``text`` (the tiny
    model emits random bytes; its invalid UTF-8 is no place to test stop strings)."""
    for i in range(2, len(text) - 1):
        if text[i:i + 2].isascii() and text[i:i + 2].isalnum():
            return text[i:i + 2]
    raise AssertionError(f"no plain two-character run in {text!r}; pick another prompt")


@pytest.fixture(scope="module")
def references(tiny_llama, hf_attention):
    return [hf_greedy(tiny_llama, hf_attention, tiny_llama.encode_prompt(p), GREEDY.max_tokens)
            for p in PROMPTS]


@pytest.mark.parametrize("backend, block_size, budget", [("hash_blocks", 16, 64), ("radix", 32, 8)])
def test_greedy_equals_transformers_generate(tiny_llama, references, backend, block_size, budget):
    with make_engine(tiny_llama, backend=backend, block_size=block_size, budget=budget) as engine:
        outputs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == references
        assert [o.prompt for o in outputs] == PROMPTS
        assert all(o.finish_reason == "length" and o.ttft_s > 0 for o in outputs)
        again = engine.generate(PROMPTS, GREEDY)  # now with cached prefixes
        assert [o.token_ids for o in again] == references
        assert again[0].num_cached_tokens == again[0].cached_tokens_by_tier["device"] > 0


def test_seeded_sampling_reproduces_whatever_shares_the_batch(tiny_llama):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    with make_engine(tiny_llama) as engine:
        alone = engine.generate("tell me a story", params)[0].token_ids
        batched = engine.generate(["tell me a story", "abc", "xyz"], [params, GREEDY, GREEDY])[0].token_ids
        other_seed = engine.generate("tell me a story", SamplingParams(max_tokens=10, seed=99))[0].token_ids
    assert alone == batched
    assert alone != other_seed


def test_stop_strings_cut_the_text_and_finish_with_stop(tiny_llama):
    with make_engine(tiny_llama) as engine:
        full = engine.generate("hello", GREEDY)[0]
        stop = printable_stop(full.text)
        cut = engine.generate("hello", SamplingParams(max_tokens=12, temperature=0.0, stop=[stop],
                                                          ignore_eos=True))[0]
        kept = engine.generate("hello", SamplingParams(max_tokens=12, temperature=0.0, stop=stop,
                                                           include_stop_str_in_output=True,
                                                           ignore_eos=True))[0]
    index = full.text.index(stop)
    assert cut.finish_reason == "stop" and cut.text == full.text[:index]
    assert kept.text == full.text[:index + len(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 12


def test_stop_token_ids_and_max_tokens(tiny_llama):
    with make_engine(tiny_llama) as engine:
        full = engine.generate("abc", GREEDY)[0]
        target = full.token_ids[3]
        stopped = engine.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=[target]))[0]
        short = engine.generate("abc", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    first = full.token_ids.index(target)
    assert stopped.token_ids == full.token_ids[:first + 1] and stopped.finish_reason == "stop"
    assert short.token_ids == full.token_ids[:2] and short.finish_reason == "length"


def test_n_greedy_completions_share_the_prompt_and_copy_on_write(tiny_llama):
    """A 21-token prompt leaves a partial block shared by the 3 forks: two copy it, and all
    three continue exactly as the single greedy completion does."""
    prompt = list(range(10, 31))
    with make_engine(tiny_llama) as engine:
        single = engine.generate(prompt, GREEDY)[0].token_ids
        out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, n=3, ignore_eos=True))[0]
        stats = engine.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [single] * 3
    assert stats["num_cow_copies"] == 2
    assert stats["kv_num_free_blocks"] == stats["kv_num_blocks"]  # nothing leaked


def test_n_seeded_completions_equal_single_requests_seeded_seed_plus_index(tiny_llama):
    prompt = list(range(40, 59))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    with make_engine(tiny_llama) as engine:
        forked = engine.generate(prompt, params)[0]
        singles = [engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i,
                                                          ignore_eos=True))[0].token_ids for i in range(3)]
    assert [c.token_ids for c in forked.outputs] == singles
    assert len({tuple(s) for s in singles}) > 1


def test_stream_yields_the_same_text_as_generate(tiny_llama):
    with make_engine(tiny_llama) as engine:
        text = engine.generate("hello", GREEDY)[0].text
        deltas = list(engine.stream("hello", GREEDY))
        assert "".join(deltas) == text and len(deltas) > 1
        stop = printable_stop(text)
        stopped = "".join(engine.stream("hello", SamplingParams(max_tokens=12, temperature=0.0,
                                                                    stop=stop, ignore_eos=True)))
        assert stopped == text[:text.index(stop)]
        with pytest.raises(ValueError, match="n=2"):
            next(engine.stream("x", SamplingParams(n=2)))


def test_a_request_that_can_never_fit_is_rejected_at_add_time(tiny_llama):
    with make_engine(tiny_llama, num_blocks=4, block_size=16) as engine:
        with pytest.raises(RequestRejectedError, match=r"needs 5 KV blocks .* pool has 4 usable"):
            engine.generate([1] * 60, SamplingParams(max_tokens=10))
        assert engine.stats()["num_waiting"] == 0  # nothing was queued
        assert engine.generate([1] * 40, SamplingParams(max_tokens=10))[0].finish_reason in ("stop", "length")


def test_a_prompt_with_more_characters_than_could_ever_fit_is_refused_before_tokenizing(tiny_llama):
    """A huge prompt costs its tokenization (seconds for megabytes) before the token count can
    refuse it: the engine refuses it by its characters first, for every call that encodes."""
    with make_engine(tiny_llama, num_blocks=4, block_size=16) as engine:
        bound = engine.max_prompt_chars
        assert bound is not None and bound >= 4 * 16  # the byte tokenizer: a character per token
        encode = engine.model.encode_prompt
        engine.model.encode_prompt = lambda prompt: pytest.fail("the prompt was tokenized")
        try:
            for call in (lambda p: engine.generate(p), lambda p: engine.add_request(p),
                         lambda p: engine.warm(p)):
                with pytest.raises(RequestRejectedError, match=rf"no prompt over {bound} characters fits"):
                    call("x" * (bound + 1))
            with pytest.raises(RequestRejectedError, match="characters cannot fit"):
                engine.generate([[{"role": "user", "content": "x" * (bound + 1)}]])
        finally:
            engine.model.encode_prompt = encode
        assert engine.stats()["num_waiting"] == 0


def test_batch_arguments_are_validated_before_anything_runs(tiny_llama):
    with make_engine(tiny_llama) as engine:
        with pytest.raises(ValueError, match="sampling_params is a list of 1 but there are 2 prompts"):
            engine.generate(["a", "b"], [GREEDY])
        with pytest.raises(TypeError, match=r"prompts\[1\]"):
            engine.generate(["a", 3])
        with pytest.raises(TypeError, match="sampling_params"):
            engine.generate("a", {"max_tokens": 3})
        with pytest.raises(TypeError, match="cache_salt"):
            engine.generate("a", GREEDY, cache_salt=5)
        assert engine.generate([], GREEDY) == []
        assert engine.stats()["num_waiting"] == 0 and not engine.has_unfinished_requests


def test_a_bad_salt_is_refused_by_every_verb_in_one_wording(tiny_llama):
    """The salt is checked where it enters (corekv.hashing.check_cache_salt), with one message,
    even where nothing would be computed (a prompt shorter than a block)."""
    with make_engine(tiny_llama) as engine:
        calls = [lambda: engine.generate("a", GREEDY, cache_salt=5),
                 lambda: engine.add_request("a", GREEDY, cache_salt=5),
                 lambda: engine.warm("a", cache_salt=5), lambda: engine.unpin("a", cache_salt=5)]
        for call in calls:
            with pytest.raises(TypeError) as info:
                call()
            assert str(info.value).startswith("cache_salt: got 5; expected a string (the tenant's salt")
        assert not engine.has_unfinished_requests


def test_cache_salts_keep_tenants_apart(tiny_llama):
    prompt = list(range(3, 60))
    with make_engine(tiny_llama) as engine:
        engine.generate(prompt, GREEDY, cache_salt="tenant-a")
        other = engine.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
        same = engine.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 48
    assert other.token_ids == same.token_ids


def test_per_user_salts_do_not_grow_the_engine_without_bound(tiny_llama):
    """A salt per user is a normal deployment: the engine keeps a bounded cache of chain seeds,
    and a salt that fell out of it still gets the same seed (the same keys) when it returns."""
    with make_engine(tiny_llama) as engine:
        first = engine.prefix_key([1, 2, 3] * 6, "user-0").block_hashes
        for i in range(5000):
            engine.prefix_key([1, 2, 3] * 6, f"user-{i}")
        assert engine._namespace.cache_info().currsize <= 4096
        assert engine.prefix_key([1, 2, 3] * 6, "user-0").block_hashes == first


def test_stats_count_steps_tokens_and_reuse(tiny_llama):
    prompt = list(range(3, 40))  # 37 tokens: 2 full blocks can be reused
    with make_engine(tiny_llama) as engine:
        engine.generate(prompt, GREEDY)
        engine.generate(prompt, GREEDY)
        stats = engine.stats()
    assert stats["prompt_tokens"] == 74 and stats["prompt_tokens_reused"] == 32
    assert stats["prompt_tokens_computed"] == 42 and stats["hit_rate"] == pytest.approx(32 / 74)
    assert stats["output_tokens"] == 24
    assert stats["tokens_computed"] == 42 + 2 * 11  # prompts minus reuse, plus decodes
    assert stats["num_steps"] == 24 and stats["tiers"] == {}
    assert stats["kv_usage"] == 0.0 and stats["backend"]["num_blocks"] == 64


def test_add_request_and_step_drive_the_loop_and_no_output_is_lost(tiny_llama, references):
    with make_engine(tiny_llama) as engine:
        request_id = engine.add_request(PROMPTS[0], GREEDY)
        assert engine.has_unfinished_requests
        other = engine.generate(PROMPTS[1], GREEDY)[0]  # runs (and may finish) the queued request too
        outputs = []
        while engine.has_unfinished_requests or not outputs:
            outputs.extend(engine.step())
        assert [o.request_id for o in outputs] == [request_id]
        assert outputs[0].token_ids == references[0] and other.token_ids == references[1]
        assert engine.step() == []


def test_abort_finishes_a_request_with_abort_and_frees_its_blocks(tiny_llama):
    with make_engine(tiny_llama) as engine:
        request_id = engine.add_request(list(range(3, 40)), GREEDY)
        engine.step()
        engine.abort(request_id)
        (output,) = engine.step()
        assert output.finish_reason == "abort" and len(output.token_ids) == 1
        assert engine.stats()["kv_num_free_blocks"] == 64 and not engine.has_unfinished_requests


def test_from_config_mapping_and_pool_sizing(tiny_llama):
    mapping = {"engine": {"kv_cache_memory": "1MiB", "block_size": 16}, "cache": {"backend": "radix"}}
    with Engine.from_config(mapping, model=tiny_llama) as engine:
        per_block = 2 * tiny_llama.num_layers * tiny_llama.num_kv_heads * tiny_llama.head_dim * 4 * 16
        assert engine.stats()["kv_num_blocks"] == 2**20 // per_block
        assert engine.backend.name == "radix"
        assert engine.generate("abc", GREEDY)[0].finish_reason == "length"
    with pytest.raises(CoreKVError, match="closed"):
        engine.generate("abc", GREEDY)


class RenamedRadix:
    """A plugin given only as ``Engine.from_config(plugins=...)``: the radix backend under
    another name, so only a config checked against this plugin can name it."""

    @staticmethod
    def corekv_register_backends():
        from corekv.plugin import BackendSpec
        from corekv.plugins.radix import RadixBackend

        return [BackendSpec(name="radix_again", factory=RadixBackend)]


def test_from_config_checks_the_config_and_serves_the_engine_with_one_plugin_manager(tiny_llama, monkeypatch):
    import corekv.config.reader
    import corekv.engine.llm_engine

    made = []
    real = corekv.config.reader.make_plugin_manager

    def counting(*args, **kwargs):  # the real manager, counted
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(corekv.config.reader, "make_plugin_manager", counting)
    monkeypatch.setattr(corekv.engine.llm_engine, "make_plugin_manager", counting)
    mapping = {"engine": {"num_blocks": 16}, "cache": {"backend": "radix_again"}}
    with Engine.from_config(mapping, model=tiny_llama, plugins=[RenamedRadix]) as engine:
        assert made == [engine.plugin_manager] and engine.backend.name == "radix"
        assert engine.generate("abc", GREEDY)[0].finish_reason == "length"


def test_config_errors_name_the_field(tiny_llama):
    """The config reader checks every field once; an engine built from a mapping goes through it."""
    with pytest.raises(ConfigError, match=r"cache.backend.*'radx'.*did you mean 'radix'"):
        Engine.from_config({"model": "tiny", "engine": {"num_blocks": 8}, "cache": {"backend": "radx"}},
                           model=tiny_llama)
    with pytest.raises(ConfigError, match="engine.preemption"):
        Engine.from_config({"model": "tiny", "engine": {"num_blocks": 8, "preemption": "swap"}}, model=tiny_llama)


def test_the_progress_bar_counts_finished_requests(tiny_llama, capsys):
    with make_engine(tiny_llama) as engine:
        engine.generate(["a", "b", "c"], GREEDY, use_tqdm=True)
    assert "3/3" in capsys.readouterr().err
