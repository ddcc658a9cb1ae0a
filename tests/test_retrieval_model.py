"""Two-tower model: the in-batch softmax loss against a hand computation, and training steps that learn."""

from __future__ import annotations

import math

import pytest
import torch

from recloop.model.retrieval import RetrievalConfig, TwoTowerModel, in_batch_softmax_loss


def reference_loss(users, items, item_ids, log_q, temperature) -> float:
    """The loss written out element by element (module docstring of recloop.model.retrieval)."""
    total = 0.0
    for i, u in enumerate(users):
        logits = []
        for j, v in enumerate(items):
            if j != i and item_ids[j] == item_ids[i]:
                continue  # an accidental hit is not a negative
            logit = sum(a * b for a, b in zip(u, v, strict=True)) / temperature
            logits.append((j, logit - (log_q[j] if log_q is not None else 0.0)))
        normalizer = math.log(sum(math.exp(x) for _, x in logits))
        total += normalizer - dict(logits)[i]
    return total / len(users)


@pytest.mark.parametrize("with_logq", [True, False], ids=["logq", "no-correction"])
def test_loss_matches_a_hand_computation_on_a_tiny_batch(with_logq):
    users = [[0.6, 0.8], [1.0, 0.0], [0.0, -1.0], [0.28, 0.96]]
    items = [[0.8, 0.6], [0.6, -0.8], [-1.0, 0.0], [0.8, 0.6]]
    item_ids = [7, 3, 5, 7]  # rows 0 and 3 clicked the same item: not each other's negative
    log_q = [math.log(0.5), math.log(0.1), math.log(0.05), math.log(0.5)] if with_logq else None
    got = in_batch_softmax_loss(torch.tensor(users), torch.tensor(items), torch.tensor(item_ids),
                                torch.tensor(log_q) if log_q else None, temperature=0.2)
    want = reference_loss(users, items, item_ids, log_q, 0.2)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_the_correction_lowers_the_loss_share_of_popular_negatives():
    torch.manual_seed(0)
    users, items = torch.nn.functional.normalize(torch.randn(2, 8, 4), dim=2)
    ids = torch.arange(8)
    popular = torch.full((8,), math.log(1 / 8))
    popular[0] = math.log(0.9)  # item 0 is sampled far more often: its logit is discounted
    plain = in_batch_softmax_loss(users, items, ids, None, 0.1)
    corrected = in_batch_softmax_loss(users, items, ids, popular, 0.1)
    assert not torch.isclose(plain, corrected)
    gradient_item = items.clone().requires_grad_(True)
    in_batch_softmax_loss(users, gradient_item, ids, popular, 0.1).backward()
    assert torch.isfinite(gradient_item.grad).all()


def tiny_model(seed: int = 0) -> TwoTowerModel:
    config = RetrievalConfig(table_dim=8, hidden=(16,), output_dim=8, embedding_lr=0.1)
    return TwoTowerModel(config, [("c_user_id", 20), ("c_device", 4), ("m_history", 30)],
                         [("c_item_id", 30), ("c_category", 5)], item_dense=1, multi_hot={"m_history"}, seed=seed)


def test_training_steps_lower_the_loss_and_update_only_touched_rows():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    batch = 16
    users = torch.randint(2, 20, (batch,), generator=g)
    items = torch.randint(2, 30, (batch,), generator=g)
    devices = torch.randint(2, 4, (batch,), generator=g)
    lengths = torch.randint(0, 4, (batch,), generator=g)  # some users have no history
    history = torch.randint(2, 30, (int(lengths.sum()),), generator=g)
    user_values = torch.cat([users, devices, history])
    user_offsets = torch.cat([torch.arange(0, 2 * batch + 1), 2 * batch + torch.cumsum(lengths, 0)])
    categories = items % 5
    item_values = torch.cat([items, categories])
    item_offsets = torch.arange(0, 2 * batch + 1)
    dense = torch.randn(batch, 1, generator=g)
    before = model.item_tower.embeddings.weight("c_item_id").clone()
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        u, v = model(user_values, user_offsets, item_values, item_offsets, dense)
        assert u.shape == v.shape == (batch, 8)
        assert torch.allclose(u.norm(dim=1), torch.ones(batch), atol=1e-5)
        loss = in_batch_softmax_loss(u, v, items, None, model.config.temperature)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    after = model.item_tower.embeddings.weight("c_item_id")
    touched = torch.zeros(30, dtype=torch.bool)
    touched[items] = True
    assert not torch.equal(before[touched], after[touched])
    assert torch.equal(before[~touched], after[~touched])  # the fused optimizer leaves other rows alone


