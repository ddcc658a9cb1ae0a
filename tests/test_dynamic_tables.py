"""Dynamic embedding tables (recloop_kernels.dynamic): admission, eviction, fallback rows, deltas.

The id → row assignment is checked against the plain-Python reference (dynamic_reference.py) on random
streams; the pooled outputs and updated rows with the Triton kernels (interpreter on a CPU) against the
PyTorch reference backend over the same slots.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from safetensors.torch import load, save

from recloop_kernels import TableConfig
from recloop_kernels.dynamic import DynamicEmbeddingBagCollection, DynamicTableConfig, keyed_initial_rows
from recloop_kernels.dynamic_reference import ReferenceSlotMap
from recloop_kernels.slot_map import MASK64, PROBE, WindowedHashMap, bucket_int, mix64, mix64_int

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON = pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
MIXED = [TableConfig("item", 1, 8), TableConfig("country", 12, 8), TableConfig("user", 1, 8, pooling="mean")]


def budgets(eviction: str = "lru") -> dict[str, DynamicTableConfig]:
    return {"item": DynamicTableConfig(max_rows=6, admit_after=2, fallback_rows=3, eviction=eviction,
                                       lfu_half_life=4.0),
            "user": DynamicTableConfig(max_rows=5, admit_after=1, fallback_rows=2, eviction=eviction,
                                       lfu_half_life=2.0)}


def stream(tables, steps: int, seed: int, batch_size: int = 4, id_range: int = 24, skew: bool = False):
    """Batches of (per-table id lists, values, offsets): table-major bags with empty ones and repeats."""
    rng = random.Random(seed)
    for _ in range(steps):
        ids, lengths = [], []
        for table in tables:
            high = table.num_embeddings if table.num_embeddings > 1 else id_range
            bag_lengths = [rng.randint(0, 3) for _ in range(batch_size)]
            lengths += bag_lengths
            ids.append([int(high * rng.random() ** 3) if skew else rng.randrange(high)
                        for _ in range(sum(bag_lengths))])
        values = torch.tensor([k for keys in ids for k in keys], dtype=torch.int64)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        yield ids, values, offsets


def one_batch(ids_per_table: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One bag a table holding those ids (batch size 1)."""
    values = torch.tensor([k for keys in ids_per_table for k in keys], dtype=torch.int64)
    offsets = torch.tensor([0, *torch.tensor([len(k) for k in ids_per_table]).cumsum(0).tolist()])
    return values, offsets


def test_hash_is_the_same_in_tensors_and_python_ints():
    keys = torch.tensor([0, 1, 7, 2**31, 2**40 + 3, 2**62 + 11, 2**63 - 1])
    for salt in (0, 1, 5, 1234):
        assert [int(v) & MASK64 for v in mix64(keys, salt)] == [mix64_int(int(k), salt) for k in keys]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_equal_the_python_reference_on_random_streams(eviction, seed):
    module = DynamicEmbeddingBagCollection(MIXED, budgets(eviction), optimizer="rowwise_adagrad", count_half_life=7)
    ref = ReferenceSlotMap(budgets(eviction), [t.name for t in MIXED], count_half_life=7)
    for step, (ids, values, offsets) in enumerate(stream(MIXED, 60, seed, skew=seed == 2)):
        rows = module.rows_for(values, offsets)
        expected, _ = ref.rows_for(ids, training=True)
        assert rows.tolist() == [r for table in expected for r in table], f"step {step}"
    assert module.evicted > 0 and module.failed_inserts == 0  # the streams overflow both budgets
    assert module.rows_held() == {"item": 6, "user": 5}


def test_admission_after_n_sightings_and_the_hashed_fallback_before():
    dynamic = {"item": DynamicTableConfig(max_rows=4, admit_after=3, fallback_rows=5)}
    module = DynamicEmbeddingBagCollection([TableConfig("item", 1, 4)], dynamic)
    key = 123456789
    fallback = bucket_int(key, 0, 5)
    assert module.rows_for(*one_batch([[key]])).tolist() == [fallback]  # seen once
    assert module.rows_for(*one_batch([[key]])).tolist() == [fallback]  # twice
    assert module.slot_of("item", torch.tensor([key])).tolist() == [-1]
    assert module.rows_for(*one_batch([[key, 77]])).tolist() == [5 + 0, bucket_int(77, 0, 5)]  # third: a row
    assert module.slot_of("item", torch.tensor([key, 77])).tolist() == [0, -1]
    # three sightings in one batch are three: admitted at once
    assert module.rows_for(*one_batch([[9, 9, 9]])).tolist() == [6, 6, 6]


