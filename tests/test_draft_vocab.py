import torch

from eagle_train.draft_vocab import build_draft_vocab, count_tokens, draft_ids_of, load_draft_vocab, save_draft_vocab
from eagle_train.eagle3 import Eagle3Config, Eagle3Head


def test_most_frequent_loss_masked_tokens_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    vocab = 300
    samples = []
    for _ in range(40):
        ids = torch.randint(0, vocab, (50,), generator=g) ** 2 % vocab  # skewed frequencies
        mask = (torch.arange(50) >= 20).long()
        samples.append((ids, mask))
    counts = count_tokens(samples, vocab)
    expect = torch.zeros(vocab, dtype=torch.long)
    for ids, mask in samples:
        for t in ids[mask.bool()].tolist():
            expect[t] += 1
    assert torch.equal(counts, expect)  # only loss-masked tokens are counted

    d2t, t2d = build_draft_vocab(counts, 32)
    chosen = draft_ids_of(d2t)
    # every draft id maps through d2t back to the target id it was built from, in t2d
    assert torch.equal(chosen, torch.arange(32) + d2t)
    assert torch.equal(t2d.nonzero().squeeze(1), chosen)
    assert t2d.sum() == 32 and (chosen.diff() > 0).all() and (d2t >= 0).all()
    # they are the 32 most frequent (ties by lower id)
    ranked = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))[:32]
    assert sorted(ranked) == chosen.tolist()

    save_draft_vocab(tmp_path / "v.safetensors", d2t, t2d, counts)
    d2t2, t2d2 = load_draft_vocab(tmp_path / "v.safetensors")
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)

    # the head's own mapping agrees
    head = Eagle3Head(Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=8, vocab_size=vocab, draft_vocab_size=32, aux_layers=[1, 2, 3]))
    head.set_draft_vocab(d2t, t2d)
    assert torch.equal(head.draft_to_target(torch.arange(32)), chosen)
    logits = torch.randn(2, 32)
    full = head.target_logits(logits)
    assert torch.equal(full[:, chosen], logits) and torch.isinf(full[:, ~t2d]).all()


def test_larger_than_seen_is_filled_deterministically_and_capped():
    counts = torch.zeros(100, dtype=torch.long)
    counts[[50, 7, 99]] = torch.tensor([5, 3, 1])
    d2t, t2d = build_draft_vocab(counts, 10)
    chosen = draft_ids_of(d2t).tolist()
    assert len(chosen) == 10 and {50, 7, 99} <= set(chosen)
    assert sorted(set(chosen) - {50, 7, 99}) == [0, 1, 2, 3, 4, 5, 6]  # lowest unused ids
    assert torch.equal(build_draft_vocab(counts, 10)[0], d2t)
    d2t, t2d = build_draft_vocab(counts, 5000)  # capped at the target vocabulary
    assert d2t.numel() == 100 and t2d.all() and (d2t == 0).all()


def test_swap_gives_the_least_counted_slots_to_more_counted_outsiders_only():
    counts = torch.tensor([9, 1, 0, 7, 3, 8, 2, 5, 0, 4])
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[0, 1, 2, 3, 4]] = True  # a head's vocabulary: counts 9, 1, 0, 7, 3
    # outside, most counted first: 5 (8), 7 (5), 9 (4), 6 (2); weakest kept: 2 (0), 1 (1), 4 (3), 3 (7)
    for swap, chosen in [(0, [0, 1, 2, 3, 4]), (1, [0, 1, 3, 4, 5]), (2, [0, 3, 4, 5, 7]),
                         (3, [0, 3, 5, 7, 9]), (5, [0, 3, 5, 7, 9])]:
        d2t, t2d = build_draft_vocab(counts, 5, keep=keep, swap=swap)
        assert draft_ids_of(d2t).tolist() == chosen, (swap, draft_ids_of(d2t).tolist())
        assert t2d.sum() == 5
    # 4 (3) against 9 (4): swapped at swap=3; 3 (7) against 6 (2) never is, however large the swap