def test_unknown_ids_map_to_the_out_of_vocabulary_row():
    model = tiny_model()
    values = torch.tensor([5, 25, 2, 3, 7, 40])  # user ids (one beyond 20 rows), devices, one history list
    offsets = torch.tensor([0, 1, 2, 3, 4, 4, 6])
    mapped = model.user_tower.known_ids(values, offsets)
    assert mapped.tolist() == [5, 1, 2, 3, 7, 1]


def test_towers_under_a_row_budget_hold_at_most_it_and_still_embed_evicted_ids():
    """User, item and history tables under budgets of 6, 8 and 8 rows; 60 steps over 40 users and 50 items (ids
    far beyond the budgets, and beyond 2**40): the tables stay within them, the towers train, and an evicted id
    is still embedded (its fallback row), a finite unit vector."""
    budgets = (("c_user_id", 6), ("c_item_id", 8), ("m_history", 8))
    config = RetrievalConfig(table_dim=8, hidden=(16,), output_dim=8, embedding_lr=0.1, max_rows=budgets,
                             admit_after=1, fallback_rows=4)
    model = TwoTowerModel(config, [("c_user_id", 20), ("c_device", 4), ("m_history", 30)],
                          [("c_item_id", 30), ("c_category", 5)], item_dense=1, multi_hot={"m_history"})
    assert model.user_tower.dynamic_tables == ("c_user_id", "m_history")
    assert model.item_tower.dynamic_tables == ("c_item_id",)
    g = torch.Generator().manual_seed(2)
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=1e-2)
    batch, big = 16, 2**40
    for _ in range(60):
        users = big + torch.randint(0, 40, (batch,), generator=g)
        items = big + torch.randint(0, 50, (batch,), generator=g)
        lengths = torch.randint(0, 3, (batch,), generator=g)
        history = big + torch.randint(0, 50, (int(lengths.sum()),), generator=g)
        user_values = torch.cat([users, torch.randint(2, 4, (batch,), generator=g), history])
        user_offsets = torch.cat([torch.arange(0, 2 * batch + 1), 2 * batch + torch.cumsum(lengths, 0)])
        u, v = model(user_values, user_offsets, torch.cat([items, items % 5]), torch.arange(0, 2 * batch + 1),
                     torch.randn(batch, 1, generator=g))
        loss = in_batch_softmax_loss(u, v, items, None, model.config.temperature)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held = {**model.user_tower.embeddings.rows_held(), **model.item_tower.embeddings.rows_held()}
    assert held == {"c_user_id": 6, "m_history": 8, "c_item_id": 8}  # full, and never beyond
    assert model.user_tower.embeddings.evicted > 0 and model.item_tower.embeddings.evicted > 0
    everyone = big + torch.arange(50)
    has_row = model.item_tower.has_row("c_item_id", everyone)
    assert int(has_row.sum()) == 8
    model.eval()
    evicted = everyone[~has_row][:5]
    values = torch.cat([evicted, evicted % 5])
    assert torch.equal(model.item_tower.known_ids(values, torch.arange(11)), values)  # any id, as it is
    vectors = model.item_tower(values, torch.arange(11), torch.zeros(5, 1))
    assert torch.isfinite(vectors).all() and torch.allclose(vectors.norm(dim=1), torch.ones(5), atol=1e-5)