def test_lru_evicts_the_least_recently_used_row_not_used_by_the_batch():
    dynamic = {"item": DynamicTableConfig(max_rows=3, admit_after=1, fallback_rows=1)}
    module = DynamicEmbeddingBagCollection([TableConfig("item", 1, 4)], dynamic)
    for key in (10, 20, 30):
        module.rows_for(*one_batch([[key]]))
    module.rows_for(*one_batch([[10]]))  # 20 is now the least recently used
    module.rows_for(*one_batch([[40]]))
    assert module.slot_of("item", torch.tensor([10, 20, 30, 40])).tolist() == [0, -1, 2, 1]
    module.rows_for(*one_batch([[30, 50]]))  # 30 is used by this batch: 10 goes, not 30
    assert module.slot_of("item", torch.tensor([10, 30, 40, 50])).tolist() == [-1, 2, 1, 0]


def test_lfu_evicts_the_least_frequently_used_with_decay():
    dynamic = {"item": DynamicTableConfig(max_rows=2, admit_after=1, fallback_rows=1, eviction="lfu",
                                          lfu_half_life=1.0)}
    module = DynamicEmbeddingBagCollection([TableConfig("item", 1, 4)], dynamic)
    module.rows_for(*one_batch([[1] * 8]))  # step 1: id 1 used 8 times
    module.rows_for(*one_batch([[2] * 3]))  # step 2: id 2 used 3 times
    module.rows_for(*one_batch([[3]]))  # step 3: 1 scores 8/4 = 2, 2 scores 3/2 = 1.5: 2 goes
    assert module.slot_of("item", torch.tensor([1, 2, 3])).tolist() == [0, -1, 1]
    for _ in range(3):  # steps 4-6: id 1's count halves each step (2 → 0.25), 3 scores 1/8 after 3 steps
        module.rows_for(*one_batch([[]]))
    module.rows_for(*one_batch([[3], ]))  # step 7: 3 refreshed (1/16 + 1)
    module.rows_for(*one_batch([[4]]))  # step 8: 1 scores 8/128, 3 scores ~0.53: 1 goes despite its 8 uses
    assert module.slot_of("item", torch.tensor([1, 3, 4])).tolist() == [-1, 1, 0]


def _trained_row(module, key, steps=5):
    for _ in range(steps):
        pooled = module(*one_batch([[key]]))
        (pooled * torch.arange(1, pooled.shape[1] + 1)).sum().backward()


def test_evicted_rows_take_their_optimizer_state_and_a_readmitted_id_starts_fresh():
    dynamic = {"item": DynamicTableConfig(max_rows=1, admit_after=1, fallback_rows=1)}
    module = DynamicEmbeddingBagCollection([TableConfig("item", 1, 4)], dynamic, optimizer="rowwise_adagrad",
                                           lr=0.5, seed=3)
    _trained_row(module, 111)
    row = 1  # fallback row 0, the one slot is row 1
    trained_weight, trained_state = module.weight("item")[row].clone(), module.inner.state1[row].clone()
    assert trained_state > 0
    module.rows_for(*one_batch([[222]]))  # 222 takes the only slot: 111 is evicted with its state
    assert module.slot_of("item", torch.tensor([111, 222])).tolist() == [-1, 0]
    assert module.inner.state1[row] == 0
    assert not torch.equal(module.weight("item")[row], trained_weight)
    module.rows_for(*one_batch([[111]]))  # re-admitted: a fresh row, no trace of its first life
    assert module.slot_of("item", torch.tensor([111])).tolist() == [0]
    assert module.inner.state1[row] == 0
    assert not torch.equal(module.weight("item")[row], trained_weight)
    assert module.weight("item")[row].abs().max() <= 1.0  # the table's init (uniform ±1), not a trained row


