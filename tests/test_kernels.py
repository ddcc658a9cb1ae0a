"""recloop_kernels against independent oracles (nn.EmbeddingBag, torch.optim) and its own reference.

Every test runs on fresh random inputs, with uniform, power-law and Zipf ids full of duplicates, empty
bags and mixed dims (dim 5 makes padded rows). On a CPU the Triton kernels run under TRITON_INTERPRET=1
(set in conftest.py) on small shapes; the ``gpu`` tests at the end repeat the comparisons at real sizes
and in bf16 on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from recloop_kernels import EmbeddingBagCollection, TableConfig, embedding_bag
from recloop_kernels.config import Layout
from recloop_kernels.embedding_bag import CHUNK, triton_usable
from recloop_kernels.reference import table_view

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON = pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
BACKENDS = ["reference", pytest.param("triton", marks=TRITON)]
MIXED = [TableConfig("user", 40, 8), TableConfig("item", 25, 5, pooling="mean"), TableConfig("ctx", 9, 20)]
ONE = [TableConfig("only", 60, 16)]
WIDTH = sum(t.dim for t in MIXED)


def assert_close(name: str, expected: torch.Tensor, actual: torch.Tensor, tolerance: float) -> None:
    """Relative error ‖actual − expected‖ / ‖expected‖ under ``tolerance``; NaN never passes."""
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    error = (actual.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-12)
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


def draw_ids(n: int, rows: int, ids: str, g: torch.Generator) -> torch.Tensor:
    """``uniform``, ``powerlaw`` (u⁴: a few hot rows) or ``zipf`` (P(rank k) ∝ k^-1.05, ranks shuffled)."""
    if ids == "zipf":
        probabilities = torch.arange(1, rows + 1, dtype=torch.float64) ** -1.05
        ranks = torch.multinomial(probabilities, n, replacement=True, generator=g) if n else torch.zeros(0).long()
        return torch.randperm(rows, generator=g)[ranks]
    if ids == "powerlaw":
        return (torch.rand(n, generator=g) ** 4 * rows).long()
    return torch.randint(0, rows, (n,), generator=g)


def make_batch(tables, batch_size: int, seed: int, ids: str = "uniform", max_bag: int = 6, weighted: bool = False):
    """Table-major bags with empty bags, duplicates within and across bags."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_bag + 1, (len(tables) * batch_size,), generator=g)
    lengths[::5] = 0  # empty bags
    values = []
    for t, table in enumerate(tables):
        n = int(lengths[t * batch_size:(t + 1) * batch_size].sum())
        values.append(draw_ids(n, table.num_embeddings, ids, g))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return values, offsets, weights


def oracle_bags(ebc: EmbeddingBagCollection, sparse: bool = False) -> nn.ModuleList:
    """Independent nn.EmbeddingBag tables holding the same weights."""
    bags = nn.ModuleList()
    for table in ebc.tables:
        bag = nn.EmbeddingBag(table.num_embeddings, table.dim, mode="sum", sparse=sparse)
        bag.weight.data.copy_(ebc.weight(table.name).detach().float())
        bags.append(bag)
    return bags


def oracle_forward(bags, tables, values, offsets, weights, batch_size):
    outputs = []
    for t, (bag, table) in enumerate(zip(bags, tables, strict=True)):
        bounds = offsets[t * batch_size:(t + 1) * batch_size + 1]
        start, end = int(bounds[0]), int(bounds[-1])
        out = bag(values[start:end], bounds[:-1] - start,
                  per_sample_weights=weights[start:end] if weights is not None else None)
        if table.pooling == "mean":
            out = out / (bounds[1:] - bounds[:-1]).clamp(min=1)[:, None].float()
        outputs.append(out)
    return torch.cat(outputs, dim=1)


def strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a buffer twice as long)."""
    buffer = torch.stack([tensor, torch.full_like(tensor, 7)], dim=1)
    view = buffer[:, 0]
    assert not view.is_contiguous()
    return view


CASES = [
    pytest.param(MIXED, "uniform", False, torch.int64, id="mixed-dims-uniform"),
    pytest.param(MIXED, "zipf", True, torch.int64, id="mixed-dims-zipf-weighted"),
    pytest.param(ONE, "powerlaw", False, torch.int32, id="one-table-powerlaw-int32"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tables", "ids", "weighted", "index_dtype"), CASES)
def test_forward_matches_nn_embedding_bag(backend, tables, ids, weighted, index_dtype):
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(tables, backend=backend, seed=3)
    values, offsets, weights = make_batch(tables, 7, seed=5, ids=ids, weighted=weighted)
    expected = oracle_forward(oracle_bags(ebc), tables, values, offsets, weights, 7)
    out = ebc(values.to(index_dtype), offsets.to(index_dtype), weights)
    assert out.shape == (7, sum(t.dim for t in tables))
    assert_close("forward", expected, out, 1e-6)  # fp32 sums of a few rows
    empty = (offsets[1:] == offsets[:-1]).nonzero().flatten()
    t0 = empty[empty < 7]
    if len(t0):
        assert (out[t0, : tables[0].dim] == 0).all(), "empty bags pool to zeros"


@TRITON
@pytest.mark.parametrize(("pipeline", "batch_size"), [(2, 7), (3, 11), (4, 13)])
def test_a_pipelined_forward_pools_like_the_oracle(pipeline, batch_size, monkeypatch):
    """``FORWARD_PIPELINE`` blocks of bags a program (TILE lowered so that a small batch makes several blocks a
    table, the last program with blocks past the batch): the pooled rows of nn.EmbeddingBag, mean pooling and
    per-sample weights included, and ids outside their table still counted and reported."""
    monkeypatch.setattr(embedding_bag, "TILE", 64)
    monkeypatch.setattr(embedding_bag, "FORWARD_PIPELINE", pipeline)
    ebc = EmbeddingBagCollection(MIXED, backend="triton", seed=3)
    values, offsets, weights = make_batch(MIXED, batch_size, seed=9, ids="zipf", weighted=True)
    expected = oracle_forward(oracle_bags(ebc), MIXED, values, offsets, weights, batch_size)
    out = ebc(values, offsets, weights)
    assert_close("forward", expected, out, 1e-6)
    ctx_width = embedding_bag._next_power_of_2(ebc.layout.strides[2])  # the last table's tile width
    bags, _ = embedding_bag.forward_tiles(ctx_width, values.numel() / (3 * batch_size))
    assert -(-batch_size // bags) > pipeline, "a table's blocks must span programs"
    bad = values.clone()
    lengths = offsets[1:] - offsets[:-1]
    last = int(lengths[2 * batch_size:].nonzero().max()) + 2 * batch_size  # the last table's ('ctx', 9 rows) last bag
    assert last >= 2 * batch_size + bags  # in a later block than the first
    bad[int(offsets[last])] = 9
    ebc(bad, offsets, weights)
    with pytest.raises(IndexError, match=r"'ctx' has 9 rows; got ids in \[9, 9\] \(1 out of range"):
        ebc.raise_id_errors()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_gradient_without_optimizer_matches_autograd(backend, sparse):
    ebc = EmbeddingBagCollection(MIXED, backend=backend, sparse=sparse, seed=2)
    bags = oracle_bags(ebc)
    values, offsets, weights = make_batch(MIXED, 6, seed=8, ids="zipf", weighted=True)
    upstream = torch.randn(6, WIDTH)
    (ebc(values, offsets, weights) * upstream).sum().backward()
    (oracle_forward(bags, MIXED, values, offsets, weights, 6) * upstream).sum().backward()
    grad = ebc.weights.grad
    assert grad.is_sparse == sparse
    grad = grad.to_dense() if sparse else grad
    for t, (bag, table) in enumerate(zip(bags, MIXED, strict=True)):
        mine = table_view(grad, ebc.layout, t)[:table.num_embeddings]
        assert_close(f"grad {table.name}", bag.weight.grad, mine, 1e-6)


def train_steps(ebc, tables, steps, ids, seed, weighted=True, batch_size=5):
    for step in range(steps):
        values, offsets, weights = make_batch(tables, batch_size, seed=seed + step, ids=ids, weighted=weighted)
        upstream = torch.randn(batch_size, sum(t.dim for t in tables), generator=torch.Generator().manual_seed(step))
        (ebc(values, offsets, weights) * upstream).sum().backward()


@pytest.mark.parametrize("ids", ["uniform", "zipf"])
@pytest.mark.parametrize(("optimizer", "torch_optimizer"), [
    ("sgd", lambda params: torch.optim.SGD(params, lr=0.1)),
    ("adagrad", lambda params: torch.optim.Adagrad(params, lr=0.1, eps=1e-12)),
    ("adam", lambda params: torch.optim.SparseAdam(params, lr=0.1, eps=1e-12)),
])
def test_fused_optimizers_match_torch_optim(optimizer, torch_optimizer, ids):
    """Fused sgd / adagrad / lazy adam == torch.optim on sparse gradients, over several steps."""
    tables = [TableConfig("a", 30, 8), TableConfig("b", 20, 4, pooling="mean")]
    # eps=1e-12: SparseAdam adds eps to sqrt(v) before bias correction, recloop after (as in Adam);
    # the two agree when eps is negligible against the gradients.
    ebc = EmbeddingBagCollection(tables, optimizer=optimizer, lr=0.1, eps=1e-12, seed=4)
    bags = oracle_bags(ebc, sparse=True)
    opt = torch_optimizer(list(bags.parameters()))
    for step in range(4):
        values, offsets, weights = make_batch(tables, 5, seed=20 + step, ids=ids, weighted=True)
        upstream = torch.randn(5, 12, generator=torch.Generator().manual_seed(step))
        (ebc(values, offsets, weights) * upstream).sum().backward()
        opt.zero_grad()
        (oracle_forward(bags, tables, values, offsets, weights, 5) * upstream).sum().backward()
        opt.step()
    for bag, table in zip(bags, tables, strict=True):
        assert_close(f"{optimizer} weights {table.name}", bag.weight.detach(), ebc.weight(table.name), 1e-5)


def test_rowwise_adagrad_follows_its_formula():
    tables = [TableConfig("a", 10, 4)]
    ebc = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.5, eps=1e-8, seed=0)
    before = ebc.weight("a").clone()
    values, offsets = torch.tensor([3, 3, 7]), torch.tensor([0, 2, 3])  # row 3 twice in bag 0, row 7 in bag 1
    upstream = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]])
    (ebc(values, offsets) * upstream).sum().backward()
    g3 = 2 * upstream[0]  # summed over both occurrences
    m3 = (g3 * g3).mean()
    torch.testing.assert_close(ebc.weight("a")[3], before[3] - 0.5 * g3 / (m3.sqrt() + 1e-8))
    torch.testing.assert_close(ebc.state1[3], m3)
    torch.testing.assert_close(ebc.weight("a")[0], before[0])  # untouched rows stay


@TRITON
@pytest.mark.parametrize(("optimizer", "ids"), [("sgd", "zipf"), ("adagrad", "uniform"), ("rowwise_adagrad", "zipf"),
                                                ("adam", "uniform"), ("adam", "zipf")])
def test_triton_fused_update_matches_the_reference(optimizer, ids):
    """Weights and optimizer state after several fused steps, weight decay included."""
    modules = [EmbeddingBagCollection(MIXED, optimizer=optimizer, lr=0.05, weight_decay=0.01, backend=backend,
                                      seed=6) for backend in ("reference", "triton")]
    for ebc in modules:
        train_steps(ebc, MIXED, steps=3, ids=ids, seed=40)
    reference, triton_ = modules
    assert_close("weights", reference.weights, triton_.weights, 1e-6)
    for name in ("state1", "state2"):
        if getattr(reference, name).numel():
            assert_close(name, getattr(reference, name), getattr(triton_, name), 1e-5)
    assert int(reference.step) == int(triton_.step) == 3


def hot_row_batch(batch_size: int, seed: int):
    """A one-hot table whose row 3 is in ~80 % of the bags (a run far longer than CHUNK), then a
    multi-hot mean-pooled table with Zipf ids (dim 5: padded rows)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.where(torch.rand(batch_size, generator=g) < 0.8, 3, torch.randint(0, 50, (batch_size,), generator=g))
    lengths = torch.randint(0, 4, (batch_size,), generator=g)
    lengths[::7] = 0
    multi = draw_ids(int(lengths.sum()), 30, "zipf", g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                         torch.cat([torch.ones(batch_size, dtype=torch.int64), lengths]).cumsum(0)])
    values = torch.cat([hot, multi])
    weights = torch.rand(values.numel(), generator=g) + 0.5
    return values, offsets, weights, torch.randn(batch_size, 21, generator=g)


