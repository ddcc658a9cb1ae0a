"""recloop_kernels against independent oracles (nn.EmbeddingBag, torch.optim) and its own reference.

Every test runs on fresh random inputs, with uniform and power-law ids full of duplicates. On a CPU the
Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py) on small shapes; the ``gpu`` tests at
the end repeat the comparisons at real sizes and in bf16 on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from recloop_kernels import EmbeddingBagCollection, TableConfig
from recloop_kernels.embedding_bag import triton_usable

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"))]
MIXED = [TableConfig("user", 40, 8), TableConfig("item", 25, 4, pooling="mean"), TableConfig("ctx", 9, 20)]
ONE = [TableConfig("only", 60, 16)]


def assert_close(name: str, expected: torch.Tensor, actual: torch.Tensor, tolerance: float) -> None:
    """Relative error ‖actual − expected‖ / ‖expected‖ under ``tolerance``; NaN never passes."""
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    error = (actual.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-12)
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


def make_batch(tables, batch_size: int, seed: int, power_law: bool, max_bag: int = 6, weighted: bool = False):
    """Table-major bags with empty bags, duplicates within and across bags."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_bag + 1, (len(tables) * batch_size,), generator=g)
    lengths[::5] = 0  # empty bags
    values = []
    for t, table in enumerate(tables):
        n = int(lengths[t * batch_size:(t + 1) * batch_size].sum())
        if power_law:  # a few hot rows take most lookups
            ids = (torch.rand(n, generator=g) ** 4 * table.num_embeddings).long()
        else:
            ids = torch.randint(0, table.num_embeddings, (n,), generator=g)
        values.append(ids)
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