def test_an_id_starts_from_the_same_row_whatever_its_slot_step_and_budget():
    """Two modules that differ only in their budgets (and so in the slots and steps at which ids are admitted
    and evicted) start each id from the same row; a re-admitted id from the row it first had."""
    scale = 0.05  # the default uniform scale follows the rows (fallback + budget): the same scale for both
    tables = [TableConfig("item", 1, 6, init_scale=scale), TableConfig("user", 1, 6, init_scale=scale)]

    def module(max_rows, seed=11):
        dynamic = {name: DynamicTableConfig(max_rows=max_rows, admit_after=1, fallback_rows=4) for name in
                   ("item", "user")}
        return DynamicEmbeddingBagCollection(tables, dynamic, optimizer="sgd", lr=0.1, seed=seed)

    def initial_row(module, name, key):
        slot = module.slot_of(name, torch.tensor([key])).item()
        assert slot >= 0, (name, key)
        return module.weight(name)[4 + slot]

    small, large, other_seed = module(2), module(50), module(50, seed=12)
    with torch.no_grad():
        large.rows_for(*one_batch([[2**61 + 5, 41, 40, 8, 7], [7]]))  # every id at once, in another order
        other_seed.rows_for(*one_batch([[7], []]))
        small.rows_for(*one_batch([[7, 8], [7]]))
        assert torch.equal(initial_row(small, "item", 7), initial_row(large, "item", 7))
        assert torch.equal(initial_row(small, "user", 7), initial_row(large, "user", 7))
        small.rows_for(*one_batch([[40, 41], []]))  # the two slots go to 40 and 41: 7 and 8 are evicted
        assert small.slot_of("item", torch.tensor([7, 8])).tolist() == [-1, -1]
        for key in (40, 41):
            assert torch.equal(initial_row(small, "item", key), initial_row(large, "item", key))
        small.rows_for(*one_batch([[7, 2**61 + 5], []]))  # re-admitted (evicting 40 and 41): 7's first row again
        for key in (7, 2**61 + 5):
            assert torch.equal(initial_row(small, "item", key), initial_row(large, "item", key))
    rows = [initial_row(large, "item", k) for k in (7, 8, 40, 41)] + [initial_row(large, "user", 7)]
    assert len({tuple(r.tolist()) for r in rows}) == len(rows)  # other ids or tables, other rows
    assert not torch.equal(initial_row(other_seed, "item", 7), initial_row(large, "item", 7))  # other seed
    assert all(r.abs().max() <= scale for r in rows)


@pytest.mark.parametrize("init, scale, expected_std", [("uniform", 0.2, 0.2 / 3 ** 0.5), ("normal", 0.5, 0.5)],
                         ids=["uniform", "normal"])
def test_keyed_initial_rows_follow_the_table_init(init, scale, expected_std):
    """The hashed draws have the init's spread: 40,000 values, so the standard deviation is within ~1 % (the
    tolerance, 3 %, is three of its standard errors); uniform values never leave ±scale."""
    table = TableConfig("item", 1, 8, init=init, init_scale=scale)
    keys = torch.randint(0, 2**62, (5000,), generator=torch.Generator().manual_seed(0))
    rows = keyed_initial_rows(table, keys, salt=3)
    assert rows.shape == (5000, 8) and torch.isfinite(rows).all()
    assert abs(rows.mean().item()) < 3 * expected_std / 200
    assert abs(rows.std().item() / expected_std - 1) < 0.03
    if init == "uniform":
        assert rows.abs().max() <= scale
    assert torch.equal(rows[:10], keyed_initial_rows(table, keys[:10], salt=3))  # a function of the key
    assert not torch.equal(rows[:10], keyed_initial_rows(table, keys[:10], salt=4))


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_element_wise_state_is_reset_with_the_row(optimizer):
    dynamic = {"item": DynamicTableConfig(max_rows=1, admit_after=1, fallback_rows=1)}
    module = DynamicEmbeddingBagCollection([TableConfig("item", 1, 4)], dynamic, optimizer=optimizer, lr=0.1)
    _trained_row(module, 5, steps=2)
    assert module.inner.state1.view(2, 4)[1].abs().sum() > 0
    module.rows_for(*one_batch([[6]]))
    assert module.inner.state1.view(2, 4)[1].abs().sum() == 0
    if optimizer == "adam":
        assert module.inner.state2.view(2, 4)[1].abs().sum() == 0


def test_not_admitted_ids_share_and_train_their_fallback_row():
    dynamic = {"item": DynamicTableConfig(max_rows=2, admit_after=100, fallback_rows=2)}
    module = DynamicEmbeddingBagCollection([TableConfig("item", 1, 4)], dynamic, optimizer="sgd", lr=0.1)
    keys = list(range(40))
    same = [k for k in keys if bucket_int(k, 0, 2) == bucket_int(0, 0, 2)]
    before = module.weight("item").clone()
    pooled = module(*one_batch([[same[0]]]))
    pooled.sum().backward()
    assert not torch.equal(module.weight("item")[bucket_int(0, 0, 2)], before[bucket_int(0, 0, 2)])
    module.eval()
    assert torch.equal(module(*one_batch([[same[0]]])), module(*one_batch([[same[1]]])))  # one shared row
    assert module.rows_held() == {"item": 0}


