"""The training step: one compiled graph, nothing read back per step, id errors raised at the interval,
and the trainer core importable without recloop's service packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recloop.data import VALUES_BUCKET, ChunkLoader
from recloop.data.synthetic import write_training_rows
from recloop.model import (
    ModelConfig,
    RankingModel,
    StepConfig,
    TrainStep,
    default_batch_size,
    dense_optimizer,
    fit,
)

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON = pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
SERVICES = ("prefect", "mlflow", "feast", "evidently", "pandera", "pydantic", "pydantic_settings", "typer")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """600 synthetic rows: two one-hot tables, one multi-hot (lists of 0..4 ids), 3 dense columns."""
    return write_training_rows(tmp_path_factory.mktemp("rows"), rows=600, files=2, dense=3, hotness=2,
                               categorical={"c_user": 50, "c_item": 30}, multi_hot={"m_history": 30},
                               row_group_size=128)


def small_model(schema, backend: str = "auto", seed: int = 0) -> RankingModel:
    config = ModelConfig(embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,), embedding_lr=0.1,
                         multi_hot_columns=tuple(schema.multi_hot), embedding_backend=backend)
    return RankingModel(config, len(schema.dense), schema.tables, seed=seed)


def batches(rows, batch_size=128, **kwargs):
    files, schema = rows
    return list(ChunkLoader(files, schema, batch_size, seed=0, shuffle_chunks=2, **kwargs).epoch(0))


def test_the_step_compiles_to_one_graph_and_matches_eager(rows):
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    torch._dynamo.reset()
    data = batches(rows, batch_size=128, pad_values_to=32)  # multi-hot: batches have other numbers of ids
    assert len({b.values.numel() for b in data}) > 1 and data[-1].size < data[0].size
    results = []
    for backend in (counting, "off"):
        model = small_model(rows[1])
        step = TrainStep(model, torch.optim.Adam(model.dense_parameters(), lr=0.01), StepConfig(compile=backend),
                         "cpu")
        summary = fit(step, data, lr=0.01)
        results.append((model.state_dict(), summary))
    (compiled, summary), (eager, _) = results
    assert len(graphs) == 1  # whole forward + loss, one graph for every full batch (values dynamic)
    assert summary["steps"] == len(data) and summary["samples"] == 600
    for key in compiled:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5, msg=key)


@TRITON
def test_a_step_reads_no_value_back_and_matches_the_reference(rows):
    from test_loader import no_tensor_reads

    data = batches(rows)[:3]
    models = []
    for backend in ("triton", "reference"):
        model = small_model(rows[1], backend=backend, seed=1)
        # SGD: torch's CPU Adam reads its step counter with .item() (CUDA's fused Adam does not).
        step = TrainStep(model, torch.optim.SGD(model.dense_parameters(), lr=0.05),
                         StepConfig(compile="off", loss_every=100, id_check_every=100), "cpu")
        if backend == "triton":
            with no_tensor_reads():
                for batch in data:
                    step(batch, lr=0.05)
        else:
            for batch in data:
                step(batch, lr=0.05)
        step.finish()
        models.append(model.state_dict())
    for key in models[0]:
        torch.testing.assert_close(models[0][key], models[1][key], rtol=1e-4, atol=1e-6, msg=key)


def test_ids_beyond_a_table_raise_at_the_check_interval(rows):
    data = batches(rows)
    model = small_model(rows[1])
    step = TrainStep(model, dense_optimizer(model, 0.01, "cpu"), StepConfig(compile="off", id_check_every=3), "cpu")
    bad = data[1]
    bad.values[0] = 10_000  # the first id of table c_user: beyond its 50 rows
    step(data[0], lr=0.01)
    step(bad, lr=0.01)  # recorded on the device; the step goes on
    with pytest.raises(IndexError, match=r"'c_user' has 50 rows; got ids in \[10000, 10000\]"):
        step(data[2], lr=0.01)


def test_the_loss_is_read_at_its_interval_and_training_learns(rows):
    data = batches(rows, batch_size=64) * 4
    model = small_model(rows[1])
    step = TrainStep(model, dense_optimizer(model, 0.02, "cpu"), StepConfig(loss_every=5), "cpu")
    summary = fit(step, data, lr=lambda s: 0.02 * min(1.0, s / 10))
    assert [s for s, _ in summary["loss_curve"]] == list(range(5, summary["steps"] + 1, 5))
    first, last = summary["loss_curve"][0][1], summary["loss_curve"][-1][1]
    assert last < first, summary["loss_curve"]
    assert default_batch_size("cpu") == 4096 and default_batch_size(torch.device("cuda")) == 16384


BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: not on the GPU machine")
sys.meta_path.insert(0, Block())
"""