HOT = [TableConfig("hot", 50, 16), TableConfig("multi", 30, 5, pooling="mean")]


@TRITON
@pytest.mark.parametrize(("optimizer", "dtype"), [("sgd", torch.float32), ("rowwise_adagrad", torch.float32),
                                                  ("adam", torch.float32), ("adagrad", torch.float16)])
def test_a_row_in_hundreds_of_bags_is_split_deterministic_and_matches(optimizer, dtype, monkeypatch):
    """One row in ~80 % of the bags: its run is split across programs (fp32 partials, summed in order),
    deterministically.

    The split threshold is lowered from CHUNK=256 to 32 so that the interpreter sees ten splits of the
    hot row (and many runs of the multi-hot table crossing chunk boundaries) in a small batch; the
    ``gpu`` test below splits at the real threshold.
    """
    monkeypatch.setattr(embedding_bag, "CHUNK", 32)
    batch = hot_row_batch(256, seed=11)
    assert int((batch[0][:256] == 3).sum()) > 5 * 32
    runs = []
    # Bit-identical reruns are checked where the order of a sum could matter most: Adam's state and
    # fp16 weights rounded stochastically.
    rerun = optimizer == "adam" or dtype == torch.float16
    for backend in ("reference", "triton", "triton") if rerun else ("reference", "triton"):
        ebc = EmbeddingBagCollection(HOT, optimizer=optimizer, lr=0.05, dtype=dtype, backend=backend, seed=1)
        for _ in range(2):
            values, offsets, weights, upstream = batch
            (ebc(values, offsets, weights) * upstream).sum().backward()
        runs.append((ebc.weights.clone(), ebc.state1.clone()))
    (reference_w, reference_s), (first_w, first_s) = runs[:2]
    if rerun:
        second_w, second_s = runs[2]
        assert torch.equal(first_w, second_w) and torch.equal(first_s, second_s), "not bit-identical across runs"
    # fp32: 200-term sums in another order agree to ~1e-7; fp16 weights: half an ulp (2^-11) at most.
    assert_close("weights", reference_w.float(), first_w.float(), 1e-5 if dtype == torch.float32 else 1e-3)
    if reference_s.numel():
        assert_close("state", reference_s, first_s, 1e-5)