def test_eval_reads_the_map_and_changes_nothing():
    module = DynamicEmbeddingBagCollection(MIXED, budgets(), optimizer="rowwise_adagrad")
    for _, values, offsets in stream(MIXED, 20, 5):
        module.rows_for(values, offsets)
    module.eval()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for _, values, offsets in stream(MIXED, 5, 6, id_range=1000):  # mostly unseen ids: fallback rows
        with torch.no_grad():
            module(values, offsets)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=TRITON)])
def test_the_fused_kernels_over_slots_equal_the_reference(backend):
    """Same map (the module's), the Triton forward/backward/optimizer vs the PyTorch reference backend."""
    kwargs = dict(optimizer="rowwise_adagrad", lr=0.3, seed=1, count_half_life=5)
    fast = DynamicEmbeddingBagCollection(MIXED, budgets("lfu"), backend=backend, **kwargs)
    slow = DynamicEmbeddingBagCollection(MIXED, budgets("lfu"), backend="reference", **kwargs)
    weights = torch.randn(4, sum(t.dim for t in MIXED), generator=torch.Generator().manual_seed(0))
    for step, (_, values, offsets) in enumerate(stream(MIXED, 12, 9, skew=True)):
        out_fast, out_slow = fast(values, offsets), slow(values, offsets)
        torch.testing.assert_close(out_fast, out_slow, rtol=1e-5, atol=1e-6, msg=f"forward, step {step}")
        (out_fast * weights).sum().backward()
        (out_slow * weights).sum().backward()
    assert fast.evicted > 0
    torch.testing.assert_close(fast.inner.weights, slow.inner.weights, rtol=1e-5, atol=1e-6)  # fp32 sums
    torch.testing.assert_close(fast.inner.state1, slow.inner.state1, rtol=1e-5, atol=1e-7)
    assert torch.equal(fast.slot_keys, slow.slot_keys)


def _train(module, batches):
    weights = torch.linspace(-1, 1, module.embedding_dim)
    for _, values, offsets in batches:
        (module(values, offsets) * weights).sum().backward()


def test_state_dict_round_trip_serves_the_same_rows():
    module = DynamicEmbeddingBagCollection(MIXED, budgets(), optimizer="rowwise_adagrad")
    _train(module, stream(MIXED, 30, 3))
    loaded = DynamicEmbeddingBagCollection(MIXED, budgets(), optimizer="rowwise_adagrad", seed=9)
    loaded.load_state_dict(load(save(dict(module.state_dict()))))
    module.eval(), loaded.eval()
    for _, values, offsets in stream(MIXED, 3, 4, id_range=40):
        assert torch.equal(module(values, offsets), loaded(values, offsets))


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_delta_checkpoints_restore_bit_exactly(optimizer):
    kwargs = dict(optimizer=optimizer, lr=0.1, count_half_life=4)
    module = DynamicEmbeddingBagCollection(MIXED, budgets("lfu"), **kwargs)
    _train(module, stream(MIXED, 10, 11))
    full = save(dict(module.state_dict()))
    module.clear_touched()
    deltas = []
    for seed in (12, 13):
        _train(module, stream(MIXED, 8, seed, skew=True))
        deltas.append(save(module.delta_state_dict()))
        module.clear_touched()
    restored = DynamicEmbeddingBagCollection(MIXED, budgets("lfu"), seed=5, **kwargs)
    restored.load_state_dict(load(full))
    for delta in deltas:
        restored.apply_delta(load(delta))
    expected = module.state_dict()
    for key, value in restored.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert all(load(delta)["rows.0"].numel() for delta in deltas)  # each delta carried rows


