"""Grain loader and curriculum over small ArrayRecord corpora written here.

Every token of document i of a domain is `base + i` (then eos), so a token names its domain
(token // 1000) and its document; lengths differ per domain so token and document shares differ.
"""

import json
import os

import grain
import jax
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.data import iterator_state, loader
from glm46_jax.data.curriculum import BatchRamp, Curriculum, CurriculumIterator, Phase
from glm46_jax.data.loader import LoaderConfig

EOS, PAD = 1, 0
DOMAINS = {"web": (1000, 12), "code": (2000, 40), "math": (3000, 24)}  # name -> (token base, max length)
DOCS = 150


def write_corpus(root, domains=DOMAINS, docs=DOCS, shards=3, seed=0):
    """The data_prep layout; returns {token id: document length incl. eos}."""
    rng, lengths = np.random.default_rng(seed), {}
    meta = {"tokenizer": {"vocab_size": 4000, "eos_id": EOS, "pad_id": PAD}, "domains": {}}
    for name, (base, max_len) in domains.items():
        os.makedirs(os.path.join(root, name, "train"))
        tokens, rel = 0, []
        for s in range(shards):
            rel.append(f"{name}/train/shard-{s:05d}-of-{shards:05d}.array_record")
            writer = ArrayRecordWriter(os.path.join(root, rel[-1]), "group_size:1")
            for i in range(s, docs, shards):
                doc = np.append(np.full(int(rng.integers(1, max_len)), base + i), EOS).astype("<i4")
                writer.write(doc.tobytes())
                lengths[base + i], tokens = len(doc), tokens + len(doc)
            writer.close()
        meta["domains"][name] = {"train": {"documents": docs, "tokens": tokens, "shards": rel}}
    with open(os.path.join(root, "metadata.json"), "w") as f:
        json.dump(meta, f)
    return lengths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corpus"))
    return root, write_corpus(root)


def cfg_for(root, **kw):
    kw = {"read_threads": 2, "prefetch_documents": 16, "pack_bins": 8, "process_index": 0, "process_count": 1, **kw}
    return LoaderConfig(root, **kw)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def reference_row_fields(tokens):
    """Hand reference for a packed row of L+1 tokens: (segment ids, positions) of all L+1, loss mask of L.

    A segment ends after eos (or at the row end); pad is segment 0.
    """
    seg, pos, s, p = np.zeros(len(tokens), np.int32), np.zeros(len(tokens), np.int32), 1, 0
    for i, t in enumerate(tokens):
        if t == PAD:
            continue
        seg[i], pos[i] = s, p
        s, p = (s + 1, 0) if t == EOS else (s, p + 1)
    mask = (seg[1:] == seg[:-1]) & (seg[:-1] != 0)
    return seg, pos, mask.astype(np.int32)


# --- determinism and process sharding ------------------------------------------------------------

def test_same_seed_same_batches_other_seed_other_batches(corpus):
    root, _ = corpus
    weights = {"web": 1, "code": 1}

    def batches(seed):
        return take(iter(loader.training_batches(cfg_for(root, seed=seed), weights, 32, 4)), 5)

    first = batches(0)
    assert_same_batches(first, batches(0))
    assert not np.array_equal(first[0]["inputs"], batches(1)[0]["inputs"])
    assert all(b[k].dtype == np.int32 and b[k].shape == (4, 32) for b in first for k in b)


def test_processes_read_disjoint_documents_that_cover_the_domain(corpus):
    root, _ = corpus
    seen = []
    for index in range(2):
        cfg = cfg_for(root, num_epochs=1, process_index=index, process_count=2)
        seen.append([int(d["tokens"][0]) for d in loader.domain_documents(cfg, "code")])
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(2000, 2000 + DOCS))
    per_process = [next(iter(loader.training_batches(cfg_for(root, process_index=i, process_count=2),
                                                     {"code": 1}, 16, 8))) for i in range(2)]
    assert per_process[0]["inputs"].shape == (4, 16)  # global batch 8 over 2 processes
    assert set(per_process[0]["inputs"].ravel()).isdisjoint(set(per_process[1]["inputs"].ravel()) - {EOS})