def run_without_services(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run Python ``code`` with recloop's service packages made unimportable (as on the GPU machine)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "kernels")])}
    return subprocess.run([sys.executable, "-c", BLOCKER + code, ",".join(SERVICES), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_the_trainer_core_imports_without_service_packages():
    result = run_without_services(
        "import recloop_kernels, recloop.data, recloop.data.synthetic, recloop.model, recloop.model.fit, "
        "recloop.evaluate\n"
        "try:\n    import recloop.settings\nexcept ImportError:\n    print('blocked as expected')\n")
    assert result.returncode == 0, result.stderr
    assert "blocked as expected" in result.stdout


@pytest.mark.gpu
def test_on_a_gpu_the_step_replays_as_cuda_graphs_and_matches_eager(rows):
    # H100, 2026-11-25: with CUDA graphs (StepConfig's default on a GPU) the step failed, "tensors in the
    # cudagraph pool not tracked as outputs": the kernels' device copy of the table layout was first built
    # inside the graph's warm-up run. fp32 here (bf16=False) so that compiled and eager can be compared.
    files, schema = rows
    data = list(ChunkLoader(files, schema, 100, device="cuda", seed=0, shuffle_chunks=2, pad_values_to=256).epoch(0))
    # every batch full, so that every step replays the graph (H200, 2026-11-26: a group of chunks' remainder
    # was a smaller batch mid-epoch, 100, 72, 100, 72, 100, 100, 56; it now joins the next group)
    assert [b.size for b in data] == [100] * 6
    torch._dynamo.reset()
    states = []
    for step_config in (StepConfig(bf16=False), StepConfig(compile="off", bf16=False)):
        config = ModelConfig(embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,), embedding_lr=0.1,
                             multi_hot_columns=tuple(schema.multi_hot))
        model = RankingModel(config, len(schema.dense), schema.tables, device="cuda", seed=0)
        step = TrainStep(model, dense_optimizer(model, 0.01, "cuda"), step_config, "cuda")
        summary = fit(step, data + data, lr=0.01)  # two passes: the second replays recorded graphs
        assert summary["steps"] == 2 * len(data)
        states.append(model.state_dict())
    compiled, eager = states
    for key in compiled:
        torch.testing.assert_close(compiled[key].float(), eager[key].float(), rtol=1e-3, atol=1e-3, msg=key)


@pytest.mark.gpu
def test_on_a_gpu_a_default_built_loader_gives_one_graph_per_bucket(rows):
    """Issue 39: ``ChunkLoader`` built with its defaults on a GPU (no ``pad_values_to``) with multi-hot columns:
    every batch's ids have the bucket's length, so the compiled step compiles once and its CUDA graphs are
    recorded for one shape, not one per batch (H200: 1.0M samples/s unpadded against 11.4M at batch 16K)."""
    files, schema = rows
    unpadded = list(ChunkLoader(files, schema, 100, device="cuda", seed=0, shuffle_chunks=2,
                                pad_values_to=None).epoch(0))
    data = list(ChunkLoader(files, schema, 100, device="cuda", seed=0, shuffle_chunks=2).epoch(0))
    assert len({b.values.numel() for b in unpadded}) > 1  # the footgun: a length per batch
    assert {b.values.numel() for b in data} == {VALUES_BUCKET}  # one bucket (100 rows hold fewer ids)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = ModelConfig(embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,), embedding_lr=0.1,
                         multi_hot_columns=tuple(schema.multi_hot))
    model = RankingModel(config, len(schema.dense), schema.tables, device="cuda", seed=0)
    step = TrainStep(model, dense_optimizer(model, 0.01, "cuda"), StepConfig(bf16=False), "cuda")
    assert fit(step, data + data, lr=0.01)["steps"] == 2 * len(data)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation for another length


def test_the_wide_part_starts_as_the_dlrm_and_learns_an_ids_own_rate(rows):
    """``ModelConfig.wide`` adds a linear part (a weight per dense input, a learned scalar per id): zero at
    first, so the wide model scores exactly as the DLRM with the same seed; trained, it moves; and a config
    written before the option (no ``wide`` key) builds the model it was trained as."""
    files, schema = rows
    batch = batches(rows)[0]
    shape = dict(embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,), multi_hot_columns=tuple(schema.multi_hot))
    deep = RankingModel(ModelConfig(**shape, wide=False), len(schema.dense), schema.tables)
    wide = RankingModel(ModelConfig(**shape, wide=True), len(schema.dense), schema.tables)
    assert deep.wide_arch is None and wide.wide_arch is not None
    with torch.no_grad():
        assert torch.equal(deep(batch.dense, batch.values, batch.offsets),
                           wide(batch.dense, batch.values, batch.offsets))
    step = TrainStep(wide, dense_optimizer(wide, 1e-2, "cpu"), StepConfig(compile="off"), "cpu")
    for batch in batches(rows)[:3]:
        step(batch, lr=1e-2)
    step.finish()
    assert wide.wide_arch.linear.weight.abs().sum() > 0
    written_before = {k: v for k, v in ModelConfig(wide=True).to_dict().items() if k != "wide"}
    assert ModelConfig.from_dict(written_before).wide is False