@pytest.mark.parametrize("restore", ["state_dict", "delta"])
def test_a_restored_table_trains_on_as_the_one_that_never_stopped(restore):
    """The clock a step reads is a host mirror of the ``clock`` buffer (no device read a step on a GPU): after a
    checkpoint is loaded (whole, or as deltas) the next steps must use the restored clock, so that LFU decay,
    admission and the fresh rows' draws continue as in the run that never stopped."""
    kwargs = dict(optimizer="rowwise_adagrad", lr=0.1, count_half_life=3)
    module = DynamicEmbeddingBagCollection(MIXED, budgets("lfu"), **kwargs)
    restored = DynamicEmbeddingBagCollection(MIXED, budgets("lfu"), **kwargs)  # the same configuration
    _train(restored, stream(MIXED, 2, 30))  # its own history first: a clock that differs from the run's
    _train(module, stream(MIXED, 7, 31))
    if restore == "state_dict":
        restored.load_state_dict(load(save(dict(module.state_dict()))))
    else:
        restored.load_state_dict(load(save(dict(module.state_dict()))))
        module.clear_touched()
        _train(module, stream(MIXED, 5, 32, skew=True))
        restored.apply_delta(load(save(module.delta_state_dict())))
    for m in (module, restored):  # both go on with the same batches (admissions, evictions, decay, halving)
        _train(m, stream(MIXED, 6, 33, skew=True))
    expected = module.state_dict()
    for key, value in restored.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_delta_holds_only_what_changed():
    tables = [TableConfig("item", 1, 32)]
    dynamic = {"item": DynamicTableConfig(max_rows=2000, admit_after=1, fallback_rows=16)}
    module = DynamicEmbeddingBagCollection(tables, dynamic, optimizer="rowwise_adagrad")
    _train(module, stream(tables, 5, 1, batch_size=64, id_range=3000))
    module.clear_touched()
    _train(module, stream(tables, 1, 2, batch_size=4, id_range=3000))
    delta = module.delta_state_dict()
    assert 0 < delta["rows.0"].numel() <= 12 + 16 and delta["slots"].numel() <= 12
    assert delta["sketch_cells"].numel() <= 12 * 4  # the counters of 12 ids, 4 rows of the sketch
    assert len(save(delta)) < len(save(dict(module.state_dict()))) / 10


def test_a_full_map_window_refuses_the_insert_and_keeps_the_others():
    table = WindowedHashMap([PROBE])  # one window's worth of positions: the 33rd key cannot fit
    keys, slots = table.new()
    new = torch.arange(1000, 1000 + PROBE + 8)
    inserted = table.insert(keys, slots, new, torch.zeros_like(new), torch.arange(new.numel()))
    assert int(inserted.sum()) == PROBE
    found, slot = table.lookup(keys, slots, new, torch.zeros_like(new))
    assert torch.equal(found, inserted)
    assert torch.equal(slot[found], torch.arange(new.numel())[inserted])


def test_static_tables_keep_their_rows_and_grow():
    module = DynamicEmbeddingBagCollection(MIXED, budgets(), optimizer="sgd")
    values, offsets = one_batch([[5], [11], [7]])
    assert module.rows_for(values, offsets).tolist()[1] == 11
    module.grow("country", 20)
    assert module.rows_for(*one_batch([[5], [19], [7]])).tolist()[1] == 19
    with pytest.raises(ValueError, match="dynamic"):
        module.grow("item", 100)


@pytest.mark.gpu
def test_on_cuda_the_map_and_the_kernels_match_the_cpu_reference():
    """The same stream on CUDA (the map's tensors and the Triton kernels there) and on the CPU reference;
    zero-initialized tables, so that both devices' random draws do not matter."""
    tables = [dataclasses.replace(t, init="zeros") for t in MIXED]
    kwargs = dict(optimizer="rowwise_adagrad", lr=0.3, count_half_life=5)
    fast = DynamicEmbeddingBagCollection(tables, budgets("lfu"), device="cuda", backend="triton", **kwargs)
    slow = DynamicEmbeddingBagCollection(tables, budgets("lfu"), backend="reference", **kwargs)
    weights = torch.randn(4, sum(t.dim for t in MIXED), generator=torch.Generator().manual_seed(0))
    for _, values, offsets in stream(MIXED, 30, 9, skew=True):
        out_fast, out_slow = fast(values.cuda(), offsets.cuda()), slow(values, offsets)
        torch.testing.assert_close(out_fast.cpu(), out_slow, rtol=1e-5, atol=1e-6)
        (out_fast * weights.cuda()).sum().backward()
        (out_slow * weights).sum().backward()
    assert torch.equal(fast.slot_keys.cpu(), slow.slot_keys) and fast.evicted == slow.evicted > 0
    torch.testing.assert_close(fast.inner.weights.cpu(), slow.inner.weights, rtol=1e-5, atol=1e-6)