# --- mixture -------------------------------------------------------------------------------------

def token_domains(batch):
    """Domain (token // 1000) of every real input token; an eos counts with its document."""
    x, seg = batch["inputs"], batch["segment_ids"]
    dom = x // 1000
    prev = np.pad(dom[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    same = np.pad(seg[:, 1:] == seg[:, :-1], ((0, 0), (1, 0)))
    dom = np.where(x == EOS, np.where(same, prev, -1), dom)
    return dom[(seg > 0) & (dom >= 0)], prev[(x == EOS) & same]


def test_mixture_shares_match_the_weights(corpus):
    root, _ = corpus
    weights = {"web": 5, "code": 3, "math": 2}  # need not sum to 1
    for unit in ("tokens", "documents"):
        it = iter(loader.training_batches(cfg_for(root, weight_unit=unit), weights, 64, 8))
        tokens, doc_ends = map(np.concatenate, zip(*(token_domains(b) for b in take(it, 250)), strict=True))
        counted = tokens if unit == "tokens" else doc_ends  # "documents": shares of documents (eos count)
        share = np.bincount(counted, minlength=4)[1:] / len(counted)
        np.testing.assert_allclose(share, [0.5, 0.3, 0.2], atol=0.02, err_msg=unit)


def test_zero_weight_domains_are_left_out(corpus):
    root, _ = corpus
    batch = next(iter(loader.training_batches(cfg_for(root), {"web": 1, "code": 0, "math": 1}, 64, 8)))
    assert not np.any(batch["inputs"] // 1000 == 2)
    assert loader.document_weights(cfg_for(root), {"web": 1, "code": 0}).keys() == {"web"}


# --- packing -------------------------------------------------------------------------------------

def _pack(docs, row_len, mode, bins=2):
    ds = grain.MapDataset.source([{"tokens": np.asarray(d, np.int32)} for d in docs]).to_iter_dataset()
    return [loader.shift_row(r, PAD) for r in loader.pack_documents(ds, row_len, mode, PAD, bins)]


def test_concat_rows_hand_computed():
    a, b, c = [5, 5, 1], [6, 6, 6, 6, 1], [7, 7, 7, 1]
    rows = _pack([a, b, c], 6, "concat")  # stream 5 5 1 6 6 6 | 6 1 7 7 7 1
    expect = [{"inputs": [5, 5, 1, 6, 6], "targets": [5, 1, 6, 6, 6], "segment_ids": [1, 1, 1, 2, 2],
                   "positions": [0, 1, 2, 0, 1], "loss_mask": [1, 1, 0, 1, 1]},
              {"inputs": [6, 1, 7, 7, 7], "targets": [1, 7, 7, 7, 1], "segment_ids": [1, 1, 2, 2, 2],
                   "positions": [0, 1, 0, 1, 2], "loss_mask": [1, 0, 1, 1, 1]}]
    assert_same_batches(rows, [{k: np.array(v, np.int32) for k, v in e.items()} for e in expect])


def test_best_fit_rows_hand_computed_and_long_documents_split_with_overlap():
    a, b, c, d = [5, 5, 1], [6, 6, 6, 6, 1], [7, 1], [8, 8, 8, 1]
    rows = _pack([a, b, c, d], 6, "best_fit")
    # best fit into 2 bins: a -> bin 0, b -> bin 1, c -> bin 0 (tighter); d fits nowhere -> next round.
    got = sorted(({k: v.tolist() for k, v in r.items()} for r in rows), key=lambda r: r["inputs"])
    assert got == [
        {"inputs": [5, 5, 1, 7, 1], "targets": [5, 1, 7, 1, 0], "segment_ids": [1, 1, 1, 2, 2],
             "positions": [0, 1, 2, 0, 1], "loss_mask": [1, 1, 0, 1, 0]},
        {"inputs": [6, 6, 6, 6, 1], "targets": [6, 6, 6, 1, 0], "segment_ids": [1, 1, 1, 1, 1],
             "positions": [0, 1, 2, 3, 4], "loss_mask": [1, 1, 1, 1, 0]},
        {"inputs": [8, 8, 8, 1, 0], "targets": [8, 8, 1, 0, 0], "segment_ids": [1, 1, 1, 1, 0],
             "positions": [0, 1, 2, 3, 0], "loss_mask": [1, 1, 1, 0, 0]}]
    long = list(range(10, 23)) + [1]  # 14 tokens, rows of 6: pieces [0:6], [5:11], [10:14]
    rows = _pack([long], 6, "best_fit", bins=4)
    targets = sorted(t for r in rows for t, m in zip(r["targets"], r["loss_mask"], strict=True) if m)
    assert targets == sorted(long[1:])  # every next-token target exactly once, nothing truncated
    assert all(r["positions"][0] == 0 for r in rows)


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_loader_rows_match_reference(corpus, mode):
    root, lengths = corpus
    seq_len = 64  # rows of 65 tokens hold every document (the longest has 40)
    for batch in take(iter(loader.training_batches(cfg_for(root), {"web": 2, "code": 1, "math": 1},
                                                   seq_len, 4, mode)), 20):
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        for r in range(4):
            tokens = np.append(batch["inputs"][r], batch["targets"][r, -1])  # the packed row, L + 1
            seg, pos, mask = reference_row_fields(tokens)
            np.testing.assert_array_equal(batch["segment_ids"][r], seg[:-1])
            np.testing.assert_array_equal(batch["positions"][r], pos[:-1])
            np.testing.assert_array_equal(batch["loss_mask"][r], mask)
            if mode == "concat":
                assert (seg > 0).all()  # no padding
            else:  # best fit never splits a document that fits: every segment is a whole document
                for s in range(1, seg.max() + 1):
                    doc = tokens[seg == s]
                    assert len(doc) == lengths[int(doc[0])] and doc[-1] == EOS


@pytest.mark.slow
def test_packed_documents_give_the_same_logits_as_alone(mesh1):
    from glm46_jax.config import get_preset
    from glm46_jax.model import apply, init_model
    cfg = get_preset("tiny")
    graphdef, params, buffers = init_model(cfg, mesh1, 0)
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, cfg.vocab_size, n), EOS) for n in (6, 9, 4)]
    (row,) = _pack(docs, 24, "best_fit", bins=1)
    assert row["segment_ids"].max() == 3 and (row["segment_ids"] == 0).any()

    def logits(r):
        with sharding.use_mesh(mesh1):
            args = [jax.device_put(np.asarray(r[k])[None], jax.NamedSharding(mesh1, sharding.logical("batch", "seq")))
                    for k in ("inputs", "positions", "segment_ids")]
            return np.asarray(apply(graphdef, params, buffers, *args, with_mtp=False).logits[0])

    packed = logits(row)
    start = 0
    for doc in docs:
        n = len(doc)
        alone = logits({"inputs": doc.astype(np.int32), "positions": np.arange(n, dtype=np.int32),
                        "segment_ids": np.ones(n, np.int32)})
        np.testing.assert_allclose(packed[start:start + n], alone, atol=1e-5)
        start += n
    unmasked = logits({**row, "segment_ids": np.ones_like(row["segment_ids"])})
    assert not np.allclose(unmasked[7:17], packed[7:17], atol=1e-3)  # the mask is what isolates them