CASES = [
    pytest.param(MIXED, False, False, id="mixed-dims-uniform"),
    pytest.param(MIXED, True, True, id="mixed-dims-powerlaw-weighted"),
    pytest.param(ONE, True, False, id="one-table-powerlaw"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tables", "power_law", "weighted"), CASES)
def test_forward_matches_nn_embedding_bag(backend, tables, power_law, weighted):
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(tables, backend=backend, seed=3)
    values, offsets, weights = make_batch(tables, 7, seed=5, power_law=power_law, weighted=weighted)
    expected = oracle_forward(oracle_bags(ebc), tables, values, offsets, weights, 7)
    out = ebc(values, offsets, weights)
    assert out.shape == (7, sum(t.dim for t in tables))
    assert_close("forward", expected, out, 1e-6)  # fp32 sums of a few rows
    empty = (offsets[1:] == offsets[:-1]).nonzero().flatten()
    t0 = empty[empty < 7]
    if len(t0):
        assert (out[t0, : tables[0].dim] == 0).all(), "empty bags pool to zeros"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_gradient_without_optimizer_matches_autograd(backend, sparse):
    ebc = EmbeddingBagCollection(MIXED, backend=backend, sparse=sparse, seed=2)
    bags = oracle_bags(ebc)
    values, offsets, weights = make_batch(MIXED, 6, seed=8, power_law=True, weighted=True)
    upstream = torch.randn(6, sum(t.dim for t in MIXED))
    (ebc(values, offsets, weights) * upstream).sum().backward()
    (oracle_forward(bags, MIXED, values, offsets, weights, 6) * upstream).sum().backward()
    grad = ebc.weights.grad
    assert grad.is_sparse == sparse
    grad = grad.to_dense() if sparse else grad
    for t, (bag, table) in enumerate(zip(bags, MIXED, strict=True)):
        start = ebc.layout.elem_offsets[t]
        mine = grad[start:start + table.num_embeddings * table.dim].view(table.num_embeddings, table.dim)
        assert_close(f"grad {table.name}", bag.weight.grad, mine, 1e-6)


def train_steps(ebc, tables, steps, power_law, seed, weighted=True):
    for step in range(steps):
        values, offsets, weights = make_batch(tables, 5, seed=seed + step, power_law=power_law, weighted=weighted)
        upstream = torch.randn(5, sum(t.dim for t in tables), generator=torch.Generator().manual_seed(step))
        (ebc(values, offsets, weights) * upstream).sum().backward()


@pytest.mark.parametrize("power_law", [False, True], ids=["uniform", "powerlaw"])
@pytest.mark.parametrize(("optimizer", "torch_optimizer"), [
    ("sgd", lambda params: torch.optim.SGD(params, lr=0.1)),
    ("adagrad", lambda params: torch.optim.Adagrad(params, lr=0.1, eps=1e-12)),
    ("adam", lambda params: torch.optim.SparseAdam(params, lr=0.1, eps=1e-12)),
])
def test_fused_optimizers_match_torch_optim(optimizer, torch_optimizer, power_law):
    """Fused sgd / adagrad / lazy adam == torch.optim on sparse gradients, over several steps."""
    tables = [TableConfig("a", 30, 8), TableConfig("b", 20, 4, pooling="mean")]
    # eps=1e-12: SparseAdam adds eps to sqrt(v) before bias correction, recloop after (as in Adam);
    # the two agree when eps is negligible against the gradients.
    ebc = EmbeddingBagCollection(tables, optimizer=optimizer, lr=0.1, eps=1e-12, seed=4)
    bags = oracle_bags(ebc, sparse=True)
    opt = torch_optimizer(list(bags.parameters()))
    for step in range(4):
        values, offsets, weights = make_batch(tables, 5, seed=20 + step, power_law=power_law, weighted=True)
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


@pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("power_law", [False, True], ids=["uniform", "powerlaw"])
def test_triton_fused_update_matches_the_reference(optimizer, power_law):
    """Weights and optimizer state after several fused steps, weight decay included."""
    modules = [EmbeddingBagCollection(MIXED, optimizer=optimizer, lr=0.05, weight_decay=0.01, backend=backend,
                                      seed=6) for backend in ("reference", "triton")]
    for ebc in modules:
        train_steps(ebc, MIXED, steps=3, power_law=power_law, seed=40)
    reference, triton_ = modules
    assert_close("weights", reference.weights, triton_.weights, 1e-6)
    for name in ("state1", "state2"):
        if getattr(reference, name).numel():
            assert_close(name, getattr(reference, name), getattr(triton_, name), 1e-5)
    assert int(reference.step) == int(triton_.step) == 3


@pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_is_deterministic():
    runs = []
    for _ in range(2):
        ebc = EmbeddingBagCollection(ONE, optimizer="adagrad", lr=0.1, backend="triton", seed=1)
        train_steps(ebc, ONE, steps=3, power_law=True, seed=60)
        runs.append(ebc.weights.clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
def test_half_weights_keep_fp32_state_and_round_stochastically():
    tables = [TableConfig("a", 30, 8)]
    full = EmbeddingBagCollection(tables, optimizer="adagrad", lr=0.05, backend="reference", seed=9)
    half = EmbeddingBagCollection(tables, optimizer="adagrad", lr=0.05, dtype=torch.float16, backend="triton", seed=9)
    values, offsets, weights = make_batch(tables, 6, seed=1, power_law=True)
    assert_close("fp16 forward", full(values, offsets), half(values, offsets), 1e-3)
    train_steps(full, tables, 3, power_law=True, seed=70)
    train_steps(half, tables, 3, power_law=True, seed=70)
    assert half.weights.dtype == torch.float16 and half.state1.dtype == torch.float32
    assert_close("fp16 weights", full.weights, half.weights.float(), 5e-3)
    # Updates far below half an ulp (1.0 in fp16: ulp 2^-10): round-to-nearest would never move the
    # weight; stochastic rounding moves it by the right amount on average.
    sgd = EmbeddingBagCollection([TableConfig("w", 1, 64, init="zeros")], optimizer="sgd", lr=1.0,
                                 dtype=torch.float16, backend="triton")
    sgd.weights.data.fill_(1.0)
    for _ in range(200):
        (sgd(torch.tensor([0]), torch.tensor([0, 1])) * 1e-4).sum().backward()
    mean = sgd.weights.float().mean().item()
    assert abs(mean - (1.0 - 200 * 1e-4)) < 0.004, mean


@pytest.mark.parametrize("backend", BACKENDS)
def test_grow_keeps_rows_and_state_and_new_ids_work(backend):
    ebc = EmbeddingBagCollection(MIXED, optimizer="rowwise_adagrad", lr=0.1, backend=backend, seed=5)
    train_steps(ebc, MIXED, steps=2, power_law=False, seed=80)
    old_item, old_user = ebc.weight("item").clone(), ebc.weight("user").clone()
    old_state = ebc.state1[ebc.layout.row_offsets[1]:ebc.layout.row_offsets[1] + 25].clone()
    ebc.grow("item", 30)  # beyond capacity: reallocation
    ebc.grow("item", 31)  # within the reserved capacity
    assert ebc.weight("item").shape == (31, 4) and ebc.layout.capacities[1] >= 37
    torch.testing.assert_close(ebc.weight("item")[:25], old_item)
    torch.testing.assert_close(ebc.weight("user"), old_user)
    torch.testing.assert_close(ebc.state1[ebc.layout.row_offsets[1]:ebc.layout.row_offsets[1] + 25], old_state)
    assert ebc.weight("item")[25:].abs().sum() > 0  # initialized, not zeros
    values = torch.tensor([1, 30, 2])
    offsets = torch.tensor([0, 1, 2, 3])  # user: [1]; item: [30]; ctx: [2]  (B = 1)
    ebc(values, offsets).sum().backward()
    with pytest.raises(ValueError, match="only grow"):
        ebc.grow("item", 10)


def test_state_round_trips_through_safetensors(tmp_path):
    ebc = EmbeddingBagCollection(MIXED, optimizer="adam", lr=0.05, seed=1)
    train_steps(ebc, MIXED, steps=2, power_law=True, seed=90)
    ebc.grow("user", 70)
    save_file(ebc.state_dict(), tmp_path / "ebc.safetensors")
    fresh = EmbeddingBagCollection(MIXED, optimizer="adam", lr=0.05, seed=99)  # smaller, other weights
    fresh.load_state_dict(load_file(tmp_path / "ebc.safetensors"))
    assert fresh.weight("user").shape == (70, 8)
    for name in ("weights", "state1", "state2", "step"):
        assert torch.equal(getattr(fresh, name), getattr(ebc, name)), name
    train_steps(ebc, MIXED, steps=1, power_law=True, seed=95)
    train_steps(fresh, MIXED, steps=1, power_law=True, seed=95)
    assert torch.equal(fresh.weights, ebc.weights)
    wrong = EmbeddingBagCollection([TableConfig("user", 40, 16)], optimizer="adam")
    with pytest.raises(RuntimeError, match="dims differ"):
        wrong.load_state_dict(load_file(tmp_path / "ebc.safetensors"))


def test_bad_input_is_refused_clearly():
    ebc = EmbeddingBagCollection(MIXED)
    values, offsets, _ = make_batch(MIXED, 3, seed=0, power_law=False)
    offsets_b1 = torch.tensor([0, 1, 2, 3])  # B = 1: one id per table
    with pytest.raises(IndexError, match="'item' has 25 rows; got ids in \\[25, 25\\]"):
        ebc(torch.tensor([0, 25, 0]), offsets_b1)
    with pytest.raises(IndexError, match="got ids in \\[-1"):
        ebc(torch.tensor([-1, 0, 0]), offsets_b1)
    with pytest.raises(ValueError, match="T\\*B\\+1"):
        ebc(values, offsets[:-1])
    with pytest.raises(TypeError, match="int64"):
        ebc(values.int(), offsets)
    with pytest.raises(ValueError, match="unique names"):
        EmbeddingBagCollection([TableConfig("a", 2, 2), TableConfig("a", 3, 2)])
    with pytest.raises(ValueError, match="unknown optimizer"):
        EmbeddingBagCollection(MIXED, optimizer="lamb")


class TinyRanker(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.embeddings = EmbeddingBagCollection(MIXED, **kwargs)
        self.head = nn.Linear(self.embeddings.embedding_dim, 1)

    def forward(self, values, offsets):
        return self.head(self.embeddings(values, offsets)).squeeze(-1)


def test_works_under_torch_compile_and_export():
    values, offsets, _ = make_batch(MIXED, 4, seed=3, power_law=False)
    eager = TinyRanker(seed=1, check_ids=False)
    compiled_model = TinyRanker(seed=1, check_ids=False)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(values, offsets), eager(values, offsets))
    compiled(values, offsets).sum().backward()
    eager(values, offsets).sum().backward()
    torch.testing.assert_close(compiled_model.embeddings.weights.grad, eager.embeddings.weights.grad)

    to_export = TinyRanker(seed=1, check_ids=False)
    to_export.load_state_dict(eager.state_dict())
    exported = torch.export.export(to_export.eval(), (values, offsets))
    assert any("recloop.embedding_bags" in str(node.target) for node in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(values, offsets), eager(values, offsets))


def test_fused_optimizer_trains_under_torch_compile():
    values, offsets, _ = make_batch(MIXED, 4, seed=3, power_law=True)
    eager = TinyRanker(seed=2, optimizer="rowwise_adagrad", lr=0.1, check_ids=False)
    other = TinyRanker(seed=2, optimizer="rowwise_adagrad", lr=0.1, check_ids=False)
    other.load_state_dict(eager.state_dict())
    compiled = torch.compile(other, backend="aot_eager")
    for _ in range(2):
        eager(values, offsets).sum().backward()
        compiled(values, offsets).sum().backward()
    torch.testing.assert_close(other.embeddings.weights, eager.embeddings.weights)
    assert int(other.embeddings.step) == 2


# --- on a GPU: real sizes, bf16 ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_gpu_real_sizes(dtype, optimizer):
    assert triton_usable(torch.device("cuda"))
    tables = [TableConfig(f"t{i}", 100_000, dim, pooling="sum" if i % 2 else "mean")
              for i, dim in enumerate([32, 64, 128, 16])]
    modules = [EmbeddingBagCollection(tables, optimizer=optimizer, lr=0.01, device="cuda", dtype=dtype,
                                      backend=backend, seed=3) for backend in ("reference", "triton")]
    g = torch.Generator().manual_seed(0)
    batch = 4096
    lengths = torch.randint(0, 20, (len(tables) * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    values = ((torch.rand(int(lengths.sum()), generator=g) ** 3) * 100_000).long().cuda()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    outs = [m(values, offsets) for m in modules]
    assert_close("gpu forward", outs[0], outs[1], tolerance)
    upstream = torch.randn_like(outs[0])
    for out in outs:
        (out * upstream).sum().backward()
    assert_close("gpu weights", modules[0].weights.float(), modules[1].weights.float(), tolerance)
    assert_close("gpu state", modules[0].state1, modules[1].state1, 1e-4)
