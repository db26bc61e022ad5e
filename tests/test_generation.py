"""Generation: greedy determinism, seeds, stop strings and tokens, max tokens, overflow, streaming."""

from __future__ import annotations

import codecs

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.errors import ContextOverflowError, InvalidRequestError
from realizar.generation import Generator, SamplingParams, StopStringMatcher, TokenChunk
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from realizar.text.tokenizer import Tokenizer
from tests.gguf_factory import make_gguf_model
from tests.helpers import examples

# ----------------------------------------------------------------------------------------------
# Fakes: a model that emits a fixed script, a tokenizer whose tokens are byte strings


class ScriptedModel:
    """Logits that make token ``script[i]`` the argmax at generation step ``i``."""

    def __init__(self, script, vocab: int, context_length: int = 64):
        self.script, self.vocab, self.context_length = list(script), vocab, context_length
        self.calls: list[tuple[str, object]] = []
        self.reset()

    def reset(self):
        self.pos = 0
        self.step = 0

    def _logits(self):
        z = np.zeros(self.vocab, np.float32)
        z[self.script[min(self.step, len(self.script) - 1)]] = 10.0
        self.step += 1
        return z

    def prefill(self, ids):
        self.calls.append(("prefill", list(ids)))
        self.pos += len(ids)
        assert self.pos <= self.context_length
        return self._logits()

    def decode(self, tok):
        self.calls.append(("decode", tok))
        self.pos += 1
        assert self.pos <= self.context_length
        return self._logits()