# --- iterator state ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_iterator_resumes_exactly_from_json_state(corpus, mode):
    root, _ = corpus
    ds = loader.training_batches(cfg_for(root), {"web": 1, "code": 1, "math": 1}, 16, 2, mode)
    it, states, batches = iter(ds), [], []
    for _ in range(60):
        states.append(json.loads(json.dumps(iterator_state.to_json(it))))
        batches.append(next(it))
    resume_at = {0, 1, 2, 7, 30, 55}
    if mode == "concat":  # a row ended exactly at a document end: the restore grain gets wrong from JSON
        resume_at.add(next(k for k, s in enumerate(states) if k and s["remainder_slices"]["tokens"] == [-1, -1]))
    for k in sorted(resume_at):
        resumed = iter(ds)
        iterator_state.restore(resumed, states[k])
        assert_same_batches(take(resumed, 4), batches[k:k + 4])


@pytest.mark.slow
def test_multiprocess_prefetch_resumes_exactly(corpus):
    root, _ = corpus
    ds = loader.training_batches(cfg_for(root, num_workers=2), {"web": 1, "code": 1}, 16, 2, "concat")
    it = iter(ds)
    take(it, 3)
    state = json.loads(json.dumps(iterator_state.to_json(it)))
    expected = take(it, 4)
    resumed = iter(ds)
    iterator_state.restore(resumed, state)
    assert_same_batches([{k: np.array(v) for k, v in b.items()} for b in take(resumed, 4)],
                        [{k: np.array(v) for k, v in b.items()} for b in expected])
    it.close()
    resumed.close()