@TRITON
@pytest.mark.parametrize(("runs", "optimizer", "dtype", "tables", "programs", "long_n", "block_n"), [
    (4, "rowwise_adagrad", torch.float32, "mixed", None, 16, 1), (2, "adam", torch.float32, "hot", 3, 16, 1),
    (8, "adagrad", torch.float16, "hot", None, 0, None), (4, "sgd", torch.float32, "one", 2, 16, 1),
    (1, "rowwise_adagrad", torch.float32, "hot", 5, 8, 1), (4, "rowwise_adagrad", torch.float32, "hot", 1, 0, None),
    (2, "rowwise_adagrad", torch.float32, "hot", 2, 8, 2),
])
def test_several_runs_a_program_update_like_the_reference(runs, optimizer, dtype, tables, programs, long_n, block_n,
                                                          monkeypatch):
    """The segment pass with RUNS work items side by side in one program (``SEGMENT_RUNS``): runs of
    different lengths, tables and dims in one program, programs past the last item, split runs (CHUNK
    lowered to 32) and stochastic rounding give the reference's weights and state, and one program's
    neighbours do not leak into its rows. With few programs (``programs``), each takes many groups of
    items in turn (grid-stride); items longer than BLOCK_N are summed alone, ``long_n`` a step (0: with the
    short ones)."""
    monkeypatch.setattr(embedding_bag, "CHUNK", 32)
    monkeypatch.setattr(embedding_bag, "SEGMENT_RUNS", runs)
    monkeypatch.setattr(embedding_bag, "SEGMENT_BLOCK_N", block_n)
    monkeypatch.setattr(embedding_bag, "SEGMENT_LONG_N", long_n)
    if programs is not None:
        monkeypatch.setattr(embedding_bag, "segment_programs", lambda device, max_items, runs, warps: programs)
    assert embedding_bag.backward_tiles(16)[2] == runs
    if tables == "hot":
        config, (values, offsets, weights, upstream), batch_size = HOT, hot_row_batch(96, seed=5), 96
    else:
        config = MIXED if tables == "mixed" else ONE
        batch_size = 7
        values, offsets, weights = make_batch(config, batch_size, seed=21, ids="zipf", weighted=True)
        upstream = torch.randn(batch_size, sum(t.dim for t in config))
    modules = [EmbeddingBagCollection(config, optimizer=optimizer, lr=0.05, weight_decay=0.01, dtype=dtype,
                                      backend=backend, seed=2) for backend in ("reference", "triton")]
    for ebc in modules:
        for _ in range(2):
            (ebc(values, offsets, weights) * upstream).sum().backward()
    reference, triton_ = modules
    assert not torch.equal(reference.weights, EmbeddingBagCollection(config, dtype=dtype, seed=2).weights)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    assert_close("weights", reference.weights.float(), triton_.weights.float(), tolerance)
    for name in ("state1", "state2"):
        if getattr(reference, name).numel():
            assert_close(name, getattr(reference, name), getattr(triton_, name), 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_out_of_range_raise_and_write_nothing(backend):
    """Ids at and beyond a table's bounds pool as zeros, update no row of any table, and raise later."""
    values, offsets, weights = make_batch(MIXED, 4, seed=3, ids="uniform", weighted=True)
    item = slice(int(offsets[4]), int(offsets[8]))
    assert item.stop - item.start >= 3
    bad = values.clone()
    bad[item.start:item.start + 3] = torch.tensor([25, -1, 10**6])  # 25: the next table's row 0 before
    silenced = weights.clone()
    silenced[item.start:item.start + 3] = 0.0
    clean = values.clone()
    clean[item.start:item.start + 3] = 0
    upstream = torch.randn(4, WIDTH)
    twin = EmbeddingBagCollection(MIXED, optimizer="sgd", lr=0.5, backend=backend, seed=1, check_ids="off")
    ebc = EmbeddingBagCollection(MIXED, optimizer="sgd", lr=0.5, backend=backend, seed=1)
    before = ebc.weights.clone()
    out = ebc(bad, offsets, weights)
    expected = twin(clean, offsets, silenced)
    assert_close("forward", expected, out, 1e-6)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert torch.equal(ebc.weights, twin.weights)
    assert torch.equal(ebc.weight("ctx")[0], before[ebc.layout.elem_offsets[2]:][:20])
    with pytest.raises(IndexError, match=r"'item' has 25 rows; got ids in \[-1, 1000000\] \(3 out of range"):
        ebc.raise_id_errors()
    ebc.raise_id_errors()  # reset by the raise

    sync = EmbeddingBagCollection(MIXED, backend=backend, check_ids="sync")
    one_each = torch.tensor([0, 1, 2, 3])  # B = 1: one id per table
    with pytest.raises(IndexError, match=r"'item' has 25 rows; got ids in \[25, 25\]"):
        sync(torch.tensor([0, 25, 0]), one_each)
    deferred = EmbeddingBagCollection(MIXED, backend=backend, id_check_interval=2)
    deferred(torch.tensor([0, 0, 9]), one_each)  # the first call: recorded, not raised
    with pytest.raises(IndexError, match=r"'ctx' has 9 rows; got ids in \[9, 9\]"):
        deferred(torch.tensor([0, 0, 0]), one_each)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_give_the_same_results(backend):
    values, offsets, weights = make_batch(MIXED, 5, seed=12, ids="zipf", weighted=True)
    upstream = torch.randn(5, WIDTH)
    modules = [EmbeddingBagCollection(MIXED, optimizer="adagrad", lr=0.1, backend=backend, seed=2) for _ in range(2)]
    plain = modules[0](values, offsets, weights)
    views = modules[1](strided(values), strided(offsets), strided(weights))
    assert torch.equal(plain, views)
    torch.autograd.backward(plain, upstream)
    column_major = upstream.T.contiguous().T  # the same gradient, non-contiguous
    assert not column_major.is_contiguous()
    torch.autograd.backward(views, column_major)
    assert torch.equal(modules[0].weights, modules[1].weights)


@TRITON
def test_values_padded_past_the_last_offset_are_ignored():
    """Bucketed lengths: ids after offsets[-1] (even out-of-range ones) are no bag's and change nothing."""
    values, offsets, weights = make_batch(MIXED, 5, seed=14, ids="zipf", weighted=True)
    padded = torch.cat([values, torch.tensor([3, 99, -5, 0])])
    padded_weights = torch.cat([weights, torch.ones(4)])
    upstream = torch.randn(5, WIDTH)
    modules = [EmbeddingBagCollection(MIXED, optimizer="rowwise_adagrad", lr=0.1, backend="triton", seed=2)
               for _ in range(2)]
    (modules[0](values, offsets, weights) * upstream).sum().backward()
    (modules[1](padded, offsets, padded_weights) * upstream).sum().backward()
    assert torch.equal(modules[0].weights, modules[1].weights)
    assert torch.equal(modules[0].state1, modules[1].state1)
    assert modules[1].id_errors_seen() == {}


@TRITON
def test_half_weights_keep_fp32_state_and_round_like_the_reference():
    tables = [TableConfig("a", 30, 8), TableConfig("b", 12, 5)]
    full = EmbeddingBagCollection(tables, optimizer="adagrad", lr=0.05, backend="reference", seed=9)
    halves = [EmbeddingBagCollection(tables, optimizer="adagrad", lr=0.05, dtype=torch.float16, backend=backend,
                                     seed=9) for backend in ("reference", "triton")]
    values, offsets, _ = make_batch(tables, 6, seed=1, ids="powerlaw")
    assert_close("fp16 forward", full(values, offsets), halves[1](values, offsets), 1e-3)
    for ebc in (full, *halves):
        train_steps(ebc, tables, 3, ids="powerlaw", seed=70)
    reference_half, triton_half = halves
    assert triton_half.weights.dtype == torch.float16 and triton_half.state1.dtype == torch.float32
    assert_close("fp16 weights vs fp32", full.weights, triton_half.weights.float(), 5e-3)
    # Same stochastic rounding (same random bits): only sums that differ in their last fp32 bit can
    # round differently, so nearly every element is identical.
    assert (reference_half.weights != triton_half.weights).float().mean() < 0.01
    assert_close("fp16 weights vs reference", reference_half.weights.float(), triton_half.weights.float(), 1e-3)
    # An update of 1e-4 to weights of 1.0, a fifth of fp16's spacing below 1.0 (2^-11): round-to-nearest
    # leaves every weight at 1.0; stochastic rounding moves a fifth of them down one step, so the mean
    # moves by 1e-4 (over 4096 weights its standard error is 3e-6).
    sgd = EmbeddingBagCollection([TableConfig("w", 64, 64, init="zeros")], optimizer="sgd", lr=1.0,
                                 dtype=torch.float16, backend="triton")
    sgd.weights.data.fill_(1.0)
    (sgd(torch.arange(64), torch.arange(65)) * 1e-4).sum().backward()
    mean = sgd.weights.float().mean().item()
    assert abs(mean - (1.0 - 1e-4)) < 2e-5, mean


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_half_conversion_keeps_fp32_state_and_repads_rows(optimizer):
    ebc = EmbeddingBagCollection(MIXED, optimizer=optimizer, lr=0.05, seed=3)
    train_steps(ebc, MIXED, steps=2, ids="zipf", seed=30)
    weights = {t.name: ebc.weight(t.name).clone() for t in MIXED}
    state = ebc.state1.clone()
    ebc.half()
    assert ebc.weights.dtype == torch.float16 and ebc.state1.dtype == torch.float32
    assert ebc.layout.strides == (8, 8, 24)  # fp16 rows padded to 16 bytes (8 elements)
    for t in MIXED:
        torch.testing.assert_close(ebc.weight(t.name).float(), weights[t.name], atol=1e-3, rtol=1e-3)
    if optimizer == "rowwise_adagrad":
        assert torch.equal(ebc.state1, state)  # per-row state is not affected by padding
    train_steps(ebc, MIXED, steps=1, ids="zipf", seed=33)
    assert torch.isfinite(ebc.weights.float()).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_grow_keeps_rows_and_state_and_new_ids_work(backend):
    ebc = EmbeddingBagCollection(MIXED, optimizer="rowwise_adagrad", lr=0.1, backend=backend, seed=5)
    train_steps(ebc, MIXED, steps=2, ids="uniform", seed=80)
    old_item, old_user = ebc.weight("item").clone(), ebc.weight("user").clone()
    old_state = ebc.state1[ebc.layout.row_offsets[1]:ebc.layout.row_offsets[1] + 25].clone()
    ebc.grow("item", 30)  # beyond capacity: reallocation
    ebc.grow("item", 31)  # within the reserved capacity
    assert ebc.weight("item").shape == (31, 5) and ebc.layout.capacities[1] >= 37
    torch.testing.assert_close(ebc.weight("item")[:25], old_item)
    torch.testing.assert_close(ebc.weight("user"), old_user)
    torch.testing.assert_close(ebc.state1[ebc.layout.row_offsets[1]:ebc.layout.row_offsets[1] + 25], old_state)
    assert ebc.weight("item")[25:].abs().sum() > 0  # initialized, not zeros
    values = torch.tensor([1, 30, 2])
    offsets = torch.tensor([0, 1, 2, 3])  # user: [1]; item: [30]; ctx: [2]  (B = 1)
    ebc(values, offsets).sum().backward()
    ebc.raise_id_errors()  # row 30 exists now
    with pytest.raises(ValueError, match="only grow"):
        ebc.grow("item", 10)


def test_grow_without_fused_optimizer_keeps_the_torch_optimizer():
    ebc = EmbeddingBagCollection(MIXED, seed=5)
    optimizer = torch.optim.Adam(ebc.parameters(), lr=0.01)
    parameter = ebc.weights

    def step(seed):
        optimizer.zero_grad()
        train_steps(ebc, MIXED, steps=1, ids="zipf", seed=seed)
        optimizer.step()

    step(1)
    moments = {t.name: table_view(optimizer.state[parameter]["exp_avg"], ebc.layout, i)[:t.num_embeddings].clone()
               for i, t in enumerate(MIXED)}
    ebc.grow("item", 40, dense_optimizer=optimizer)  # reallocates: every later table moves
    assert ebc.weights is parameter and ebc.weights.shape == optimizer.state[parameter]["exp_avg"].shape
    for i, t in enumerate(MIXED):
        moved = table_view(optimizer.state[parameter]["exp_avg"], ebc.layout, i)[:t.num_embeddings]
        assert torch.equal(moved, moments[t.name]), t.name
    step(2)
    assert torch.isfinite(ebc.weights).all()


def test_state_round_trips_through_safetensors(tmp_path):
    ebc = EmbeddingBagCollection(MIXED, optimizer="adam", lr=0.05, seed=1)
    train_steps(ebc, MIXED, steps=2, ids="zipf", seed=90)
    ebc.grow("user", 70)
    save_file(ebc.state_dict(), tmp_path / "ebc.safetensors")
    fresh = EmbeddingBagCollection(MIXED, optimizer="adam", lr=0.05, seed=99)  # smaller, other weights
    fresh.load_state_dict(load_file(tmp_path / "ebc.safetensors"))
    assert fresh.weight("user").shape == (70, 8)
    for name in ("weights", "state1", "state2", "step"):
        assert torch.equal(getattr(fresh, name), getattr(ebc, name)), name
    train_steps(ebc, MIXED, steps=1, ids="zipf", seed=95)
    train_steps(fresh, MIXED, steps=1, ids="zipf", seed=95)
    assert torch.equal(fresh.weights, ebc.weights)
    wrong = EmbeddingBagCollection([TableConfig("user", 40, 16)], optimizer="adam")
    with pytest.raises(RuntimeError, match="dims differ"):
        wrong.load_state_dict(load_file(tmp_path / "ebc.safetensors"))


def test_a_checkpoint_with_unpadded_rows_still_loads():
    """Checkpoints written before rows were padded to 16 bytes hold dim-wide rows back to back."""
    ebc = EmbeddingBagCollection(MIXED, optimizer="adagrad", seed=1)
    train_steps(ebc, MIXED, steps=1, ids="zipf", seed=5)
    old = Layout(ebc.layout.dims, ebc.layout.capacities, ebc.layout.rows, ebc.layout.poolings, align=1)
    state = ebc.state_dict()
    for key in ("weights", "state1"):
        flat = torch.zeros(old.total_elems)
        for t in range(3):
            table_view(flat, old, t).copy_(table_view(state[key], ebc.layout, t))
        state[key] = flat
    fresh = EmbeddingBagCollection(MIXED, optimizer="adagrad", seed=7)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.weights, ebc.weights) and torch.equal(fresh.state1, ebc.state1)