class ByteStreamDecoder:
    """Deltas of a byte-piece stream: incomplete UTF-8 held back, flushed as U+FFFD at the end."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id):
        return self.utf8.decode(self.pieces[token_id])

    def flush(self):
        return self.utf8.decode(b"", final=True)


class ByteTokenizer:
    """Token i is ``pieces[i]`` (bytes); id 0 is EOS."""

    def __init__(self, pieces):
        self.pieces = [p if isinstance(p, bytes) else p.encode() for p in pieces]
        self.eos_token_ids = (0,)

    def encode(self, text):
        return [1] * max(1, len(text) // 4)

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens=False):
        return ByteStreamDecoder(self.pieces)


PIECES = ["<eos>", "x", "Hello", " wor", "ld", "!", " ST", "OP", " more", b"\xc3", b"\xa9", "S", "T"]
P = {p if isinstance(p, str) else p: i for i, p in enumerate(PIECES)}


def run(script, params, pieces=PIECES, prompt="prompt text", ctx=64):
    model = ScriptedModel(script, len(pieces), ctx)
    gen = Generator(model, ByteTokenizer(pieces))
    stream = gen.stream(prompt, params)
    chunks = list(stream)
    result = gen.generate(prompt, params)
    return chunks, stream.result, result, model


def ids(*names):
    return [P[n] for n in names]


# ----------------------------------------------------------------------------------------------
# Stop strings


def test_stop_string_split_across_tokens_is_cut_and_never_emitted():
    script = ids("Hello", " wor", "ld", " ST", "OP", " more", " more")
    chunks, sres, res, _ = run(script, SamplingParams(max_tokens=10, stop=(" STOP",)))
    assert res.text == "Hello world" and res.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == "Hello world"
    assert [c.text for c in chunks] == ["Hello", " wor", "ld", "", ""]  # " ST" held, then cut
    assert res.token_ids == script[:5] and res.completion_tokens == 5
    assert (sres.text, sres.token_ids, sres.finish_reason) == (res.text, res.token_ids, res.finish_reason)


def test_held_prefix_is_released_when_no_stop_follows():
    script = ids("Hello", " ST", "ld", "!")
    chunks, _, res, _ = run(script, SamplingParams(max_tokens=4, stop=(" STOP",)))
    assert [c.text for c in chunks] == ["Hello", "", " STld", "!"]
    assert res.text == "Hello STld!" and res.finish_reason == "length"


def test_held_prefix_is_released_at_max_tokens_and_at_eos():
    _, _, res, _ = run(ids("Hello", " ST"), SamplingParams(max_tokens=2, stop=(" STOP",)))
    assert res.text == "Hello ST" and res.finish_reason == "length"
    chunks, _, res, _ = run(ids("Hello", " ST", "<eos>"), SamplingParams(max_tokens=9, stop=(" STOP",)))
    assert res.text == "Hello ST" and res.finish_reason == "stop"
    assert chunks[-1] == TokenChunk(0, " ST") and res.token_ids[-1] == 0


def test_stop_inside_one_token_and_earliest_of_several():
    _, _, res, _ = run(ids("Hello", " wor", "ld"), SamplingParams(max_tokens=5, stop=("ll", "o w")))
    assert res.text == "He" and res.finish_reason == "stop" and res.completion_tokens == 1
    _, _, res, _ = run(ids("Hello", " wor", "ld"), SamplingParams(max_tokens=5, stop=("rld", "wor")))
    assert res.text == "Hello " and res.completion_tokens == 2


def test_stop_string_made_of_single_letters():
    _, _, res, _ = run(ids("x", "S", "x", "S", "T", "x"), SamplingParams(max_tokens=9, stop=("ST",)))
    assert res.text == "xSx" and res.finish_reason == "stop"


@settings(max_examples=examples(300), deadline=None)
@given(
    text=st.text(alphabet="abcS T", max_size=40),
    stops=st.lists(st.text(alphabet="abcST", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_stop_matcher_property(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # The stop string completed first (smallest end, then longest) cuts the text, whatever the split.
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(found)[1]] if found else text
    m = StopStringMatcher(stops)
    out = ""
    for p in pieces:
        out += m.feed(p)
        assert expected.startswith(out)
        assert not any(s in out for s in stops)
        if m.stopped:
            break
    out += m.release()
    assert out == expected
    assert m.stopped == bool(found)


# ----------------------------------------------------------------------------------------------
# Tokens, limits, streaming


def test_eos_and_stop_token_ids():
    chunks, _, res, _ = run(ids("Hello", "!", "<eos>", "x"), SamplingParams(max_tokens=9))
    assert res.text == "Hello!" and res.finish_reason == "stop" and res.token_ids == ids("Hello", "!", "<eos>")
    assert res.completion_tokens == 3 and chunks[-1].text == ""
    _, _, res, _ = run(ids("Hello", "!", "x"), SamplingParams(max_tokens=9, stop_token_ids=(P["!"],)))
    assert res.text == "Hello" and res.finish_reason == "stop"


def test_max_tokens():
    script = ids("x") * 20
    chunks, _, res, model = run(script, SamplingParams(max_tokens=7))
    assert res.completion_tokens == 7 and len(chunks) == 7 and res.text == "x" * 7
    assert res.finish_reason == "length"
    # run() generated twice (stream + generate); each: one prefill, 6 decodes (the last token is
    # not fed back to the model)
    assert [c[0] for c in model.calls] == (["prefill"] + ["decode"] * 6) * 2
    chunks, _, res, model = run(script, SamplingParams(max_tokens=0))
    assert chunks == [] and res.text == "" and res.completion_tokens == 0 and res.finish_reason == "length"


def test_multibyte_character_split_across_tokens():
    chunks, _, res, _ = run(ids("x", b"\xc3", b"\xa9", "x"), SamplingParams(max_tokens=4))
    assert [c.text for c in chunks] == ["x", "", "é", "x"] and res.text == "xéx"
    # an incomplete character at the end is flushed (as U+FFFD), not lost
    _, _, res, _ = run(ids("x", b"\xc3"), SamplingParams(max_tokens=2))
    assert res.text == "x\ufffd"


def test_context_overflow_names_the_numbers():
    model = ScriptedModel(ids("x"), len(PIECES), context_length=10)
    gen = Generator(model, ByteTokenizer(PIECES))
    with pytest.raises(ContextOverflowError, match=r"6 tokens.*max_tokens 5.*11.*10"):
        gen.generate([1] * 6, SamplingParams(max_tokens=5))
    assert model.calls == []  # refused before running anything
    assert gen.generate([1] * 6, SamplingParams(max_tokens=4)).completion_tokens == 4


@pytest.mark.parametrize(
    "kw",
    [{"max_tokens": -1}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"repetition_penalty": 0.0},
     {"stop": ("",)}, {"stop": "STOP"}],  # fmt: skip
)
def test_invalid_params(kw):
    gen = Generator(ScriptedModel(ids("x"), len(PIECES)), ByteTokenizer(PIECES))
    with pytest.raises(InvalidRequestError):
        gen.generate("hi", SamplingParams(**kw))


def test_empty_prompt():
    gen = Generator(ScriptedModel(ids("x"), len(PIECES)), ByteTokenizer(PIECES))
    with pytest.raises(InvalidRequestError):
        gen.generate([], SamplingParams())


def test_stream_can_be_abandoned_and_generation_restarts_clean():
    model = ScriptedModel(ids("x") * 10, len(PIECES))
    gen = Generator(model, ByteTokenizer(PIECES))
    s = gen.stream("hi", SamplingParams(max_tokens=8))
    next(s), next(s)
    s.close()
    assert s.result is None
    assert gen.generate("hi", SamplingParams(max_tokens=3)).text == "xxx"


# ----------------------------------------------------------------------------------------------
# A real (tiny, random) model with a real tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("gen"), "Q8_0", seed=3)
    loaded = load_model(path)
    tok = Tokenizer.from_gguf_metadata(loaded.metadata)
    model = ReferenceModel.from_loaded(loaded)
    return Generator(model, tok), model, tok


PROMPT = "the and of to in is was for on that"


def test_greedy_is_deterministic_and_equals_manual_argmax(tiny):
    gen, model, tok = tiny
    p = SamplingParams(max_tokens=20)
    a, b = gen.generate(PROMPT, p), gen.generate(PROMPT, p)
    assert a.token_ids == b.token_ids and a.text == b.text
    prompt_ids = tok.encode(PROMPT)
    assert a.prompt_tokens == len(prompt_ids)
    model.reset()
    logits, manual = model.prefill(prompt_ids), []
    for _ in range(a.completion_tokens):
        manual.append(int(np.argmax(logits)))
        if manual[-1] in tok.eos_token_ids:
            break
        logits = model.decode(manual[-1])
    assert manual == a.token_ids


def test_seed_reproducibility(tiny):
    gen, _, _ = tiny
    p = SamplingParams(max_tokens=25, temperature=1.5, top_k=50, top_p=0.95, seed=1234)
    a, b = gen.generate(PROMPT, p), gen.generate(PROMPT, p)
    assert a.token_ids == b.token_ids and a.text == b.text
    others = [gen.generate(PROMPT, SamplingParams(max_tokens=25, temperature=1.5, seed=s)).token_ids for s in range(3)]
    assert any(o != a.token_ids for o in others)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streaming_equals_non_streaming(tiny, temperature):
    gen, _, tok = tiny
    p = SamplingParams(max_tokens=30, temperature=temperature, seed=7, repetition_penalty=1.3)
    stream = gen.stream(PROMPT, p)
    chunks = list(stream)
    seen = []
    res = gen.generate(PROMPT, p, on_chunk=seen.append)
    assert seen == chunks
    assert [c.token_id for c in chunks] == res.token_ids
    assert "".join(c.text for c in chunks) == res.text
    assert stream.result.text == res.text and stream.finish_reason == res.finish_reason
    eos = set(tok.eos_token_ids)
    assert res.text == tok.decode([t for t in res.token_ids if t not in eos], skip_special_tokens=True)
    assert res.prefill_seconds > 0 and (res.decode_seconds > 0 or res.completion_tokens <= 1)


def test_real_tokenizer_stop_string(tiny):
    gen, _, _ = tiny
    res = gen.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=3))
    text = res.text
    if len(text) < 4:
        pytest.skip("the random model stopped at once")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = gen.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop=(stop,)))
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"
    assert cut.token_ids == res.token_ids[: len(cut.token_ids)]


def test_logits_processors_run_in_order_before_sampling():
    """Each step's logits pass through the processors (here: ban the greedy token, then record) before the
    sampler sees them; they get the tokens generated so far."""
    from realizar.generation import Generator, SamplingParams

    class Fixed:
        context_length = 64

        def reset(self):
            pass

        def prefill(self, ids):
            return np.arange(8, dtype=np.float32)

        def decode(self, tok):
            return np.arange(8, dtype=np.float32)

    seen = []

    def ban_top(generated, logits):
        logits[int(np.argmax(logits))] = -np.inf
        return logits

    def record(generated, logits):
        seen.append((list(generated), int(np.argmax(logits))))
        return logits

    class Tok:
        eos_token_ids = ()

        def encode(self, text, add_special_tokens=True):
            return [1]

        def stream_decoder(self, skip_special_tokens=True):
            class D:
                def step(self, t):
                    return str(t)

                def flush(self):
                    return ""
            return D()

    gen = Generator(Fixed(), Tok(), eos_token_ids=())
    result = gen.generate([1, 2], SamplingParams(max_tokens=3, logits_processors=(ban_top, record)))
    assert result.token_ids == [6, 6, 6]
    assert seen == [([], 6), ([6], 6), ([6, 6], 6)]