def test_to_global_shards_rows_over_the_batch_axes():
    mesh = sharding.make_mesh({"data": 4, "expert": 2})
    local = {"inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4)}
    out = loader.to_global(local, mesh)["inputs"]
    assert out.shape == (8, 4) and out.sharding.spec == sharding.logical("batch", "seq")
    np.testing.assert_array_equal(np.asarray(out), local["inputs"])
    # Gradient accumulation: rows 0-7 are micro-batch 0, rows 8-15 micro-batch 1; the micro-batch axis is
    # not sharded, the rows within one are. global_rows (every process holds the whole batch) lays out
    # the same array.
    local = {"inputs": np.arange(16 * 4, dtype=np.int32).reshape(16, 4)}
    for global_rows in (False, True):
        acc = loader.to_global(local, mesh, accum_steps=2, global_rows=global_rows)["inputs"]
        assert acc.shape == (2, 8, 4) and acc.sharding.spec == sharding.logical(None, "batch", "seq")
        np.testing.assert_array_equal(np.asarray(acc)[1, 2], [40, 41, 42, 43])


# --- curriculum ----------------------------------------------------------------------------------

def small_curriculum():
    return Curriculum((
        Phase("pretrain", tokens=16 * 4 * 5 + 10, seq_len=16, global_batch=4, mixture={"web": 1, "code": 1},
              rope_theta=1e4, batch_ramp=BatchRamp(start_rows=2, ramp_tokens=100, increment=2)),
        Phase("midtrain", tokens=32 * 2 * 4, seq_len=32, global_batch=2, mixture={"code": 1, "math": 3},
              rope_theta=1e6, pack="best_fit"),
    ))


def run(iterator):
    out = []
    for phase, batch in iterator:
        out.append((phase.name, iterator.tokens_seen, batch))
    return out


def test_curriculum_switches_exactly_at_the_token_boundary(corpus):
    root, _ = corpus
    cur = small_curriculum()
    assert cur.ends == (330, 586) and cur.phase_at(0) == 0 and cur.phase_at(329) == 0 and cur.phase_at(330) == 1
    steps = run(CurriculumIterator(cur, cfg_for(root)))
    before = [0] + [t for _, t, _ in steps[:-1]]
    for (name, _, batch), start in zip(steps, before, strict=True):
        assert name == cur.phases[cur.phase_at(start)].name  # the phase is the one its first token is in
        assert batch["inputs"].shape[1] == (16 if name == "pretrain" else 32)
    rows = [b["inputs"].shape[0] for name, _, b in steps if name == "pretrain"]
    assert rows == [2, 2, 2, 2, 4, 4, 4, 4]  # ramp: 2 rows while tokens < 100, then 4 (multiples of 2)
    assert steps[-1][1] >= cur.total_tokens and before[-1] < cur.total_tokens
    assert not any(np.any(b["inputs"] // 1000 == 1) for name, _, b in steps if name == "midtrain")


def test_curriculum_resumes_exactly_mid_phase_and_at_the_boundary(corpus):
    root, _ = corpus
    cur, cfg = small_curriculum(), cfg_for(root)
    it, states, steps = CurriculumIterator(cur, cfg), [], []
    while True:
        states.append(json.dumps(it.get_state()))
        try:
            steps.append(next(it))
        except StopIteration:
            break
    boundary = next(i for i, (p, _) in enumerate(steps) if p.name == "midtrain")
    assert json.loads(states[boundary])["phase_name"] == "pretrain"  # saved right before the switch
    for k in range(len(steps)):
        resumed = CurriculumIterator(cur, cfg, state=json.loads(states[k]))
        rest = list(resumed)
        assert [p.name for p, _ in rest] == [p.name for p, _ in steps[k:]]
        assert_same_batches([b for _, b in rest], [b for _, b in steps[k:]])
        assert resumed.get_state()["tokens_seen"] == it.tokens_seen and resumed.step == it.step
    # The switch carries every domain's position: phase 2 goes on with "code" where phase 1 stopped
    # (re-reading at most the document that was split at phase 1's last row), not from its start.
    order = [int(d["tokens"][0]) for d in take(iter(loader.domain_documents(cfg, "code")), 80)]

    def code_ids(batches):
        return {int(t) for b in batches for t in b["inputs"].ravel() if t // 1000 == 2}

    last_pre = max(order.index(t) for t in code_ids(b for _, b in steps[:boundary]))
    first_mid = min(order.index(t) for t in code_ids(b for _, b in steps[boundary:]))
    assert last_pre - 1 <= first_mid <= last_pre + 1


# --- errors --------------------------------------------------------------------------------------

def test_clear_errors(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(ValueError, match=r"unknown domains \['wiki'\]"):
        loader.training_batches(cfg_for(root), {"web": 1, "wiki": 1}, 16, 4)
    with pytest.raises(ValueError, match="at least one domain needs a positive weight"):
        loader.training_batches(cfg_for(root), {"web": 0}, 16, 4)
    with pytest.raises(ValueError, match="seq_len=0"):
        loader.training_batches(cfg_for(root), {"web": 1}, 0, 4)
    with pytest.raises(ValueError, match="global batch 5 must be a positive multiple of the 2"):
        loader.training_batches(cfg_for(root, process_count=2), {"web": 1}, 16, 5)
    with pytest.raises(ValueError, match="pack mode 'greedy'"):
        loader.training_batches(cfg_for(root), {"web": 1}, 16, 4, "greedy")
    with pytest.raises(FileNotFoundError, match="metadata.json not found"):
        loader.training_batches(cfg_for(str(tmp_path)), {"web": 1}, 16, 4)
    # A domain listed in metadata.json whose directory is missing or empty.
    write_corpus(str(tmp_path / "c"), {"web": (1000, 8)}, docs=4, shards=1)
    meta = json.loads((tmp_path / "c" / "metadata.json").read_text())
    meta["domains"]["books"] = {"train": {"documents": 1, "tokens": 1, "shards": []}}
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match="domain 'books' has no train shards"):
        loader.training_batches(cfg_for(str(tmp_path / "c")), {"books": 1}, 16, 4)
    (tmp_path / "c" / "books" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="domain 'books' has no train shards"):
        loader.training_batches(cfg_for(str(tmp_path / "c")), {"books": 1}, 16, 4)
    # A record that is not an eos-terminated document of the tokenizer's ids.
    writer = ArrayRecordWriter(str(tmp_path / "c" / "books" / "train" / "shard-00000-of-00001.array_record"),
                               "group_size:1")
    writer.write(np.array([5, 6, 7], "<i4").tobytes())
    writer.close()
    with pytest.raises(ValueError, match="domain 'books': a document does not end in eos_id=1"):
        next(iter(loader.training_batches(cfg_for(str(tmp_path / "c")), {"books": 1}, 16, 4)))
    with pytest.raises(ValueError, match="split='dev'"):
        LoaderConfig(root, split="dev")


def test_invalid_phases_and_curricula_say_what_is_wrong(corpus):
    root, _ = corpus
    ok = {"name": "p", "tokens": 1000, "seq_len": 16, "global_batch": 4, "mixture": {"web": 1}, "rope_theta": 1e4}
    # InputError: the train CLI prints it as one line naming the config path (exit 2).
    for change, message in [({"seq_len": 0}, "data.phases.p.seq_len=0: "),
                            ({"global_batch": 0}, "data.phases.p.global_batch=0: "),
                            ({"mixture": {"web": 0}}, "positive weight"), ({"pack": "greedy"}, "data.phases.p.pack="),
                            ({"batch_ramp": BatchRamp(3, 100, 2)}, "data.phases.p.batch_ramp"),
                            ({"batch_ramp": BatchRamp(4, 100, 2)}, "data.phases.p.batch_ramp")]:
        with pytest.raises(InputError, match=message):
            Phase(**{**ok, **change})
    with pytest.raises(InputError, match=r"data.phases.q.tokens=10: less than one batch of the previous phase"):
        Curriculum((Phase(**ok), Phase(**{**ok, "name": "q", "tokens": 10})))
    with pytest.raises(InputError, match="unique"):
        Curriculum((Phase(**ok), Phase(**ok)))
    with pytest.raises(InputError, match="does not split over 3"):
        CurriculumIterator(Curriculum((Phase(**ok),)), cfg_for(root, process_count=3))
    with pytest.raises(ValueError, match="does not have at that index"):
        CurriculumIterator(Curriculum((Phase(**ok),)), cfg_for(root),
                           state={"phase_index": 0, "phase_name": "other", "tokens_seen": 0, "step": 0, "data": None})


def test_glm45_schedule_from_the_config_file():
    """configs/pretrain.py:glm45 is GLM-4.5's curriculum (docs/training.md#curriculum), checked against the
    report's numbers."""
    import importlib.util

    from glm46_jax.data.curriculum import from_config, num_steps

    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "pretrain.py")
    spec = importlib.util.spec_from_file_location("pretrain_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("glm45")
    cur = from_config(config.data.phases, config.data.phase_order)
    T, B = 10**12, 10**9
    assert [(p.name, p.tokens, p.seq_len, p.rope_theta, p.pack) for p in cur.phases] == [
        ("general", 15 * T, 4096, 1e4, "concat"), ("code_reasoning", 7 * T, 4096, 1e4, "concat"),
        ("repo_code", 500 * B, 32768, 1e6, "best_fit"), ("synthetic_reasoning", 500 * B, 32768, 1e6, "best_fit"),
        ("long_context_agent", 100 * B, 131072, 1e6, "best_fit")]
    assert cur.total_tokens == 23_100 * B
    general = cur.phases[0]
    # The batch ramps 16M -> 64M tokens over the first 500B tokens, in 4M-token (1024-row) steps.
    assert [general.rows_at(t) * 4096 for t in (0, 250 * B, 500 * B, 14 * T)] == [
        2**24, (4096 + 6 * 1024) * 4096, 2**26, 2**26]
    assert all(p.global_batch * p.seq_len == 2**26 for p in cur.phases)  # 64M tokens per step after the ramp
    assert [cur.phase_at(t) for t in (15 * T - 1, 15 * T, 22 * T, 22_500 * B, 23 * T)] == [0, 1, 2, 3, 4]
    # Steps: past the ramp every phase spends its tokens 64M at a time, so 23.1T / 64M = 344,216.8 is a lower
    # bound and the ramp (average ~40M tokens/step over 500B) adds at most 500B / 16M - 500B / 64M = 22,352.
    assert 344_217 < num_steps(cur) < 344_217 + 22_352 + len(cur.phases)