def test_bad_input_is_refused_clearly():
    ebc = EmbeddingBagCollection(MIXED, check_ids="sync")
    values, offsets, _ = make_batch(MIXED, 3, seed=0)
    with pytest.raises(ValueError, match="T\\*B\\+1"):
        ebc(values, offsets[:-1])
    with pytest.raises(ValueError, match="end within values"):
        ebc(values[:-1], offsets)
    with pytest.raises(TypeError, match="int32 or int64"):
        ebc(values.float(), offsets)
    with pytest.raises(ValueError, match="unique names"):
        EmbeddingBagCollection([TableConfig("a", 2, 2), TableConfig("a", 3, 2)])
    with pytest.raises(ValueError, match="unknown optimizer"):
        EmbeddingBagCollection(MIXED, optimizer="lamb")
    with pytest.raises(ValueError, match="check_ids"):
        EmbeddingBagCollection(MIXED, check_ids="sometimes")


class TinyRanker(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.embeddings = EmbeddingBagCollection(MIXED, **kwargs)
        self.head = nn.Linear(self.embeddings.embedding_dim, 1)

    def forward(self, values, offsets):
        return self.head(self.embeddings(values, offsets)).squeeze(-1)


def test_works_under_torch_compile_and_export():
    values, offsets, _ = make_batch(MIXED, 4, seed=3)
    eager = TinyRanker(seed=1)
    compiled_model = TinyRanker(seed=1)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(values, offsets), eager(values, offsets))
    compiled(values, offsets).sum().backward()
    eager(values, offsets).sum().backward()
    torch.testing.assert_close(compiled_model.embeddings.weights.grad, eager.embeddings.weights.grad)

    to_export = TinyRanker(seed=1)
    to_export.load_state_dict(eager.state_dict())
    exported = torch.export.export(to_export.eval(), (values, offsets))
    assert any("recloop.embedding_bags" in str(node.target) for node in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(values, offsets), eager(values, offsets))


