"""The offline byte-level corpus: tokenizer round trip, deterministic corpus and batches."""

import numpy as np
import pytest

from glm46_jax.data import bytes_corpus as bc


@pytest.fixture(scope="module")
def corpus():
    return bc.stdlib_docstrings()


@pytest.mark.parametrize("text", ["", "hello world", "naïve café — ✓ 𝛑 ünïcödé\n\ttabs", "\x00\x7f"])
def test_tokenizer_round_trips(text):
    ids = bc.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert ids.size == 0 or (ids.min() >= bc.BYTE_OFFSET and ids.max() < bc.VOCAB_SIZE)
    assert bc.decode(ids) == text


def test_decode_special_ids():
    ids = np.concatenate([bc.encode("ab"), [bc.EOS_ID, bc.PAD_ID], bc.encode("c")])
    assert bc.decode(ids) == "ab\nc"  # eos -> newline, pad dropped
    assert bc.VOCAB_SIZE == 258 and bc.PAD_ID == 0 and bc.EOS_ID == 1


def test_corpus_is_real_deterministic_text(corpus):
    again = bc.stdlib_docstrings()
    np.testing.assert_array_equal(corpus.train, again.train)
    np.testing.assert_array_equal(corpus.heldout, again.heldout)
    assert len(corpus.train) > 200_000 and len(corpus.heldout) > 10_000
    assert not set(corpus.train_modules) & set(corpus.heldout_modules)
    assert len(corpus.heldout_modules) == (len(corpus.train_modules) + len(corpus.heldout_modules)) // 10
    for stream in (corpus.train, corpus.heldout):
        assert stream.dtype == np.int32 and stream.min() >= bc.EOS_ID and stream.max() < bc.VOCAB_SIZE
        assert stream[-1] == bc.EOS_ID  # every document ends with eos
    assert "Return" in bc.decode(corpus.train[:200_000])  # it is English prose


def test_missing_modules_are_skipped_and_none_found_raises():
    c = bc.stdlib_docstrings(("json", "no_such_module_xyz"), holdout_every=10)
    assert c.train_modules == ("json",) and c.heldout_modules == ()
    with pytest.raises(FileNotFoundError):
        bc.stdlib_docstrings(("no_such_module_xyz",))


def test_train_batches_are_shifted_windows_and_seeded(corpus):
    b = bc.train_batch(corpus.train, step=3, batch_size=4, seq_len=32, seed=0)
    assert b["inputs"].shape == b["targets"].shape == (4, 32)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])  # next-token targets
    again = bc.train_batch(corpus.train, step=3, batch_size=4, seq_len=32, seed=0)
    np.testing.assert_array_equal(b["inputs"], again["inputs"])
    other_step = bc.train_batch(corpus.train, step=4, batch_size=4, seq_len=32, seed=0)
    other_seed = bc.train_batch(corpus.train, step=3, batch_size=4, seq_len=32, seed=1)
    assert not np.array_equal(b["inputs"], other_step["inputs"])
    assert not np.array_equal(b["inputs"], other_seed["inputs"])
    it = bc.train_batches(corpus.train, 4, 32, seed=0, start_step=3)
    np.testing.assert_array_equal(next(it)["inputs"], b["inputs"])  # resumable by step
    np.testing.assert_array_equal(next(it)["inputs"], other_step["inputs"])


def test_eval_batches_are_fixed_consecutive_windows(corpus):
    batches = bc.eval_batches(corpus.heldout, batch_size=2, seq_len=16, num_batches=3)
    assert len(batches) == 3
    flat = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches])
    np.testing.assert_array_equal(flat.reshape(-1), corpus.heldout[: 6 * 17])
    short = np.arange(2, 12, dtype=np.int32)  # 10 tokens: one window of 4 + 1, reused
    wrapped = bc.eval_batches(short, batch_size=3, seq_len=4, num_batches=1)[0]
    assert wrapped["inputs"].shape == (3, 4)
    np.testing.assert_array_equal(wrapped["inputs"][0], wrapped["inputs"][2])