def test_an_eager_forward_calls_the_function_itself_and_a_fresh_process_never_imports_dynamo():
    """Eager calls skip the ops' dispatch (their first call imported torch._dynamo: seconds of every fresh process
    that scores, such as the gate's serving check, or trains eagerly on a CPU); the result is the op's, and
    compiled or exported graphs still hold the ops (``test_works_under_torch_compile_and_export``)."""
    import subprocess
    import sys
    from pathlib import Path

    values, offsets, _ = make_batch(MIXED, 4, seed=3)
    model = EmbeddingBagCollection(MIXED, seed=1)
    layout = embedding_bag.layout_args(model._layout)
    errors = torch.zeros(len(MIXED), dtype=torch.int64)
    through_op = embedding_bag.embedding_bags(model.weights, values, offsets, None, errors, *layout, 4, False)
    direct = embedding_bag.pool(model.weights, values, offsets, None, errors.clone(), *layout, 4, False)
    torch.testing.assert_close(direct, through_op, rtol=0, atol=0)
    kernels = Path(embedding_bag.__file__).resolve().parents[1]
    code = ("import sys, torch\n"
            "from recloop_kernels import EmbeddingBagCollection, TableConfig\n"
            "tables = [TableConfig('a', 10, 4), TableConfig('b', 5, 4, pooling='mean')]\n"
            "batch = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4])\n"
            "with torch.no_grad():\n"
            "    out = EmbeddingBagCollection(tables)(*batch)\n"
            "for kind in ({'optimizer': 'rowwise_adagrad'}, {}):\n"  # a fused update, a dense gradient
            "    EmbeddingBagCollection(tables, **kind)(*batch).sum().backward()\n"
            "print(tuple(out.shape), 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(kernels)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "(2, 8) False", done.stdout


def test_fused_optimizer_trains_under_torch_compile_in_one_graph():
    values, offsets, _ = make_batch(MIXED, 4, seed=3, ids="powerlaw")
    eager = TinyRanker(seed=2, optimizer="rowwise_adagrad", lr=0.1)
    other = TinyRanker(seed=2, optimizer="rowwise_adagrad", lr=0.1)
    other.load_state_dict(eager.state_dict())
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(other, backend=counting, fullgraph=True)
    for _ in range(2):
        eager(values, offsets).sum().backward()
        compiled(values, offsets).sum().backward()
    torch.testing.assert_close(other.embeddings.weights, eager.embeddings.weights)
    assert int(other.embeddings.step) == 2
    assert len(graphs) == 1  # no graph break (the id checks stay on the device), no recompilation


# --- on a GPU: real sizes, bf16 ----------------------------------------------------------------------------


def fp32_tolerance(values: torch.Tensor, lengths: torch.Tensor) -> float:
    """A relative-error bound for two fp32 computations of the same sums in different orders.

    The longest sum is a row's gradient over all its occurrences in the batch (or the longest bag, forward);
    rounding errors of n additions grow like sqrt(n) * u with high probability (Higham & Mary, "A new approach
    to probabilistic rounding error analysis", 2019), u = 2**-24 for fp32; 4 covers both computations and the
    constant. Summation order differs between GPUs (the segment pass's program split follows the SM count):
    on an H200 the powerlaw/adam case differed by 1.62e-6, past the fixed 1e-6 this replaced (issue 39)."""
    longest = max(int(torch.bincount(values.cpu()).max()), int(lengths.max()))
    return max(1e-6, 4 * longest ** 0.5 * 2.0 ** -24)


def test_fp32_tolerance_grows_with_the_longest_sum():
    one_each = fp32_tolerance(torch.arange(1000), torch.ones(1000, dtype=torch.int64))
    hot = fp32_tolerance(torch.zeros(40_000, dtype=torch.int64), torch.ones(40_000, dtype=torch.int64))
    assert one_each == 1e-6  # the floor: no long sum
    assert hot == pytest.approx(4 * 200 * 2.0 ** -24)  # sqrt(40,000) = 200


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("ids", ["powerlaw", "zipf"])
def test_gpu_real_sizes(dtype, optimizer, ids):
    assert triton_usable(torch.device("cuda"))
    tables = [TableConfig(f"t{i}", 100_000, dim, pooling="sum" if i % 2 else "mean")
              for i, dim in enumerate([32, 64, 128, 20])]
    modules = [EmbeddingBagCollection(tables, optimizer=optimizer, lr=0.01, device="cuda", dtype=dtype,
                                      backend=backend, seed=3) for backend in ("reference", "triton")]
    g = torch.Generator().manual_seed(0)
    batch = 4096
    lengths = torch.randint(0, 20, (len(tables) * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    values = draw_ids(int(lengths.sum()), 100_000, ids, g).cuda()
    tolerance = fp32_tolerance(values, lengths) if dtype == torch.float32 else 1e-2
    outs = [m(values, offsets) for m in modules]
    assert_close("gpu forward", outs[0], outs[1], tolerance)
    upstream = torch.randn_like(outs[0])
    for out in outs:
        (out * upstream).sum().backward()
    assert_close("gpu weights", modules[0].weights.float(), modules[1].weights.float(), tolerance)
    assert_close("gpu state", modules[0].state1, modules[1].state1, 1e-4)


@pytest.mark.gpu
def test_gpu_hot_row_split_and_deterministic():
    g = torch.Generator().manual_seed(1)
    tables = [TableConfig("three", 3, 128), TableConfig("big", 1_000_000, 128)]
    batch = 65536  # ~22k occurrences of each of the three rows: runs of ~85 CHUNKs
    assert batch // 3 > 50 * CHUNK
    values = torch.cat([torch.randint(0, 3, (batch,), generator=g), draw_ids(batch, 1_000_000, "zipf", g)]).cuda()
    offsets = torch.arange(2 * batch + 1).cuda()
    upstream = torch.randn(batch, 256, device="cuda")
    runs = []
    for backend in ("reference", "triton", "triton"):
        ebc = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.01, device="cuda", backend=backend)
        (ebc(values, offsets) * upstream).sum().backward()
        runs.append(ebc.weights.clone())
    assert torch.equal(runs[1], runs[2])
    assert_close("gpu hot rows", runs[0], runs[1], 1e-5)
